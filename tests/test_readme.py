"""Every ```python block of the README runs as written, each in its own interpreter, against a
tiny server.

What a block must be (the README's writers' side of this test):

- a whole program: its own imports and ids, no top-level ``await``, no names from another block,
  nothing from outside (weights, GPU, network);
- it reaches the decoder only by the CLI's default name, the string literal ``"bicodec-shm"``:
  the test serves a random name and substitutes it for that literal, so that parallel runs on
  one machine never collide, while a reader runs the block as printed after a plain
  ``bicodec-shm serve``;
- it finishes within ``BLOCK_TIMEOUT`` seconds on the tiny model, in a fresh temporary folder.

Shell commands belong in ```bash blocks, which are not run here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from conftest import ROOT, serve_command, wait_until_serving

from bicodec_shm import processes
from bicodec_shm.cli import DEFAULT_NAME
from bicodec_shm.transport import leftover_objects, random_name, unlink_all

# The documents whose blocks must run.
DOCUMENTS = ("README.md",)
BLOCK_TIMEOUT = 120
PYTHON_FENCES = ("python", "py", "python3")
NAME_LITERAL = re.compile(r"""(["'])""" + re.escape(DEFAULT_NAME) + r"""\1""")
USES_SERVER = re.compile(r"\b(DecoderClient|BiCodecBatchDecoder|DecodeStream)\b")


@dataclass(frozen=True)
class Block:
    document: str
    line: int  # of the opening fence, 1-based
    code: str

    def __str__(self) -> str:
        return f"{self.document}:{self.line}"


def python_blocks(document: str) -> list[Block]:
    """The fenced ```python blocks of a Markdown file, in order."""
    with open(os.path.join(ROOT, document), encoding="utf-8") as f:
        lines = f.read().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = re.match(r"^(\s*)(`{3,})\s*([\w+-]*)", lines[i])
        if not fence:
            i += 1
            continue
        indent, ticks, info = fence.groups()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == ticks), None)
        if end is None:
            raise ValueError(f"{document}:{i + 1}: a ``` fence that is never closed")
        if info.lower() in PYTHON_FENCES:
            body = [line[len(indent) :] if line.startswith(indent) else line for line in lines[i + 1 : end]]
            blocks.append(Block(document, i + 1, "\n".join(body) + "\n"))
        i = end + 1
    return blocks


ALL_BLOCKS = [block for document in DOCUMENTS for block in python_blocks(document)]


@pytest.fixture(scope="module")
def readme_server() -> Iterator[str]:
    """One tiny server for all blocks, under a random name stood in for "bicodec-shm"."""
    name = random_name("bcshm-readme")
    proc = subprocess.Popen(serve_command(name), cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_serving(name, proc=proc)
        yield name
    finally:
        processes.stop_server(proc, timeout=20)
        proc.stderr.close()
        unlink_all(name)
    assert leftover_objects(name) == []


@pytest.mark.parametrize("document", DOCUMENTS)
def test_the_document_has_python_blocks_that_name_the_default_server(document):
    blocks = python_blocks(document)
    assert blocks, f"{document} has no ```python block: is DOCUMENTS still right?"
    for block in blocks:
        if USES_SERVER.search(block.code):
            assert NAME_LITERAL.search(block.code), (
                f"{block}: a block that uses a server must name it {DEFAULT_NAME!r} (the CLI "
                "default), as a string literal, so that this test can serve it"
            )
        assert not re.search(r"^await\b", block.code, re.M), f"{block}: top-level await"


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=str)
def test_block_runs_as_written(block: Block, readme_server: str, tmp_path):
    code = NAME_LITERAL.sub(lambda m: f"{m[1]}{readme_server}{m[1]}", block.code)
    script = tmp_path / "block.py"
    script.write_text(code)
    try:
        done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                              text=True, timeout=BLOCK_TIMEOUT)  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{block} ran over {BLOCK_TIMEOUT} s:\n{block.code}\n{exc.stderr or ''}")
    assert done.returncode == 0, f"{block} failed:\n{block.code}\n--- stderr:\n{done.stderr}"
