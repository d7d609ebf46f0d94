"""A server run by an ordinary user, under a name whose semaphore another user took first.

/dev/shm is sticky: a user who is not root may not remove another user's semaphore there. So
these tests run the server as an unprivileged uid (``setpriv``), as deployments do; as root the
server could remove anything, and the problem would not show. They need root (to switch uid and
to play the other user) and an interpreter that uid can run with this package importable.
"""

from __future__ import annotations

import os
import shutil
import signal
import site
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import posix_ipc
import pytest
from conftest import ROOT

from bicodec_shm.protocol.names import leftover_objects, random_name, unlink_all

UID = 1000  # the ordinary user the server runs as (no account needed: setpriv takes numbers)
SETPRIV = shutil.which("setpriv")


def _unprivileged_python(home: str) -> tuple[list[str], dict[str, str]] | None:
    """(command prefix, environment) that runs this package's Python as ``UID``, or None.

    The package under test is copied into ``home`` first: the tree itself may not be readable
    by that uid (a private temporary copy, a home directory), and an installed copy found
    instead would be another version of the code."""
    src = os.path.join(home, "src")
    shutil.copytree(os.path.join(ROOT, "bicodec_shm"), os.path.join(src, "bicodec_shm"),
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    for directory, _, _ in os.walk(src):
        os.chmod(directory, 0o755)
    path = os.pathsep.join([src, *site.getsitepackages()])
    check = f"import bicodec_shm.tools.cli, torch; assert bicodec_shm.__file__.startswith({src!r})"
    for python in dict.fromkeys([sys.executable, os.path.realpath(sys.executable), "/usr/bin/python3"]):
        if not os.path.exists(python):
            continue
        prefix = [SETPRIV, f"--reuid={UID}", f"--regid={UID}", "--clear-groups", python]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home, "PYTHONPATH": path,
               "PYTHONDONTWRITEBYTECODE": "1"}  # fmt: skip
        try:
            probe = subprocess.run([*prefix, "-c", check], env=env, cwd=home,
                                   capture_output=True, timeout=180)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return prefix, env
    return None


@pytest.fixture(scope="module")
def as_user() -> Iterator[tuple[list[str], dict[str, str]]]:
    if os.geteuid() != 0:
        pytest.skip("needs root: to run the server as another uid and to play the other user")
    if SETPRIV is None:
        pytest.skip("needs setpriv (util-linux) to run the server as an unprivileged uid")
    with tempfile.TemporaryDirectory(prefix="bcshm-unpriv-") as home:
        os.chmod(home, 0o777)  # the unprivileged server's HOME and working directory
        found = _unprivileged_python(home)
        if found is None:
            pytest.skip(f"no Python that uid {UID} may run imports this package (check the "
                        "permissions of the interpreter, the tree and its site-packages)")  # fmt: skip
        yield found


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
    as_user, name, before
):
    prefix, env = as_user
    if before != "nothing":
        dead = subprocess.run([*prefix, "-c", _DIE_AFTER_CREATING, name], env=env, cwd=env["HOME"],
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert dead.returncode == -signal.SIGKILL, dead.stderr
        assert f"sem.{name}.ready" in leftover_objects(name) and name in leftover_objects(name)
    _squat(name)
    serve = subprocess.run([*prefix, "-m", "bicodec_shm", "serve", "--name", name, "--preset", "tiny",
                            "--threads", "1"], env=env, cwd=env["HOME"], capture_output=True, text=True,
                           timeout=180)  # fmt: skip
    assert serve.returncode == 1, serve.stderr
    assert "Traceback" not in serve.stderr and "PermissionsError" not in serve.stderr, serve.stderr
    assert f"error: cannot create the semaphore /dev/shm/sem.{name}.ready" in serve.stderr, serve.stderr
    assert "belongs to uid 0" in serve.stderr, serve.stderr
    assert leftover_objects(name) == [f"sem.{name}.ready"]  # the other user's alone: ours are gone
