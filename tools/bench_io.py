"""Result files of the benchmarks, rewritten after every case: a run stopped by its time limit on the GPU host
keeps what it measured (session 3 lost whole JSON files that way)."""

from __future__ import annotations

import json
import os


def save_json(path: str | None, data) -> None:
    """Write data to path (nothing when path is None) through a temporary file, so a kill mid-write leaves the
    previous complete file."""
    if path is None:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)
