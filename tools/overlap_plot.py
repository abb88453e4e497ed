"""The ITL CDF of the mixed-load cell, one curve per configuration that `tools/overlap_http.py` measured.

    python3 tools/overlap_plot.py OUTDIR docs/overlap_itl_cdf.png

Reads OUTDIR/<config>/mixed_decoders.json (written with --save-detailed: each decoder's gaps between tokens).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def main(out: Path, png: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for path in sorted(out.glob("*/mixed_decoders.json")):
        gaps = np.sort([gap * 1e3 for request in json.loads(path.read_text())["itls"] for gap in request])
        config = path.parent.name.replace("_", " / ", 1)
        p50, p99 = np.percentile(gaps, [50, 99])
        ax.plot(gaps, np.arange(1, len(gaps) + 1) / len(gaps), label=f"{config}: p50 {p50:.2f}, p99 {p99:.2f} ms")
    ax.set_xscale("log")
    # Gaps under 1 ms are tokens that reached the client in one read; the axis starts there.
    ax.set_xlim(1, 60)
    ax.set_xticks([2, 3, 5, 10, 20, 50], labels=["2", "3", "5", "10", "20", "50"])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("decoder inter-token latency (ms)")
    ax.set_ylabel("fraction of gaps")
    ax.set_title("16 decoders (128/768) beside six 8192-token prompts at 1 req/s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(title="decode overlap / scheduler policy")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
