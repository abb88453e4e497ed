"""tools/host_modes_report.py: the table of `lease_bench.sh host` from offline_bench's JSON and XLA's log lines."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "host_modes_report.py"

# XLA's own lines (command_buffer_thunk at vlog 3, the command executor at vlog 1), as the GPU plugin prints them.
LOG = """\
I1206 command_buffer_thunk.cc:201] Update command buffer on device #0 by recoding command buffer cmd sequence \
after 1 executions since last update; num_commands=450; updated_allocs=7
I1206 command_executor.cc:512] Updated 450 commands in 700 \u03bcs (skipped 50 command updates)
I1206 command_buffer_thunk.cc:201] Update command buffer on device #0 by recoding command buffer cmd sequence \
after 1 executions since last update; num_commands=450; updated_allocs=5
I1206 command_executor.cc:512] Updated 450 commands in 900 \u03bcs (skipped 350 command updates)
I1206 command_buffer_thunk.cc:201] Update command buffer on device #0 by recoding command buffer cmd sequence \
after 1 executions since last update; num_commands=450; updated_allocs=6
I1206 command_executor.cc:512] Updated 450 commands in 800 \u03bcs (skipped 150 command updates)
"""


def _decode(batch, tpot, launch, own):
    return {"batch": batch, "tpot_ms": tpot, "host_launch_ms": launch, "host_own_ms": own,
            "host_share_of_step": own / tpot}  # fmt: skip


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location("host_modes_report", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_log_summary_counts_updates_and_the_commands_each_one_touched(report):
    summary = report.log_summary(LOG)
    assert summary["updates"] == 3
    assert summary["updated_allocs_median"] == 6
    assert summary["update_us_median"] == 800
    assert summary["commands_updated_median"] == 300  # 400, 100 and 300 commands re-recorded
    assert summary["commands_median"] == 450


def test_a_log_without_updates_says_so(report):
    assert report.log_summary("nothing here\n") == {"updates": 0}


def test_table_has_a_row_per_mode_and_batch_and_marks_a_failed_mode(report, tmp_path):
    (tmp_path / "ALWAYS_UPDATE.json").write_text(json.dumps({"decode": [_decode(256, 14.5, 1.6, 2.65),
                                                                        _decode(1, 3.0, 1.0, 1.5)]}))  # fmt: skip
    (tmp_path / "ALWAYS_UPDATE.log").write_text(LOG)
    (tmp_path / "SKIP_TEMP.log").write_text("Traceback: the VMM allocator failed\n")
    report.main([str(tmp_path)])
    rows = (tmp_path / "table.md").read_text().splitlines()[2:]
    assert rows == [
        "| ALWAYS_UPDATE | 1 | 3.00 | 1.000 | 1.500 (50.0%) | 3 re-recordings, median 300 of 450 commands in 800 us |",
        "| ALWAYS_UPDATE | 256 | 14.50 | 1.600 | 2.650 (18.3%) | 3 re-recordings, median 300 of 450 commands in 800 us |",
        "| SKIP_TEMP | failed: see SKIP_TEMP.log | | | | |",
    ]
