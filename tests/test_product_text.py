"""What users read speaks of the product, never of how it was made: the README, docs/, the
examples, benchmarks/RESULTS.md and the benchmarks' own text, every module of the package
(docstrings, messages, comments) and every command's ``--help``.

A measurement says where and when it was taken; it never says "this session", "earlier runs",
"the issue sets them" or "the seed's calibration".
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Each pattern is a way of speaking about the project's own history. "seed" alone is a random
# seed (of the weights, of the noise): only its history-speaking forms are refused.
FORBIDDEN = [
    r"\bseed's\b",
    r"\bthe seed\b(?!\s+(of|from|for|given|value)\b)",
    r"\bseed[- ]calibrated\b",
    r"\b(the|this|that) issue\b",
    r"\bissues? #?\d+\b",
    r"\b(this|last|earlier|previous|next|a later) (session|stop)s?\b",
    r"\bearlier (ones|runs|sessions)\b",
    r"\bthis hour\b",
    r"\b(the|a|third|second|last) review\b",
    r"\breview(er)?'?s? findings?\b",
    r"\bround (two|three)\b",
    r"\bhelper agents?\b",
]
PATTERN = re.compile("|".join(f"(?:{p})" for p in FORBIDDEN), re.IGNORECASE)


def documents() -> list[Path]:
    found = [ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md"]
    found += sorted((ROOT / "docs").glob("*.md"))
    found += sorted(p for p in (ROOT / "examples").rglob("*") if p.suffix in (".md", ".py"))
    found += sorted((ROOT / "bicodec_shm").rglob("*.py"))
    found += sorted(p for p in (ROOT / "benchmarks").glob("*") if p.suffix in (".py", ".sh"))
    return found


def offences(text: str) -> list[str]:
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in PATTERN.finditer(line):
            out.append(f"{number}: {match.group(0)!r} in {line.strip()[:100]!r}")
    return out


def test_user_facing_text_speaks_of_the_product():
    found = {p.relative_to(ROOT).as_posix(): offences(p.read_text(encoding="utf-8")) for p in documents()}
    assert {path: lines for path, lines in found.items() if lines} == {}


def _helps() -> dict[str, str]:
    from bicodec_shm.tools.cli import _parser

    parser = _parser()
    texts = {"bicodec-shm": parser.format_help()}
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    texts.update({f"bicodec-shm {name}": sub.format_help() for name, sub in commands.choices.items()})
    return texts


def test_every_commands_help_speaks_of_the_product():
    found = {name: offences(text) for name, text in _helps().items()}
    assert {name: lines for name, lines in found.items() if lines} == {}


@pytest.mark.parametrize("text", ["the seed's calibration", "as the issue sets them", "1.34x in earlier ones",
                                  "the VM ran faster this hour", "issue 22", "this session"])  # fmt: skip
def test_the_scan_finds_what_it_refuses(text):
    assert offences(text)


@pytest.mark.parametrize("text", ["--seed: the seed of the random weights",
                                  "None draws the seed from torch's",
                                  "a request's noise seed", "open issues on GitHub"])  # fmt: skip
def test_the_scan_lets_a_random_seed_be(text):
    assert offences(text) == []
