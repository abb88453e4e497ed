"""tools/deviceless_step.py's reading of XLA's dumps, on the dumps of a three-kernel program compiled for an H200
without a device (`step(w, state, x) = (state + tanh(x @ w).sum(0), exp(tanh(x @ w)) * 2)`, state donated):
which commands touch which allocation."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DUMP = ROOT / "tests" / "fixtures" / "deviceless_step"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("deviceless_step", ROOT / "tools" / "deviceless_step.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_each_command_sees_the_allocations_it_reads_and_writes(tool):
    allocations, commands, parameters = tool.command_allocations(str(DUMP))
    assert [a.kind for _, a in sorted(allocations.items())][:4] == ["parameter", "output", "parameter",
                                                                    "parameter, donated"]  # fmt: skip
    assert dict(commands) == {
        "gemm_fusion_dot_general.1": {0, 1, 2},  # w, x -> the product, kept in the output's allocation
        "loop_add_fusion": {1, 3},  # the product, the donated state (written in place)
        "loop_multiply_fusion": {1},  # the product -> the output, in the same allocation
    }
    assert parameters == {0: "w.1", 1: "state.1", 2: "x.1"}


def test_the_report_counts_what_a_moved_allocation_re_records(tool):
    text = tool.report(str(DUMP), num_weights=1)
    assert "3 commands" in text
    assert "| 1 | 8192 | output | 2 values | 3 |" in text  # a new output buffer each run re-records all three
    assert "| 3 | 1024 | parameter, donated | state.1 | 1 |" in text
    assert "commands touching a per-step input or an output that is not donated: 3" in text
