"""One table of the engine, the HF transformers + fla peer and the physical floor, and two plots, from the JSON that
the benchmarks of one lease wrote.

    python3 tools/performance_report.py --ours engine.json --peer peer.json --table table.md \\
        --plots docs/perf_decode_throughput.png docs/perf_prefill_ttft.png

`--ours` is `qwen35_jax.serving.offline_bench --result-json`; `--peer` is `tools/bench_hf_peer.py --result-json`
(optional). The table has a row per decode batch (TPOT) and per prompt length (prefill time), each beside its
floor (offline_bench's: bytes over HBM bandwidth, FLOPs over the bf16 rate) and the peer's figure; the plots are
decode throughput against batch with the roofline's line, and prefill time against prompt length with the FLOP
floor's line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _by(rows: list[dict] | None, key: str) -> dict:
    return {row[key]: row for row in rows or [] if "error" not in row}


def decode_rows(ours: dict, peer: dict | None) -> list[dict]:
    """A row per batch that we measured: TPOT, floor, ratio, throughput, and the peer's TPOT where it has one."""
    theirs = _by((peer or {}).get("decode"), "batch")
    rows = []
    for row in ours.get("decode", []):
        other = theirs.get(row["batch"])
        rows.append({
            "cell": f"decode TPOT, batch {row['batch']}, context {row['context']}",
            "ours_ms": row["tpot_ms"], "floor_ms": row["floor_ms"], "peer_ms": other and other["tpot_ms"],
            "throughput": row["throughput_tok_s"], "peer_throughput": other and other["throughput_tok_s"],
            "x": row["batch"],
        })  # fmt: skip
    return rows


def prefill_rows(ours: dict, peer: dict | None) -> list[dict]:
    """A row per prompt length: best time to the first token, floor, and the peer's best."""
    theirs = _by((peer or {}).get("prefill"), "tokens")
    rows = []
    for row in ours.get("prefill", []):
        other = theirs.get(row["tokens"])
        rows.append({
            "cell": f"prefill, {row['tokens']} tokens", "ours_ms": row["ttft_ms_best"], "floor_ms": row["floor_ms"],
            "peer_ms": other and other["ttft_ms_best"], "x": row["tokens"],
        })  # fmt: skip
    return rows


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.2f} ms"


def _ratio(a: float | None, b: float | None) -> str:
    return "" if a is None or b is None else f"{a / b:.2f}x"


def markdown_table(rows: list[dict]) -> str:
    lines = ["| cell | ours | floor | ours / floor | % of roofline | HF + fla peer | peer / ours |",
             "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for row in rows:
        ours, floor, peer = row["ours_ms"], row["floor_ms"], row["peer_ms"]
        lines.append(f"| {row['cell']} | {_ms(ours)} | {_ms(floor)} | {_ratio(ours, floor)} | "
                     f"{100 * floor / ours:.1f}% | {_ms(peer)} | {_ratio(peer, ours)} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _plot(path: Path, series: list[tuple[str, str, list, list]], xlabel: str, ylabel: str) -> None:
    """One log-log plot of (label, matplotlib style, xs, ys) series; a series without points is left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, style, xs, ys in series:
        if xs:
            ax.plot(xs, ys, style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _peer_points(rows: list[dict], key: str) -> tuple[list, list]:
    points = [(r["x"], r[key]) for r in rows if r[key]]
    return [x for x, _ in points], [y for _, y in points]


def plot_decode(rows: list[dict], path: Path) -> None:
    x = [r["x"] for r in rows]
    _plot(path, [
        ("roofline (weights, KV and state once)", "k--", x, [r["x"] / r["floor_ms"] * 1e3 for r in rows]),
        ("qwen35-jax", "o-", x, [r["throughput"] for r in rows]),
        ("HF transformers + fla", "s-", *_peer_points(rows, "peer_throughput")),
    ], "decode batch", "output tokens / s")  # fmt: skip


def plot_prefill(rows: list[dict], path: Path) -> None:
    x = [r["x"] for r in rows]
    _plot(path, [
        ("bf16 FLOP floor", "k--", x, [r["floor_ms"] for r in rows]),
        ("qwen35-jax", "o-", x, [r["ours_ms"] for r in rows]),
        ("HF transformers + fla", "s-", *_peer_points(rows, "peer_ms")),
    ], "prompt tokens", "time to first token (ms, one prompt)")  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ours", type=Path, required=True)
    parser.add_argument("--peer", type=Path, default=None)
    parser.add_argument("--table", type=Path, default=None, help="write the markdown table here (else stdout)")
    parser.add_argument("--plots", type=Path, nargs=2, default=None, metavar=("DECODE_PNG", "PREFILL_PNG"))
    args = parser.parse_args(argv)
    ours = json.loads(args.ours.read_text())
    peer = json.loads(args.peer.read_text()) if args.peer else None
    decode, prefill = decode_rows(ours, peer), prefill_rows(ours, peer)
    table = markdown_table(decode + prefill)
    if args.table:
        args.table.write_text(table)
    else:
        print(table, end="")
    if args.plots:
        plot_decode(decode, args.plots[0])
        plot_prefill(prefill, args.plots[1])


if __name__ == "__main__":
    main()
