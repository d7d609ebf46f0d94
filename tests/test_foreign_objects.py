"""Another user's object under a name of ours: operator tools and clients trust nothing in it.

Anybody may create ``/dev/shm/NAME`` while the name is free: a file of their own (0666, with a
header that looks served, a SERVING lock held, a server pid of their choosing; or 0600), or a
symbolic link. Our tools, run as root here (as in CI), must refuse it with one line and exit 1:
no traceback, no "serving", no pid read from it, the other user's object untouched, nothing of
ours left behind.

The squatting objects are made by the other user's own process (``setpriv`` to uid 1000 running
/bin/sh): their owner, which is all that our checks and the kernel's look at, is that user. The
SERVING lock on them is held from this process: a lock says nothing about who holds it (probes
see any other open file description's), so whose process holds it changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
from conftest import ROOT

from bicodec_shm.client.decoder_client import DecoderClient
from bicodec_shm.codecs.layout import BICODEC
from bicodec_shm.deploy.processes import is_serving
from bicodec_shm.errors import SegmentError
from bicodec_shm.protocol.header import description_digest, read_slot_owners, write_codec
from bicodec_shm.protocol.layout import (
    HEADER_DT,
    HEADER_SIZE,
    LAYOUT_VERSION,
    MAGIC,
    MAX_SLOTS,
    SERVING_BYTE,
    SLOT_DT,
    Layout,
    Phase,
)
from bicodec_shm.protocol.locks import try_lock
from bicodec_shm.protocol.names import ServerState, leftover_objects, probe, random_name, unlink_all
from bicodec_shm.protocol.segment import Segment
from bicodec_shm.tools import cli
from bicodec_shm.tools.cli import main

OTHER = 1000  # the other user (no account needed: setpriv takes numbers)
SETPRIV = shutil.which("setpriv")

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or SETPRIV is None,
                                reason="needs root and setpriv, to play another user")  # fmt: skip


def _header(n_slots: int = 2, max_tokens: int = 10, *, server_pid: int = 1) -> bytes:
    """A complete, served-looking segment of ``n_slots`` x ``max_tokens`` (header and areas)."""
    layout = Layout(n_slots, max_tokens, BICODEC)
    h = np.zeros((), HEADER_DT)
    for field, value in {"version": LAYOUT_VERSION, "header_size": HEADER_SIZE, "n_slots": n_slots,
                         "max_tokens": max_tokens, "slot_size": SLOT_DT.itemsize,
                         "total_size": layout.total_size, "server_pid": server_pid,
                         "phase": Phase.SERVING, "magic": MAGIC}.items():  # fmt: skip
        h[field] = value
    write_codec(h, BICODEC)
    h["digest"] = description_digest(h)  # consistent, as a server (or a forger) writes it
    return h.tobytes() + bytes(layout.total_size - HEADER_DT.itemsize)


def _as_other(script: str, *args: str, data: bytes = b"") -> None:
    """Run the shell ``script`` ($1, $2...: ``args``) as uid OTHER."""
    command = [SETPRIV, f"--reuid={OTHER}", f"--regid={OTHER}", "--clear-groups", "/bin/sh", "-c", script]
    done = subprocess.run([*command, "sh", *args], input=data, capture_output=True, timeout=30)
    assert done.returncode == 0, done.stderr


SQUATS = ("another user's 0666 segment", "another user's 0600 segment", "another user's symbolic link")


@pytest.fixture
def name() -> Iterator[str]:
    name = random_name("bcshm-test")
    yield name
    unlink_all(name)  # as root: the other user's object and anything of ours
    assert leftover_objects(name) == []


@contextlib.contextmanager
def squatted(name: str, kind: str, tmp_path, *, held: bool = False, data: bytes | None = None):
    """``/dev/shm/NAME`` made by uid OTHER as ``kind``; yields a snapshot function that tells
    whether it (and a link's target, a file of ours) is exactly as it was made."""
    path = f"/dev/shm/{name}"
    target = tmp_path / "ours.txt"
    target.write_text("a file of ours\n")
    if kind.endswith("symbolic link"):
        _as_other('ln -s "$2" "$1"', path, str(target))
    else:
        umask = "0" if "0666" in kind else "077"
        _as_other(f'umask {umask}; cat > "$1"', path, data=_header() if data is None else data)

    def snapshot() -> tuple:
        st = os.lstat(path)
        if os.path.islink(path):
            content = os.readlink(path)
        else:
            with open(path, "rb") as f:
                content = f.read()
        return st.st_ino, st.st_uid, st.st_mode, content, target.read_text()

    before = snapshot()
    assert before[1] == OTHER
    fd = -1
    if held:  # what a live server holds: the object now probes as served to a reader that trusts it
        fd = os.open(path, os.O_RDWR)
        assert try_lock(fd, SERVING_BYTE)
    try:
        yield lambda: snapshot() == before
    finally:
        if fd >= 0:
            os.close(fd)


def _refusal(kind: str) -> str:
    return "is a symbolic link" if kind.endswith("link") else f"belongs to uid {OTHER}, not to uid 0"


@pytest.fixture
def no_model(monkeypatch):
    """``serve`` must refuse the name before it loads a model: one that gets that far fails
    here at once, instead of serving (it would have taken the other user's name over)."""

    def refuse(args):
        raise AssertionError("serve went on to load a model under a name that is not its own")

    monkeypatch.setattr(cli, "load_decoder", refuse)


def _one_line(capsys) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bicodec-shm: error: "), err
    assert "Traceback" not in err and "server pid" not in out + err, out + err
    return lines[0]


# -- nothing served-looking in another user's object counts --------------------------------------


@pytest.mark.parametrize("kind", [SQUATS[0], SQUATS[2]])
def test_another_users_object_is_not_serving_to_probe_is_serving_or_the_http_examples_healthz(
    name, tmp_path, kind
):
    """Its SERVING byte held (a served-looking segment), or a link: not served. The HTTP
    example's worker starts (its start-up attaches when a server serves) and /healthz says 503."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("starlette")
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from examples.decode_api import Settings, create_app

    async def start_and_ask_healthz(app):
        async with app.router.lifespan_context(app):  # what uvicorn runs as a worker starts
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                return await client.get("/healthz")

    with squatted(name, kind, tmp_path, held=not kind.endswith("link")) as untouched:
        assert probe(name) is ServerState.ABSENT
        assert is_serving(name) is False
        r = asyncio.run(start_and_ask_healthz(create_app(Settings(name=name))))
        assert r.status_code == 503 and r.json()["serving"] is False
        assert untouched()


@pytest.mark.parametrize("command", ["stats", "serve"])
def test_stats_and_serve_refuse_another_users_served_looking_object_without_naming_its_pid(
    name, tmp_path, capsys, no_model, command
):
    """stats, a health probe, must not exit 0; serve must not ask the operator to stop the pid
    the other user wrote (1): it says whose the name is."""
    argv = ["stats", name] if command == "stats" else ["serve", "--name", name, "--preset", "tiny",
                                                       "--threads", "1"]  # fmt: skip
    with squatted(name, SQUATS[0], tmp_path, held=True) as untouched:
        assert main(argv) == 1
        assert _refusal(SQUATS[0]) in _one_line(capsys)
        assert untouched() and leftover_objects(name) == [name]


# -- a squatted name: one line from every tool and the client, for each kind of squat ------------


@pytest.mark.parametrize("kind", SQUATS)
@pytest.mark.parametrize("command", ["serve", "stats", "cleanup"])
def test_every_tool_refuses_a_squatted_name_in_one_line_and_leaves_it_untouched(
    name, tmp_path, capsys, no_model, kind, command
):
    argv = {"serve": ["serve", "--name", name, "--preset", "tiny", "--threads", "1"],
            "stats": ["stats", name], "cleanup": ["cleanup", name]}[command]  # fmt: skip
    with squatted(name, kind, tmp_path) as untouched:
        assert main(argv) == 1
        assert _refusal(kind) in _one_line(capsys)
        assert untouched() and leftover_objects(name) == [name]


@pytest.mark.parametrize("kind", SQUATS)
def test_a_client_refuses_a_squatted_name_with_a_segment_error(name, tmp_path, kind):
    with squatted(name, kind, tmp_path) as untouched:
        with pytest.raises(SegmentError, match=_refusal(kind)):
            DecoderClient(name, connect_timeout=0.0)
        assert untouched() and leftover_objects(name) == [name]


def test_an_ordinary_user_refuses_roots_0600_object_under_the_name_in_one_line(unprivileged_python, name):
    """Our tools run as uid 1000; root made the name first (0600): this user may not even open
    it. Each says so in one line, exits 1, and removes nothing."""
    path = f"/dev/shm/{name}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.write(fd, _header())
        before = os.fstat(fd)
        client = ("import sys\nfrom bicodec_shm import DecoderClient, BiCodecShmError\n"
                  "try:\n    DecoderClient(sys.argv[1])\nexcept BiCodecShmError as e:\n"
                  "    print(f'bicodec-shm: error: {e}', file=sys.stderr); sys.exit(1)")  # fmt: skip
        for argv in (["-m", "bicodec_shm", "cleanup", name], ["-m", "bicodec_shm", "stats", name],
                     ["-m", "bicodec_shm", "serve", "--name", name, "--preset", "tiny"],
                     ["-c", client, name]):  # fmt: skip
            done = unprivileged_python.run(*argv, timeout=180)
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 1 and len(lines) == 1, (argv, done.stderr)
            assert f"/dev/shm/{name} exists (uid 0's) and this user may not open it" in lines[0], lines
            assert "Traceback" not in done.stderr
        after = os.stat(path)
        assert (after.st_ino, after.st_uid, after.st_mode) == (before.st_ino, 0, before.st_mode)
        assert leftover_objects(name) == [name]
    finally:
        os.close(fd)


# -- a header's slot count: bounded by the layout and the object's real size ----------------------


def test_a_header_claiming_more_slots_than_a_segment_has_is_refused_by_stats_and_clients(name, capsys):
    """A header any client of ours could have written (a buggy one): MAX_SLOTS + 1 slots, in an
    object of exactly the size they need. A reader allocates what the layout allows, no more."""
    data = _header(n_slots=MAX_SLOTS + 1, max_tokens=1)
    fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, len(data))
        os.pwrite(fd, data[:HEADER_DT.itemsize], 0)
        serving = os.open(f"/dev/shm/{name}", os.O_RDWR)
        try:
            assert try_lock(serving, SERVING_BYTE)
            assert main(["stats", name]) == 1
            assert f"{MAX_SLOTS + 1} slots" in _one_line(capsys)
            with pytest.raises(SegmentError, match=f"1..{MAX_SLOTS} slots"):
                read_slot_owners(name)
            with pytest.raises(SegmentError, match=f"1..{MAX_SLOTS} slots"):
                Segment.attach(name)
        finally:
            os.close(serving)
    finally:
        os.close(fd)

