"""The README documents the product's flags: its `serve` flag table lists exactly the flags `serve --help` offers."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def serve_flags() -> set[str]:
    from qwen35_jax.cli import build_parser

    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve = subparsers.choices["serve"]
    return {flag for action in serve._actions for flag in action.option_strings if flag.startswith("--")} - {"--help"}


def readme_flag_table() -> list[str]:
    """The first cell of every row of the README's `| flag | default | meaning |` table."""
    lines = README.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"\|\s*flag\s*\|\s*default\s*\|", line))
    flags = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        flags.append(line.split("|")[1].strip())
    return flags


def test_the_readme_flag_table_is_the_serve_flags():
    cells = readme_flag_table()
    assert all(re.fullmatch(r"`--[a-z0-9-]+`", cell) for cell in cells), cells
    documented = [cell.strip("`") for cell in cells]
    assert len(documented) == len(set(documented)), "a flag is documented twice"
    assert set(documented) == serve_flags()


def test_serve_help_lists_every_flag(capsys):
    from qwen35_jax.cli import main

    try:
        main(["serve", "--help"])
    except SystemExit as exit:
        assert exit.code == 0
    text = capsys.readouterr().out
    assert all(flag in text for flag in serve_flags())
    for removed in ("--layer-loop", "--gdn-state", "--fused-mlp", "--fused-qkv", "--xla-option"):
        assert removed not in text
