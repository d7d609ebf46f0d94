"""A server run by an ordinary user, under a name whose semaphore another user took first.

/dev/shm is sticky: a user who is not root may not remove another user's semaphore there. So
these tests run the server's start as an unprivileged uid (``setpriv``), as deployments do; as
root the server could remove anything, and the problem would not show. They need root (to
switch uid and to play the other user): the ``unprivileged_python`` fixture prepares a Python
that uid may run (skipped without root, but failed under CI).

What runs as that uid is the torch-free part of ``bicodec-shm serve``, the part that meets the
other user's semaphore: owning the name (``reserve_name``, before the model loads) and creating
the segment and its semaphores under it (``Segment.create``, as ``DecoderServer`` does), with
the command's own error line for a refusal. The model and its torch need not be readable by
that uid (a virtualenv in root's home), so the test runs wherever the suite runs as root.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import posix_ipc
import pytest

from bicodec_shm.protocol.names import leftover_objects, random_name, unlink_all

# ``bicodec-shm serve`` up to its model, as that uid: exits 1 with the command's error line
# (tools/cli.py) for a refusal, 0 once the segment is made (and unlinked again).
_SERVE_UNTIL_THE_MODEL = """
import sys
from bicodec_shm.errors import BiCodecShmError
from bicodec_shm.protocol.layout import DEFAULT_START_WAIT
from bicodec_shm.protocol.names import reserve_name
from bicodec_shm.protocol.segment import Segment
name = sys.argv[1]
try:
    reserved = reserve_name(name, wait=DEFAULT_START_WAIT)
    segment = Segment.create(name, n_slots=2, max_tokens=10, reserved=reserved)
except (BiCodecShmError, ValueError) as exc:
    print(f"bicodec-shm: error: {exc}", file=sys.stderr)
    sys.exit(1)
segment.unlink()
segment.close()
"""


@pytest.fixture
def name() -> Iterator[str]:
    name = random_name("bcshm-test")
    yield name
    unlink_all(name)  # as root: the other user's object and anything of ours
    assert leftover_objects(name) == []


def _squat(name: str) -> None:
    """Another user (root here) takes ``sem.NAME.ready``, replacing any that is there."""
    try:
        posix_ipc.unlink_semaphore(f"/{name}.ready")
    except posix_ipc.ExistentialError:
        pass
    posix_ipc.Semaphore(f"/{name}.ready", posix_ipc.O_CREX, 0o600, 0).close()


_DIE_AFTER_CREATING = """
import os, signal, sys
from bicodec_shm.protocol.segment import Segment
Segment.create(sys.argv[1], n_slots=2, max_tokens=10)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("before", ["nothing", "a dead server's leftovers"])
def test_an_unprivileged_server_under_a_squatted_semaphore_fails_clearly_and_leaves_nothing(
    unprivileged_python, name, before
):
    if before != "nothing":
        dead = unprivileged_python.run("-c", _DIE_AFTER_CREATING, name)
        assert dead.returncode == -signal.SIGKILL, dead.stderr
        assert f"sem.{name}.ready" in leftover_objects(name) and name in leftover_objects(name)
    _squat(name)
    serve = unprivileged_python.run("-c", _SERVE_UNTIL_THE_MODEL, name)
    assert serve.returncode == 1, serve.stderr
    assert "Traceback" not in serve.stderr and "PermissionsError" not in serve.stderr, serve.stderr
    assert f"error: cannot create the semaphore /dev/shm/sem.{name}.ready" in serve.stderr, serve.stderr
    assert "belongs to uid 0" in serve.stderr, serve.stderr
    assert leftover_objects(name) == [f"sem.{name}.ready"]  # the other user's alone: ours are gone
