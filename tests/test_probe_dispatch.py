"""tools/probe_dispatch.py: each part of a launch's host cost, priced alone, runs on any backend."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "probe_dispatch.py"


def test_the_probe_prices_every_part(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("probe_dispatch", TOOL)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    out = tmp_path / "dispatch.json"
    assert probe.main(["--args", "2", "40", "--calls", "20", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    parts = ["dispatch_2_args_us", "dispatch_40_args_us", "inputs_from_device_us", "inputs_from_numpy_us",
             "packed_inputs_from_numpy_us", "one_arg_program_to_pinned_host_us", "copy_round_trip_us",
             "pinned_host_round_trip_us",
             "one_arg_program_us", "one_arg_program_and_copy_us"]  # fmt: skip
    assert sorted(rows) == sorted(["device", *parts])
    assert all(rows[k] > 0 for k in parts)
    assert "inputs_from_numpy_us" in capsys.readouterr().out
