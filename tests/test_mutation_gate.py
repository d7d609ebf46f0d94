"""The mutation gate's mutants still apply: each planted bug's old text occurs exactly once in
the tree (a refactor that moves it would otherwise turn the mutant into an "error" row that only a
full, 15-minute gate run shows)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _gate():
    spec = importlib.util.spec_from_file_location("mutation_gate", ROOT / "benchmarks" / "mutation_gate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being made
    spec.loader.exec_module(module)
    return module


GATE = _gate()


@pytest.mark.parametrize("mutant", GATE.MUTANTS, ids=lambda mu: mu.name)
def test_every_mutant_applies_exactly_once_to_the_tree(mutant):
    for file, old, new in mutant.edits:
        text = (ROOT / file).read_text()
        assert text.count(old) == 1, f"{mutant.name}: {file} holds its old text {text.count(old)} times"
        assert old != new


def test_the_check_finds_a_mutant_whose_text_moved(tmp_path):
    """The check above can fail: a mutant whose old text is not in the file is reported."""
    (tmp_path / "f.py").write_text("x = 1\n")
    moved = GATE.Mutant("moved", "planted", (("f.py", "x = 2", "x = 3"),), ("tests",))
    assert "occurs 0 times" in GATE.apply(tmp_path, moved)
