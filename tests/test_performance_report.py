"""tools/performance_report.py: the table of ours against the peer and the floor, and the two plots, from the JSON
that offline_bench and bench_hf_peer write."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "performance_report.py"

OURS = {
    "decode": [
        {"batch": 1, "context": 1024, "tpot_ms": 3.0, "floor_ms": 2.0, "throughput_tok_s": 1000 / 3.0},
        {"batch": 64, "context": 1024, "tpot_ms": 6.0, "floor_ms": 4.0, "throughput_tok_s": 64000 / 6.0},
    ],
    "prefill": [{"tokens": 1024, "ttft_ms_best": 24.0, "floor_ms": 9.6}],
}
PEER = {
    "decode": [{"batch": 1, "tpot_ms": 42.0, "throughput_tok_s": 1000 / 42.0}, {"batch": 64, "error": "OOM"}],
    "prefill": [{"tokens": 1024, "ttft_ms_best": 60.0}],
}


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location("performance_report", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_row_sets_ours_beside_the_floor_and_the_peer(report):
    rows = report.markdown_table(report.decode_rows(OURS, PEER) + report.prefill_rows(OURS, PEER)).splitlines()[2:]
    assert rows == [
        "| decode TPOT, batch 1, context 1024 | 3.00 ms | 2.00 ms | 1.50x | 66.7% | 42.00 ms | 14.00x |",
        "| decode TPOT, batch 64, context 1024 | 6.00 ms | 4.00 ms | 1.50x | 66.7% |  |  |",
        "| prefill, 1024 tokens | 24.00 ms | 9.60 ms | 2.50x | 40.0% | 60.00 ms | 2.50x |",
    ]


def test_without_a_peer_the_peer_columns_stay_empty(report):
    rows = report.markdown_table(report.decode_rows(OURS, None)).splitlines()[2:]
    assert all(row.endswith("|  |  |") for row in rows) and len(rows) == 2


def test_the_command_writes_the_table_and_both_plots(report, tmp_path):
    ours, peer = tmp_path / "ours.json", tmp_path / "peer.json"
    ours.write_text(json.dumps(OURS))
    peer.write_text(json.dumps(PEER))
    table, decode_png, prefill_png = tmp_path / "table.md", tmp_path / "decode.png", tmp_path / "prefill.png"
    report.main(["--ours", str(ours), "--peer", str(peer), "--table", str(table),
                 "--plots", str(decode_png), str(prefill_png)])  # fmt: skip
    assert table.read_text().count("\n") == 5
    for png in (decode_png, prefill_png):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
