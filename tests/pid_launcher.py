"""PID 1 of a fresh PID namespace: run a command as a chosen PID of that namespace.

    python pid_launcher.py PID COMMAND...

Forks throwaway children until the namespace hands out PID, execs COMMAND in that child,
forwards SIGTERM and SIGINT to it, and exits with its exit code. Tests use it to give a server
a PID that no process has in the host's view (a liveness check by PID would then see it dead).
"""

from __future__ import annotations

import os
import signal
import sys


def main() -> int:
    target, command = int(sys.argv[1]), sys.argv[2:]
    if os.getpid() != 1:
        sys.exit("pid_launcher: run me as PID 1 of a new PID namespace (unshare --pid --fork)")
    while True:
        pid = os.fork()
        if pid == 0:
            if os.getpid() == target:
                os.execvp(command[0], command)
            os._exit(0)
        if pid == target:
            break
        os.waitpid(pid, 0)
        if pid > target:
            sys.exit(f"pid_launcher: PID {target} was passed over (got {pid})")
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda s, _f: os.kill(target, s))
    while True:
        try:
            _, status = os.waitpid(target, 0)
            return os.waitstatus_to_exitcode(status)
        except InterruptedError:
            continue


if __name__ == "__main__":
    sys.exit(main())
