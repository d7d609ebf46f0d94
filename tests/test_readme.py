"""The README runs top to bottom, in order, as a reader would run it: every ```bash and ```python
block, in one temporary folder per document, against the servers the document itself starts.

What the test does with each block:

- ```python blocks run as written, each in its own interpreter, with the CLI's default name
  (the string literal ``"bicodec-shm"``) replaced by a random name, so that parallel runs on one
  machine never collide. A block must be a whole program: its own imports and ids, no top-level
  ``await``, no names from another block (files it wrote are fine: the folder is shared).
- ```bash blocks run line by line (``\\`` continues a line; ``&&`` chains are split), through
  bash, with ``bicodec-shm``, ``python``, ``python3`` and ``uvicorn`` on the PATH as this
  interpreter and this checkout. ``bicodec-shm serve`` and ``uvicorn`` keep running in the
  background, as in a reader's other terminal, until the document says to stop them. Where a
  command uses the default name it gets the random one (``--name``, ``BICODEC_SHM_NAME``); a
  ``serve`` or ``demo`` without ``--preset`` or ``--model-dir`` gets ``--preset tiny`` (the
  full-size model on random weights would take minutes on a CPU); the documented ports get free
  ones.
- Skipped, each with its reason (``SKIPS``), and nothing else: commands that need the network
  (installs, the weights' download), a GPU, or that run this test suite.

Stopping: a reader stops a server with Ctrl-C. Prose that says to (``Ctrl-C`` followed within a
few words by ``above`` or ``previous``) makes the test send SIGINT to everything running in the
background before the next block that starts a server (if that block is skipped, the instruction
was for it alone). A block that starts a server under a name that is still served, without such
an instruction, fails: that is the collision a reader would hit.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import wave
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import ROOT

from bicodec_shm.deploy import processes
from bicodec_shm.protocol.names import leftover_objects, random_name, unlink_all
from bicodec_shm.tools.cli import DEFAULT_NAME

DOCUMENTS = ("README.md", *sorted(f"docs/{p.name}" for p in (Path(ROOT) / "docs").glob("*.md")))
BLOCK_TIMEOUT = 120
PYTHON_FENCES = ("python", "py", "python3")
BASH_FENCES = ("bash", "sh", "shell")
NAME_LITERAL = re.compile(r"""(["'])""" + re.escape(DEFAULT_NAME) + r"""\1""")
USES_SERVER = re.compile(r"\b(DecoderClient|BiCodecBatchDecoder|DecodeStream)\b")
STOP_INSTRUCTION = re.compile(r"Ctrl-C\b.{0,60}?\b(above|previous)\b", re.S)
DOCUMENTED_PORTS = ("8000", "9410")

# (pattern of a command, why it is not run here). Only the network, a GPU, the suite itself, and
# the Ray cluster that tests/test_ray.py runs.
SKIPS = (
    (r"^pip install\b", "needs the network: installs packages (this environment has them)"),
    (r"^python3? -m venv\b|^\. \.venv/bin/activate\b", "a fresh virtualenv, for the installs above"),
    (r"\bhf download\b|\bhuggingface-cli\b|\bsnapshot_download\b", "needs the network: the weights"),
    (r"--device[ =]cuda", "needs a GPU"),
    (r"-m pytest\b", "runs this test suite itself (CI runs it)"),
    (r"\bray (start|stop)\b|\bserve (run|shutdown)\b|--url http://127\.0\.0\.1:8000 --requests 64",
     "a two-node Ray cluster: tests/test_ray.py runs these steps"),
)
SERVE = re.compile(r"\bbicodec-shm serve\b")
# A reader's other terminal runs a server as a foreground job: Ctrl-C at its default. A test run
# started as a background job (`pytest &`) has SIGINT ignored, which its children would inherit
# and a server rightly keeps (it would then ignore the document's Ctrl-C): reset it first.
AT_DEFAULT_SIGINT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                     "os.execvp(sys.argv[1], sys.argv[1:])")
STOP_WAIT = 30.0  # seconds a background command gets to exit after Ctrl-C
LONG_RUNNING = re.compile(r"\bbicodec-shm serve\b|^(\w+=\S*\s+)*uvicorn\b")


@dataclass(frozen=True)
class Block:
    document: str
    line: int  # of the opening fence, 1-based
    language: str  # "python" or "bash"
    code: str
    prose: str  # the text between the previous block and this one

    def __str__(self) -> str:
        return f"{self.document}:{self.line}"


def blocks(document: str) -> list[Block]:
    """The fenced ```python and ```bash blocks of a Markdown file, in order."""
    with open(os.path.join(ROOT, document), encoding="utf-8") as f:
        lines = f.read().splitlines()
    found, i, prose_from = [], 0, 0
    while i < len(lines):
        fence = re.match(r"^(\s*)(`{3,})\s*([\w+-]*)", lines[i])
        if not fence:
            i += 1
            continue
        indent, ticks, info = fence.groups()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == ticks), None)
        if end is None:
            raise ValueError(f"{document}:{i + 1}: a ``` fence that is never closed")
        info = info.lower()
        language = "python" if info in PYTHON_FENCES else "bash" if info in BASH_FENCES else None
        if language:
            body = [line[len(indent) :] if line.startswith(indent) else line for line in lines[i + 1 : end]]
            found.append(Block(document, i + 1, language, "\n".join(body) + "\n",
                               "\n".join(lines[prose_from:i])))  # fmt: skip
            prose_from = end + 1
        i = end + 1
    return found


def commands(code: str) -> list[list[str]]:
    """A bash block's command lines, each a ``&&`` chain of commands (continued lines joined,
    comments kept)."""
    joined = re.sub(r"\\\n\s*", " ", code)
    out, pending = [], ""
    for line in joined.splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # a quoted string goes on over the next line
            continue
        if pending.strip() and not pending.strip().startswith("#"):
            out.append([part.strip() for part in pending.split(" && ")])
        pending = ""
    assert not pending, f"unbalanced quotes in: {pending}"
    return out


def skip_reason(chain: list[str]) -> str | None:
    """Why a ``&&`` chain is not run: a command in it needs what this test lacks (the commands
    after it depend on it, as ``&&`` says)."""
    return next((why for command in chain for pattern, why in SKIPS if re.search(pattern, command)), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Background:
    proc: subprocess.Popen
    command: str
    block: Block
    log: str
    is_server: bool

    def tail(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()[-3000:]


@dataclass
class Session:
    """One reader working through one document, in ``folder``, under the name ``name``."""

    folder: str
    name: str
    ports: dict[str, str]
    background: list[Background] = field(default_factory=list)
    stop_pending: bool = False
    ran: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    timings: list[tuple[str, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        bin_dir = os.path.join(self.folder, "bin")
        os.makedirs(bin_dir)
        for tool, target in (("bicodec-shm", "-m bicodec_shm"), ("python", ""), ("python3", ""),
                             ("uvicorn", "-m uvicorn")):  # fmt: skip
            path = os.path.join(bin_dir, tool)
            with open(path, "w") as f:
                f.write(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {target} "$@"\n')
            os.chmod(path, 0o755)
        # The documents' relative paths (examples/http_tts/load.py) are from the repository root.
        os.symlink(os.path.join(ROOT, "examples"), os.path.join(self.folder, "examples"))
        python_path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
        self.env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", BICODEC_SHM_NAME=self.name,
                        PYTHONPATH=python_path)  # fmt: skip

    # -- blocks ---------------------------------------------------------------------------

    def run(self, block: Block) -> None:
        started = time.monotonic()
        try:
            self._run(block)
        finally:
            self.timings.append((str(block), time.monotonic() - started))

    def _run(self, block: Block) -> None:
        if STOP_INSTRUCTION.search(block.prose):
            self.stop_pending = True
        if block.language == "python":
            self._python(block)
        else:
            for chain in commands(block.code):
                why = skip_reason(chain)
                if why is not None:
                    self.skipped.append((f"{block}: {' && '.join(chain)}", why))
                    continue
                for command in chain:
                    self._bash(block, command)
        if SERVE.search(block.code):
            self.stop_pending = False  # the instruction was for this block's server
        for bg in self.background:
            assert bg.proc.poll() is None, (
                f"{bg.block}: `{bg.command}` exited ({bg.proc.returncode}) while the document "
                f"still needed it:\n{bg.tail()}"
            )

    def _python(self, block: Block) -> None:
        code = NAME_LITERAL.sub(lambda m: f"{m[1]}{self.name}{m[1]}", block.code)
        script = os.path.join(self.folder, f"block_{block.line}.py")
        with open(script, "w") as f:
            f.write(code)
        self._foreground(block, [sys.executable, script], block.code)

    def _bash(self, block: Block, command: str) -> None:
        command = self._substitute(command)
        if LONG_RUNNING.search(command):
            self._start(block, command)
        else:
            self._foreground(block, ["bash", "-o", "pipefail", "-ec", command], command)
        self.ran.append(command)

    def _substitute(self, command: str) -> str:
        for documented, port in self.ports.items():
            command = re.sub(rf"\b{documented}\b", port, command)
        if not re.search(r"--preset\b|--model-dir\b", command):
            command = re.sub(r"\bbicodec-shm (serve|demo)\b", r"bicodec-shm \1 --preset tiny", command)
        if "--name" not in command:
            named = rf"bicodec-shm \1 --name {self.name}"
            command = re.sub(r"\bbicodec-shm (serve|decode)\b", named, command)
        return command

    def _foreground(self, block: Block, argv: list[str], shown: str) -> None:
        try:
            done = subprocess.run(argv, cwd=self.folder, env=self.env, capture_output=True, text=True,
                                  timeout=BLOCK_TIMEOUT)  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"{block} ran over {BLOCK_TIMEOUT} s:\n{shown}\n{exc.stderr or ''}")
        assert done.returncode == 0, (
            f"{block} failed ({done.returncode}):\n{shown}\n--- stdout:\n{done.stdout[-3000:]}\n"
            f"--- stderr:\n{done.stderr[-3000:]}{self._background_logs()}"
        )

    # -- background servers -------------------------------------------------------------

    def _start(self, block: Block, command: str) -> None:
        if SERVE.search(command):
            running = [bg for bg in self.background if bg.is_server and bg.proc.poll() is None]
            if running and not self.stop_pending:
                pytest.fail(
                    f"{block} starts `{command}` while `{running[0].command}` ({running[0].block}) still "
                    "serves the same name, and the document does not tell the reader to stop it "
                    "(Ctrl-C ... above) first"
                )
            if self.stop_pending:
                hung = self.stop_all()
                if hung:
                    pytest.fail(f"{block}: Ctrl-C did not stop what ran before it:{hung}")
        bg = self._spawn(block, command, is_server=bool(SERVE.search(command)))
        if bg.is_server:
            try:
                processes.wait_until_serving(self.name, bg.proc, timeout=60)
            except Exception as exc:
                pytest.fail(f"{block}: `{command}` did not come up ({exc}):\n{bg.tail()}")
        else:
            self._wait_for_http(bg, re.search(r"--port (\d+)", command)[1])

    def _spawn(self, block: Block, command: str, *, is_server: bool) -> Background:
        """Start ``command`` in the background, in its own session, SIGINT at its default."""
        log = os.path.join(self.folder, f"background_{len(self.background)}.log")
        with open(log, "w") as f:
            argv = [sys.executable, "-c", AT_DEFAULT_SIGINT, "bash", "-c", f"exec {command}"]
            proc = subprocess.Popen(argv, cwd=self.folder, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip
        bg = Background(proc, command, block, log, is_server)
        self.background.append(bg)
        return bg

    def _wait_for_http(self, bg: Background, port: str, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert bg.proc.poll() is None, f"{bg.block}: `{bg.command}` exited:\n{bg.tail()}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        pytest.fail(f"{bg.block}: `{bg.command}` did not answer on port {port}:\n{bg.tail()}")

    def stop_all(self, timeout: float = STOP_WAIT) -> str:
        """Ctrl-C to everything in the background, as a reader would; SIGKILL if it hangs.
        Returns, for each command that had to be killed, which it was, where it was started,
        how it stood with SIGINT, and its log, with a server's stacks (SIGUSR1 makes a server
        print them) at the end; empty if everything stopped."""
        for bg in self.background:
            if bg.proc.poll() is None:
                os.killpg(bg.proc.pid, signal.SIGINT)
        hung = []
        deadline = time.monotonic() + timeout
        for bg in self.background:
            try:
                bg.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung.append((bg, _sigint_disposition(bg.proc.pid)))
                if bg.is_server:
                    os.kill(bg.proc.pid, signal.SIGUSR1)  # faulthandler: every thread's stack
                    time.sleep(2)
                os.killpg(bg.proc.pid, signal.SIGKILL)
                bg.proc.wait()
        logs = "".join(f"\n--- `{bg.command}` ({bg.block}, pid {bg.proc.pid}) did not stop within "
                       f"{timeout:g} s of Ctrl-C ({how}) and was killed; its log:\n{bg.tail()}"
                       for bg, how in hung)  # fmt: skip
        self.background = [bg for bg in self.background if bg.proc.poll() is None]
        return logs

    def _background_logs(self) -> str:
        return "".join(f"\n--- background `{bg.command}`:\n{bg.tail()}" for bg in self.background)


def _sigint_disposition(pid: int) -> str:
    """How process ``pid`` stands with SIGINT: ignored, blocked, caught or default."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        masks = {key: int(fields[key], 16) for key in ("SigIgn", "SigBlk", "SigCgt")}
    except (OSError, ValueError, KeyError):
        return "its signal state unreadable"
    bit = 1 << (signal.SIGINT - 1)
    states = [word for key, word in (("SigIgn", "ignored"), ("SigBlk", "blocked"), ("SigCgt", "caught"))
              if masks.get(key, 0) & bit]  # fmt: skip
    return "SIGINT " + (" and ".join(states) if states else "at its default")


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def test_a_background_command_stops_on_ctrl_c_even_when_the_test_run_ignores_sigint(tmp_path):
    session = Session(str(tmp_path), random_name("bcshm-readme"), {})
    block = Block("test", 1, "bash", "sleep 60\n", "")
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in a run started with `pytest &`
    try:
        session._spawn(block, "sleep 60", is_server=False)
    finally:
        signal.signal(signal.SIGINT, previous)
    proc = session.background[0].proc
    deadline = time.monotonic() + 30
    while _comm(proc.pid) != "sleep":  # a reader presses Ctrl-C once the command runs
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    started = time.monotonic()
    assert session.stop_all(timeout=10) == ""
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("document", DOCUMENTS)
def test_a_python_block_that_uses_a_server_names_the_default_one(document):
    python = [block for block in blocks(document) if block.language == "python"]
    for block in python:
        if USES_SERVER.search(block.code):
            assert NAME_LITERAL.search(block.code), (
                f"{block}: a block that uses a server must name it {DEFAULT_NAME!r} (the CLI "
                "default), as a string literal, so that this test can serve it"
            )
        assert not re.search(r"^await\b", block.code, re.M), f"{block}: top-level await"


@pytest.mark.parametrize("document", DOCUMENTS)
def test_the_document_runs_top_to_bottom(document, tmp_path):
    session = Session(str(tmp_path), random_name("bcshm-readme"),
                      {port: str(_free_port()) for port in DOCUMENTED_PORTS})  # fmt: skip
    try:
        for block in blocks(document):
            session.run(block)
    finally:
        logs = session.stop_all()
        left = leftover_objects(session.name)
        unlink_all(session.name)
    # Which server did not stop, and what it said, rather than only the objects' names.
    assert left == [], f"the document's servers left {len(left)} objects ({left[:3]} ...) in /dev/shm:{logs}"
    check_outputs(document, tmp_path)
    if any(b.language == "python" and USES_SERVER.search(b.code) for b in blocks(document)):
        assert any(SERVE.search(command) for command in session.ran), f"{document}: no server started"
    reasons = {why for _, why in session.skipped}
    assert reasons <= {why for _, why in SKIPS}
    print("\n".join(f"skipped {where}: {why}" for where, why in session.skipped))
    print("\n".join(f"{where}: {seconds:.1f} s" for where, seconds in session.timings))


def check_outputs(document: str, folder) -> None:
    """What the commands wrote, where curl's exit status alone would not tell (an HTTP error is
    a body too): the last WAV of 100 tokens and the streamed one of 500."""
    if document == "docs/integrations.md":  # the HTTP example's decode and stream
        with wave.open(str(folder / "out.wav")) as w:
            assert (w.getnchannels(), w.getframerate(), w.getnframes()) == (1, 16000, 100 * 320)
        streamed = (folder / "stream.wav").read_bytes()
        assert streamed[:4] == b"RIFF" and len(streamed) == 44 + 2 * 500 * 320
    if document == "docs/codecs.md":
        with wave.open(str(folder / "orpheus.wav")) as w:  # 20 SNAC 24 kHz frames
            assert (w.getnchannels(), w.getframerate(), w.getnframes()) == (1, 24000, 20 * 2048)


def test_the_http_examples_stream_command_is_the_one_run_here():
    """examples/http_tts/README.md shows the same streaming command docs/integrations.md runs."""
    stream = [c for b in blocks("docs/integrations.md") if b.language == "bash" for c in commands(b.code)
              if "/v1/decode/stream" in c[0]]  # fmt: skip
    example = [c for b in blocks("examples/http_tts/README.md") if b.language == "bash"
               for c in commands(b.code) if "/v1/decode/stream" in c[0]]  # fmt: skip
    assert len(stream) == 1 and example == stream
    assert "ffplay" not in stream[0][0]


def test_the_documents_skip_only_what_needs_the_network_or_a_gpu():
    """Each document's skipped command lines, named: adding one to this list is a decision."""
    fresh, network, weights, gpu = (SKIPS[i][1] for i in (1, 0, 2, 3))
    expected = {
        "README.md": [fresh, network],  # a fresh machine: venv, installs, demo; the test command
        "docs/codecs.md": [network, weights, gpu, weights, weights],  # Spark-TTS's and SNAC's weights
        "docs/development.md": [network],  # the test command
        "docs/integrations.md": [gpu, gpu, network],  # the drop-ins' GPU servers; the examples extra
    }
    for document in DOCUMENTS:
        bash = [block for block in blocks(document) if block.language == "bash"]
        chains = [chain for block in bash for chain in commands(block.code)]
        skipped = [(" && ".join(chain), skip_reason(chain)) for chain in chains if skip_reason(chain)]
        assert [why for _, why in skipped] == expected.get(document, []), (document, skipped)


def _section(document: str, heading: str) -> str:
    """The text of ``document`` from ``heading``'s line up to the next heading of its level."""
    text = (Path(ROOT) / document).read_text(encoding="utf-8")
    start = text.index(f"\n{heading}\n")
    level = heading.split(" ")[0] + " "
    end = text.find(f"\n{level}", start + len(heading) + 2)
    return text[start : end if end >= 0 else len(text)]


def test_a_fresh_machine_reads_the_torch_caveat_before_the_command_and_gets_cpu_torch():
    """The README's first install takes PyTorch's CPU build (PyPI's torch is a CUDA build), says so
    before the command, and the test command says how long the suite takes."""
    readme = [b for b in blocks("README.md") if b.language == "bash"]
    first = next(b for b in readme if "pip install" in b.code)
    assert "multi-GB CUDA build" in first.prose and "pytorch.org" in first.prose
    installs = [c for chain in commands(first.code) for c in chain if c.startswith("pip install torch")]
    torch_install = installs[0]
    assert "--index-url https://download.pytorch.org/whl/cpu" in torch_install
    tests = next(b for b in readme if "-m pytest" in b.code)
    assert re.search(r"the full suite takes about [\d–-]+ minutes on a 2-core", tests.prose), tests.prose
    assert "multi-GB CUDA build" not in tests.prose.split("```")[-1], "the caveat after the command"


@pytest.mark.parametrize("document", ["README.md", "docs/integrations.md", "examples/spark_tts/README.md"])
def test_where_the_spark_tts_change_is_shown_it_says_a_worker_still_loads_the_codec(document):
    """``SparkTTS(model_dir, device)`` builds BiCodec and wav2vec2 in every worker: the change
    shares the decode, not the memory, and the text beside it says so."""
    text = (Path(ROOT) / document).read_text(encoding="utf-8")
    shown = text.index('SharedAudioTokenizer("spark-tts", tokenizer=model.audio_tokenizer)')
    after = text[shown : shown + 900]
    assert re.search(r"worker still loads\s+BiCodec and wav2vec2", after), after
    assert "one BiCodec in GPU memory instead of N" not in text


def test_the_readmes_table_explains_lanes_and_the_stand_in():
    section = _section("README.md", "## Should I use this?")
    table_end = section.index("\n\n", section.index("| | shared server |"))
    explained = section[table_end:]
    assert "stand-in" in section[:table_end] and "lanes" in section[:table_end]
    assert re.search(r"A \*lane\* is one of the server's decode threads", explained)
    assert re.search(r"The \*stand-in\* is a decoder that computes nothing", explained)
