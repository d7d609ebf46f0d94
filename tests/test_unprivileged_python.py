"""The Python that tests of an ordinary user run (the ``unprivileged_python`` fixture, made by
``support.prepare_unprivileged_python``): it runs as that uid, imports this tree's package and
its torch-free dependencies from its own copy, leaves nothing behind, and a run that cannot
prepare it fails under CI instead of skipping."""

from __future__ import annotations

import os

import pytest
from support import UNPRIVILEGED_UID, NoUnprivilegedPython, prepare_unprivileged_python, skip_or_fail_in_ci

_WHO_AND_WHERE = """
import os, sys
import bicodec_shm, numpy, posix_ipc
print(os.getuid(), os.geteuid(), os.getgid(), os.getgroups())
print(sys.executable)
for module in (bicodec_shm, numpy, posix_ipc):
    print(os.path.realpath(module.__file__))
try:
    open(sys.argv[1]).close()
    print("read root's file")
except PermissionError:
    print("refused root's file")
"""


def test_it_runs_as_the_other_uid_and_imports_only_its_own_copy(unprivileged_python, tmp_path):
    private = tmp_path / "root-only"
    private.write_text("x")
    private.chmod(0o600)
    os.chmod(tmp_path, 0o755)
    done = unprivileged_python.run("-c", _WHO_AND_WHERE, str(private))
    assert done.returncode == 0, done.stderr
    ids, python, *modules, verdict = done.stdout.splitlines()
    assert ids == f"{UNPRIVILEGED_UID} {UNPRIVILEGED_UID} {UNPRIVILEGED_UID} []", ids
    copy = os.path.realpath(unprivileged_python.env["PYTHONPATH"])
    assert all(m.startswith(copy + os.sep) for m in modules), (copy, modules)
    assert verdict == "refused root's file"


def test_the_copy_is_removed_afterwards():
    try:
        with prepare_unprivileged_python() as user:
            top = os.path.dirname(user.home)
            assert os.path.isdir(top)
    except NoUnprivilegedPython as why:
        skip_or_fail_in_ci(str(why))
    assert not os.path.exists(top)


@pytest.mark.parametrize("ci", ["true", ""])
def test_a_python_that_cannot_be_prepared_fails_the_test_under_ci_and_skips_elsewhere(monkeypatch, ci):
    monkeypatch.setenv("CI", ci)
    expected = pytest.fail.Exception if ci else pytest.skip.Exception
    raised = None
    try:  # (not pytest.raises: a skip escaping it would skip this test, not fail it)
        skip_or_fail_in_ci("no interpreter that uid 1000 may run")
    except (pytest.fail.Exception, pytest.skip.Exception) as outcome:
        raised = outcome
    assert type(raised) is expected, raised
    assert "no interpreter that uid 1000 may run" in str(raised)
