"""Memory and CPU sampling of the processes under test, and the machine record."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import threading
import time
from typing import Any


class _Sampler:
    """Every ``interval`` s: summed RSS and CPU times of the watched processes (psutil).

    The peak and the CPU seconds cover the window between ``open()`` and ``close()`` only, so
    start-up (importing torch, building the model) is not counted.
    """

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._procs: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._window = False
        self.peak_rss = 0
        self.peak_rss_by_pid: dict[int, int] = {}
        self.samples = 0
        self._cpu_first: dict[int, float] = {}
        self._cpu_last: dict[int, float] = {}
        self._sys_cpu0: Any = None
        self.others_cpu_share: float | None = None
        self._t0 = 0.0
        self._thread = threading.Thread(target=self._run, daemon=True, name="bench-rss-sampler")
        self._thread.start()

    def watch(self, pid: int) -> None:
        import psutil

        with contextlib.suppress(psutil.Error):
            with self._lock:
                self._procs[pid] = psutil.Process(pid)

    def open(self) -> None:
        import psutil

        with self._lock:
            self.peak_rss, self.samples, self.peak_rss_by_pid = 0, 0, {}
            self._cpu_first, self._cpu_last = {}, {}
            self._window = True
            self._sys_cpu0 = psutil.cpu_times()
            self._t0 = time.monotonic()
        self.sample()

    def close(self) -> None:
        import psutil

        self.sample()
        with self._lock:
            self._window = False
            wall = time.monotonic() - self._t0
            busy = _busy(psutil.cpu_times()) - _busy(self._sys_cpu0)
            ours = self.cpu_seconds
            cores = psutil.cpu_count() or 1
            self.others_cpu_share = max(0.0, busy - ours) / (wall * cores) if wall > 0 else None

    def clear(self) -> None:
        """Forget the processes of the last run (their pids may be reused)."""
        with self._lock:
            self._procs.clear()

    @property
    def cpu_seconds(self) -> float:
        return sum(self._cpu_last[p] - self._cpu_first[p] for p in self._cpu_last)

    def sample(self) -> None:
        import psutil

        with self._lock:
            if not self._window:
                return
            total = 0
            for pid, proc in list(self._procs.items()):
                try:
                    with proc.oneshot():
                        rss = proc.memory_info().rss
                        cpu = proc.cpu_times()
                except psutil.Error:
                    continue  # exited
                total += rss
                self.peak_rss_by_pid[pid] = max(self.peak_rss_by_pid.get(pid, 0), rss)
                used = cpu.user + cpu.system
                self._cpu_first.setdefault(pid, used)
                self._cpu_last[pid] = used
            self.peak_rss = max(self.peak_rss, total)
            self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _busy(t: Any) -> float:
    """CPU seconds the machine spent busy (guest time is already inside user and nice)."""
    return sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))


def environment() -> dict[str, Any]:
    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "usable_cores": _cores(),
        "loadavg": list(os.getloadavg()),
        "versions": {d: version(d) for d in ("bicodec-shm", "numpy", "posix_ipc", "torch", "psutil")},
    }


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
