"""The table of `tools/lease_bench.sh host`: for each XLA command buffer mode, the decode step at batch 1 and 256
(TPOT, the host's launch, its own time and its share of the step) from offline_bench's JSON, and from XLA's log
how often a command buffer was re-recorded and how many of its commands each re-recording touched.

    python tools/host_modes_report.py OUTDIR/host     # reads MODE.json and MODE.log for every mode it finds

The log lines are XLA's (`command_buffer_thunk` at vlog 3, the command executor at vlog 1); they cover the whole
run, warm-up and prefill included, so they say whether updates happen every step and how large they are, not
which step they belong to.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

UPDATE = re.compile(r"Update command buffer .*num_commands=(\d+); updated_allocs=(\d+)")
UPDATED = re.compile(r"Updated (\d+) commands in (\d+) .s \(skipped (\d+) command updates\)")
MODES = ("ALWAYS_UPDATE", "SKIP_TEMP", "SKIP_PROFILED", "exclusive_lock", "off")


def log_summary(text: str) -> dict:
    """Counts and medians of the command buffer updates in one XLA log."""
    updates = [(int(n), int(a)) for n, a in UPDATE.findall(text)]
    updated = [(int(n), int(us), int(skipped)) for n, us, skipped in UPDATED.findall(text)]
    summary = {"updates": len(updates)}
    if updates:
        summary["updated_allocs_median"] = statistics.median(a for _, a in updates)
    if updated:
        summary["update_us_median"] = statistics.median(us for _, us, _ in updated)
        summary["commands_updated_median"] = statistics.median(n - skipped for n, _, skipped in updated)
        summary["commands_median"] = statistics.median(n for n, _, _ in updated)
    return summary


def mode_rows(folder: Path) -> list[str]:
    rows = []
    for mode in MODES:
        result, log = folder / f"{mode}.json", folder / f"{mode}.log"
        if not result.exists():
            if log.exists():
                rows.append(f"| {mode} | failed: see {log.name} | | | | |")
            continue
        decode = {d["batch"]: d for d in json.loads(result.read_text()).get("decode", []) if "tpot_ms" in d}
        updates = log_summary(log.read_text(errors="replace")) if log.exists() else {}
        for batch, d in sorted(decode.items()):
            rows.append(
                f"| {mode} | {batch} | {d['tpot_ms']:.2f} | {d['host_launch_ms']:.3f} | {d['host_own_ms']:.3f} "
                f"({100 * d['host_share_of_step']:.1f}%) | {_updates_cell(updates)} |"
            )
    return rows


def _updates_cell(updates: dict) -> str:
    if not updates.get("updates"):
        return "no update lines in the log"
    cell = f"{updates['updates']} re-recordings"
    if "commands_updated_median" in updates:
        cell += (f", median {updates['commands_updated_median']:.0f} of {updates['commands_median']:.0f} commands"
                 f" in {updates['update_us_median']:.0f} us")  # fmt: skip
    return cell


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: host_modes_report.py OUTDIR/host")
    folder = Path(argv[0])
    header = [
        "| command buffers | batch | TPOT ms | launch ms | host's own ms (share) | XLA's updates (whole run) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    table = "\n".join(header + mode_rows(folder))
    (folder / "table.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
