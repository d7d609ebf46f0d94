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
def test_every_mutant_applies_exactly_once_to_the_tree_and_still_compiles(mutant):
    """A mutant's bug must be one the tests can run into: a mutated module that no longer
    compiles (an old text matched inside a more indented line, say) is an "error" row, not a
    planted bug."""
    texts: dict[str, str] = {}
    for file, old, new in mutant.edits:
        text = texts.get(file, (ROOT / file).read_text())
        assert text.count(old) == 1, f"{mutant.name}: {file} holds its old text {text.count(old)} times"
        assert old != new
        texts[file] = text.replace(old, new)
    for file, text in texts.items():
        if file.endswith(".py"):
            compile(text, file, "exec")


def test_the_check_finds_a_mutant_whose_text_moved(tmp_path):
    """The check above can fail: a mutant whose old text is not in the file is reported."""
    (tmp_path / "f.py").write_text("x = 1\n")
    moved = GATE.Mutant("moved", "planted", (("f.py", "x = 2", "x = 3"),), ("tests",))
    assert "occurs 0 times" in GATE.apply(tmp_path, moved)


def _junit(tests: int, failures: int = 0, errors: int = 0, skipped: int = 0) -> str:
    return (f'<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" '
            f'errors="{errors}" failures="{failures}" skipped="{skipped}" tests="{tests}">'
            "</testsuite></testsuites>")  # fmt: skip


@pytest.mark.parametrize(
    ("returncode", "report", "verdict"),
    [
        (0, _junit(2), "survived"),
        (0, _junit(3, skipped=2), "survived"),  # one ran and passed: the bug got past it
        (0, _junit(2, skipped=2), "not tested"),  # every selected test skipped
        (0, _junit(0), "not tested"),
        (5, None, "not tested"),  # pytest: no tests collected
        (1, _junit(2, failures=1), "killed"),
        (1, _junit(2, skipped=1, errors=1), "killed"),
        (2, None, "error"),  # interrupted, or a usage error
        (4, None, "error"),
        (0, None, "error"),  # a pass without a report: what ran is unknown
    ],
)
def test_a_selection_that_only_skipped_is_not_tested_rather_than_survived(returncode, report, verdict):
    assert GATE.verdict_of(returncode, report) == verdict


def test_pytest_s_own_report_of_a_selection_that_only_skips_reads_not_tested(tmp_path):
    """The real pytest, a selection whose only test skips (as the tests of an unprivileged user
    once did where no Python could run as that user): "not tested", where exit 0 read "survived"."""
    (tmp_path / "test_skips.py").write_text("import pytest\n\ndef test_x():\n    pytest.skip('no tool')\n")
    (tmp_path / "test_passes.py").write_text("def test_y():\n    assert True\n")
    assert GATE.run_tests(tmp_path, ("test_skips.py",), 120)[0] == "not tested"
    assert GATE.run_tests(tmp_path, ("test_skips.py", "-k", "nothing_matches"), 120)[0] == "not tested"
    assert GATE.run_tests(tmp_path, ("test_skips.py", "test_passes.py"), 120)[0] == "survived"


def test_the_closing_line_names_the_mutants_not_killed_by_verdict():
    rows = [{"mutant": "a", "verdict": "survived"}, {"mutant": "b", "verdict": "not tested"},
            {"mutant": "c", "verdict": "survived"}]  # fmt: skip
    assert GATE.summary(rows) == "; survived: a, c; not tested: b"
    assert GATE.summary([]) == ""
