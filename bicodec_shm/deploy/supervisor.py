"""The supervisor of a server group: one ``bicodec-shm serve`` process per device.

``bicodec-shm serve --device cuda:0,cuda:1 --name N`` runs this instead of a server. It owns the
group object ``/dev/shm/N`` (group.py) and starts member ``K`` as ``bicodec-shm serve`` with
every option of its own command line, then ``--device D_K --name N.K`` (argparse keeps the last
value of an option); a CUDA member gets ``--device cuda:0`` and ``CUDA_VISIBLE_DEVICES`` naming
its own GPU (:func:`member_device`). Then:

- When every member has served once, the group takes its SERVING lock: clients see it.
- A member that dies is restarted after a backoff that doubles (0.5 s, 1 s, ... up to 30 s)
  while it keeps dying within a minute of its start; one log line per death says how it ended
  and when it comes back. Its clients' requests go to the other members meanwhile.
- A member that fails at its very first start, before it ever served, with an error exit (a
  bad device, a missing model folder) stops the whole group with exit code 1: restarting it
  would only repeat the error.
- SIGTERM or SIGINT: the group stops serving, the signal goes to every member (each finishes
  its running batches and unlinks its segment), the supervisor waits for them, unlinks the
  group object and exits 0.
- If the supervisor itself dies, even by SIGKILL, the kernel sends each member SIGTERM
  (PR_SET_PDEATHSIG): only the group object is left, and the next supervisor takes it over.

The supervisor never imports torch. It polls (every 0.1 s): it waits on child processes and on
signals, and nothing it does is on a request's path.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import ServerAlreadyRunningError
from ..protocol.group import MAX_MEMBERS, GroupObject, member_names, validate_group_name
from ..protocol.layout import DEFAULT_MODE
from ..protocol.names import ServerState, is_stopping, probe, unlink_all
from ..server.signals import on_stop_signals
from .processes import die_with_parent

log = logging.getLogger("bicodec_shm.supervisor")

POLL = 0.1  # seconds between looks at the members
BACKOFF_FIRST = 0.5  # seconds before the first restart of a member
BACKOFF_MAX = 30.0
STABLE_AFTER = 60.0  # a member that ran this long before dying restarts after BACKOFF_FIRST again
DEFAULT_START_WAIT = 30.0  # seconds to wait for a group that is stopping under the same name
DEFAULT_STOP_TIMEOUT = 120.0  # seconds members get to finish their batches before SIGKILL
MEMBER_NAME_GRACE = 5.0  # seconds a member's name may stay served by a dying earlier server


def parse_devices(text: str) -> list[str]:
    """``"cuda:0,cuda:1"`` -> ``["cuda:0", "cuda:1"]``; duplicates are allowed (``cpu,cpu``)."""
    devices = [d.strip() for d in text.split(",")]
    if any(not d for d in devices):
        raise ValueError(f"--device {text!r} has an empty entry: give devices separated by commas, "
                         "e.g. --device cuda:0,cuda:1")  # fmt: skip
    if len(devices) > MAX_MEMBERS:
        raise ValueError(f"--device lists {len(devices)} devices; a group has at most {MAX_MEMBERS}")
    return devices


def member_device(device: str, visible: str | None) -> tuple[str, dict[str, str]]:
    """The device a member is started with, and the environment it needs for it.

    A CUDA member sees only its own GPU: ``cuda:K`` becomes ``cuda:0`` with
    ``CUDA_VISIBLE_DEVICES`` set to the K-th GPU the supervisor sees (``visible``, its own
    ``CUDA_VISIBLE_DEVICES``, or GPU K when that is unset). So the member's current device *is*
    its model's device: every stream, event and pinned copy of the lanes lands on that GPU, and
    no member creates a CUDA context on GPU 0 (~500 MiB each). Other devices are unchanged.

    Raises:
        ValueError: ``cuda:K`` past the GPUs that ``CUDA_VISIBLE_DEVICES`` lists.
    """
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return device, {}
    k = int(index) if index else 0
    if visible is None:
        return "cuda:0", {"CUDA_VISIBLE_DEVICES": str(k)}
    listed = [v.strip() for v in visible.split(",") if v.strip()]
    if k >= len(listed):
        raise ValueError(f"device {device!r}: CUDA_VISIBLE_DEVICES={visible!r} makes only "
                         f"{len(listed)} GPU(s) visible, cuda:0 to cuda:{len(listed) - 1}")  # fmt: skip
    return "cuda:0", {"CUDA_VISIBLE_DEVICES": listed[k]}


def member_command(argv: Sequence[str], name: str, device: str, *,
                   metrics_port: int | None = None) -> list[str]:  # fmt: skip
    """The command line of one member: the supervisor's ``serve`` arguments ``argv``, then the
    member's own device, name and metrics port, which win (argparse keeps the last value).
    ``device`` is what the member process opens (see :func:`member_device`)."""
    command = [sys.executable, "-m", "bicodec_shm", *argv, "--device", device, "--name", name]
    if metrics_port is not None:
        command += ["--metrics-port", str(metrics_port)]
    return command


def serve_group(name: str, devices: Sequence[str], argv: Sequence[str], *, mode: int = DEFAULT_MODE,
                metrics_port: int | None = None) -> int:  # fmt: skip
    """``bicodec-shm serve`` with several devices: supervise one member per device until
    SIGTERM/SIGINT. ``argv`` is the ``serve`` command line (from "serve" on). Member K serves
    metrics on ``metrics_port + K`` (or on any free port if ``metrics_port`` is 0); a CUDA
    member sees only its own GPU, as ``cuda:0`` (:func:`member_device`)."""
    validate_group_name(name)
    commands, envs = [], []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    for i, (member, device) in enumerate(zip(member_names(name, len(devices)), devices)):
        port = None if metrics_port is None else metrics_port + i if metrics_port else 0
        opened, env = member_device(device, visible)
        commands.append(member_command(argv, member, opened, metrics_port=port))
        envs.append(env)
    return Supervisor(name, devices, commands, mode=mode, envs=envs).run()


@dataclass
class Member:
    """One member's process and its restart history."""

    index: int
    name: str
    device: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)  # set on top of the supervisor's
    proc: subprocess.Popen | None = None
    started: float = 0.0  # monotonic start of the current process
    serving: bool = False  # the current process has served
    ever_served: bool = False
    restarts: int = 0
    deaths_in_a_row: int = 0
    restart_at: float = 0.0

    def describe(self) -> str:
        pid = f", pid {self.proc.pid}" if self.proc is not None else ""
        return f"member {self.name} (device {self.device}{pid})"


class Supervisor:
    """Run, restart and stop the members of group ``name`` (see the module docstring).

    Args:
        name: the group's name; members are ``name.0``, ``name.1``, ...
        devices: one device per member (informational: each command names its own).
        commands: the command line of each member.
        envs: environment variables of each member, on top of the supervisor's (None: none).
        mode: permission bits of the group object.
        start_wait: seconds to wait for a group or server that is stopping under ``name``.
        stop_timeout: seconds members get to stop after the signal before SIGKILL.
    """

    def __init__(self, name: str, devices: Sequence[str], commands: Sequence[list[str]], *,
                 mode: int = DEFAULT_MODE, start_wait: float = DEFAULT_START_WAIT,
                 stop_timeout: float = DEFAULT_STOP_TIMEOUT,
                 envs: Sequence[dict[str, str]] | None = None) -> None:  # fmt: skip
        validate_group_name(name)
        if len(devices) != len(commands) or not devices:
            raise ValueError("a group needs one command per device, and at least one device")
        envs = envs if envs is not None else [{} for _ in devices]
        if len(envs) != len(devices):
            raise ValueError("a group needs one environment per device (or none at all)")
        self.name = name
        self.mode = mode
        self.start_wait = start_wait
        self.stop_timeout = stop_timeout
        names = member_names(name, len(devices))
        self.members = [Member(i, names[i], devices[i], list(commands[i]), dict(envs[i]))
                         for i in range(len(devices))]  # fmt: skip
        self._signal: int | None = None  # the stop signal received, if any
        self._group: GroupObject | None = None

    def run(self) -> int:
        """Supervise until a stop signal (exit code 0) or a member's start-up failure (1)."""
        group = GroupObject.create(self.name, [m.device for m in self.members],
                                   mode=self.mode, wait=self.start_wait)  # fmt: skip
        try:
            self._check_member_names()
        except BaseException:
            group.unlink()
            group.close()
            raise
        self._group = group
        restore = on_stop_signals(self._on_stop_signal)
        code = 1
        try:
            log.info("group %r: starting %d members: %s", self.name, len(self.members),
                     ", ".join(f"{m.name} on {m.device}" for m in self.members))  # fmt: skip
            for member in self.members:
                self._start(member)
            code = self._supervise()
        finally:
            group.stop_serving()  # clients see the group as stopping from now on
            self._stop_members()
            restore()
            self._sweep_members()
            group.unlink()
            group.close()
            self._group = None
            log.info("stopped group %r and unlinked /dev/shm/%s", self.name, self.name)
        return code

    # -- the loop ---------------------------------------------------------------------------

    def _supervise(self) -> int:
        up = False
        while self._signal is None:
            now = time.monotonic()
            for m in self.members:
                if m.proc is None:
                    if now >= m.restart_at:
                        self._start(m)
                    continue
                code = m.proc.poll()
                if code is None:
                    if not m.serving and probe(m.name) is ServerState.SERVING:
                        self._served(m)
                    continue
                if self._signal is not None:
                    break  # a terminal's Ctrl-C reached the members too: no restarts now
                if not m.ever_served and m.restarts == 0 and code > 0:
                    log.error("%s exited with code %d before it ever served (its log above says "
                              "why); stopping the group", m.describe(), code)  # fmt: skip
                    return 1
                self._schedule_restart(m, code, now)
            if not up and all(m.ever_served for m in self.members):
                up = True
                self._group.start_serving()  # type: ignore[union-attr]
                print(f"bicodec-shm: serving group {self.name!r} on "
                      f"{', '.join(m.device for m in self.members)} as "
                      f"{', '.join(m.name for m in self.members)} (Ctrl-C to stop)",
                      file=sys.stderr, flush=True)  # fmt: skip
            time.sleep(POLL)
        return 0

    def _start(self, m: Member) -> None:
        env = {**os.environ, **m.env} if m.env else None
        m.proc = subprocess.Popen(m.command, stdin=subprocess.DEVNULL, env=env,
                                  preexec_fn=die_with_parent())  # fmt: skip
        m.started = time.monotonic()
        m.serving = False

    def _served(self, m: Member) -> None:
        m.serving = True
        if m.ever_served:
            log.info("%s serves again (restart %d)", m.describe(), m.restarts)
        else:
            log.info("%s serves", m.describe())
        m.ever_served = True

    def _schedule_restart(self, m: Member, code: int, now: float) -> None:
        ran = now - m.started
        m.deaths_in_a_row = 1 if ran >= STABLE_AFTER else m.deaths_in_a_row + 1
        delay = min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** (m.deaths_in_a_row - 1))
        what = m.describe()
        m.proc = None
        m.serving = False
        m.restarts += 1
        m.restart_at = now + delay
        self._group.set_restarts(m.index, m.restarts)  # type: ignore[union-attr]
        in_a_row = f", {m.deaths_in_a_row} quick deaths in a row" if m.deaths_in_a_row > 1 else ""
        log.warning("%s %s after %.1f s; restarting it in %.1f s (restart %d%s)", what,
                    describe_exit(code), ran, delay, m.restarts, in_a_row)  # fmt: skip

    # -- stopping ---------------------------------------------------------------------------

    def _stop_members(self) -> None:
        sig = self._signal or signal.SIGTERM
        live = [m for m in self.members if m.proc is not None and m.proc.poll() is None]
        if live:
            log.info("sending %s to %d member(s); waiting for them to finish their batches",
                     signal.Signals(sig).name, len(live))  # fmt: skip
        for m in live:
            try:
                m.proc.send_signal(sig)  # type: ignore[union-attr]
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + self.stop_timeout
        for m in live:
            proc = m.proc
            assert proc is not None
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("%s did not stop within %.0f s: killing it", m.describe(), self.stop_timeout)
                proc.kill()
                proc.wait()
            m.proc = None

    def _sweep_members(self) -> None:
        """Unlink what members killed mid-way left behind (their locks are gone: DEAD)."""
        for m in self.members:
            if probe(m.name) is ServerState.DEAD:
                n = unlink_all(m.name)
                log.info("removed %d object(s) left by %s", n, m.name)

    def _check_member_names(self) -> None:
        """Refuse to start while another server serves a member's name (after a short grace:
        the members of a killed supervisor stop within moments of its death)."""
        started = time.monotonic()
        deadline = started + MEMBER_NAME_GRACE
        for m in self.members:
            while probe(m.name) is ServerState.SERVING:
                if is_stopping(m.name):
                    # Stopping, but finishing its batches first (full-size batches on a CPU
                    # take longer than the grace): wait for it as long as ``start_wait``.
                    deadline = max(deadline, started + self.start_wait)
                if time.monotonic() >= deadline:
                    raise ServerAlreadyRunningError(
                        f"{m.name!r}, the name of member {m.index} of group {self.name!r}, is "
                        "already served by another bicodec-shm server: stop it first or choose "
                        "another --name"
                    )
                time.sleep(POLL)

    # -- signals ----------------------------------------------------------------------------

    def _on_stop_signal(self, signum: int) -> None:
        # Only a flag: the loop (or the wait in _stop_members) acts on it.
        if self._signal is None:
            self._signal = signum
            log.info("received %s: stopping group %r", signal.Signals(signum).name, self.name)
        else:
            log.info("received %s again: still waiting for the members to stop",
                     signal.Signals(signum).name)  # fmt: skip


def describe_exit(code: int) -> str:
    """A ``Popen.returncode`` in words: "exited with code 1", "was killed by SIGKILL"."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
