"""What a soak found: ``SoakResult`` (the package docstring says what each counter means),
``_tally``, which counts the clients' log lines, and ``format_result``, the table printed."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SoakResult:
    seconds: float
    clients: int
    client_kills: int
    server_kills: int
    server_term_restarts: int
    client_forks: int  # forks asked for (their children decode)
    client_closes: int
    stops: int
    hung_clients: int
    sent: int
    correct: int
    failed_clearly: int
    killed_in_flight: int
    lost: int
    wrong_audio: int
    leaked_slots: int
    left_in_dev_shm: int
    errors_by_kind: dict
    forks: int = 0  # every fork made, bare ones included
    timed_out: int = 0  # DecodeTimeoutError: nobody answered, or no slot came free
    undocumented_errors: int = 0  # an exception outside the documented tree reached a caller
    undocumented_by_kind: dict = field(default_factory=dict)
    hung_threads: int = 0
    refused_too_long: int = 0  # ValueError: longer than the (small) server it went to holds
    hung_forks: int = 0
    unlocked_owned: int = 0  # times a handle owned a slot without holding its lock
    fresh_client_failures: int = 0  # a fresh client in another process got no correct answer
    fresh_client_detail: str = ""
    work_dir: str = ""  # kept when the soak failed: the clients' logs

    @property
    def hung(self) -> int:
        return self.hung_clients + self.hung_threads + self.hung_forks

    @property
    def ok(self) -> bool:
        return (self.lost == self.wrong_audio == self.leaked_slots == self.left_in_dev_shm
                == self.hung == self.timed_out == self.undocumented_errors == self.unlocked_owned
                == self.fresh_client_failures == 0)  # fmt: skip


def _tally(logs, args, kills, server_kills, term_restarts, forks, hung, leaked, left,
           seconds) -> SoakResult:  # fmt: skip
    """Count the clients' log lines (``client_main`` names each tag)."""
    sent = correct = failed = killed_in_flight = lost = wrong = timed_out = undocumented = refused = 0
    made_forks = hung_threads = hung_forks = unlocked = 0
    kinds: dict[str, int] = {}
    strange: dict[str, int] = {}
    for path, was_killed in logs:
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        pending = 0
        for line in lines:
            tag = line[:1]
            if tag == "S":
                sent += 1
                pending += 1
                continue
            if tag == "F":
                made_forks += 1
                continue
            if tag == "H":
                hung_forks += line.startswith("H fork")
                hung_threads += line.startswith("H thread")
                continue
            if tag == "X":
                unlocked += 1
                continue
            if tag not in "OWETUR" or not line:
                continue  # a line cut short by a SIGKILL
            pending -= 1
            if tag == "O":
                correct += 1
            elif tag == "W":
                wrong += 1
            elif tag == "T":
                timed_out += 1
            elif tag == "R":
                refused += 1
            elif tag == "E":
                failed += 1
                kind = line.split()[-1]
                kinds[kind] = kinds.get(kind, 0) + 1
            elif tag == "U":
                undocumented += 1
                kind = line.split()[-1]
                strange[kind] = strange.get(kind, 0) + 1
        if was_killed:
            killed_in_flight += max(0, pending)
        else:
            lost += max(0, pending)
    return SoakResult(
        seconds=round(seconds, 1), clients=args.clients, client_kills=kills,
        server_kills=server_kills, server_term_restarts=term_restarts, client_forks=forks,
        client_closes=0, stops=0,
        hung_clients=hung, sent=sent, correct=correct, failed_clearly=failed,
        killed_in_flight=killed_in_flight, lost=lost, wrong_audio=wrong, leaked_slots=leaked,
        left_in_dev_shm=left, errors_by_kind=kinds, forks=made_forks, timed_out=timed_out,
        undocumented_errors=undocumented, undocumented_by_kind=strange, hung_threads=hung_threads,
        hung_forks=hung_forks, unlocked_owned=unlocked, refused_too_long=refused,
    )  # fmt: skip


def format_result(r: SoakResult) -> str:
    rows = [
        ("duration", f"{r.seconds:.0f} s"),
        ("client processes", r.clients),
        ("client kills (SIGKILL)", r.client_kills),
        ("server kills (SIGKILL)", r.server_kills),
        ("rolling restarts (SIGTERM)", r.server_term_restarts),
        ("client forks (the child decodes)", r.client_forks),
        ("forks in all (bare ones too)", r.forks),
        ("client closes (calls in flight)", r.client_closes),
        ("SIGSTOP/SIGCONT (client or server)", r.stops),
        ("hung clients", r.hung_clients),
        ("hung threads", r.hung_threads),
        ("hung forked children", r.hung_forks),
        ("requests sent", r.sent),
        ("completed correctly", r.correct),
        ("failed with a clear error", f"{r.failed_clearly} {r.errors_by_kind or ''}".strip()),
        ("refused as too long for the server", r.refused_too_long),
        ("killed in flight", r.killed_in_flight),
        ("lost (never answered)", r.lost),
        ("timed out (lost or wedged)", r.timed_out),
        ("undocumented errors", f"{r.undocumented_errors} {r.undocumented_by_kind or ''}".strip()),
        ("wrong audio", r.wrong_audio),
        ("slots owned without their lock", r.unlocked_owned),
        ("fresh client in another process", r.fresh_client_detail or "not run"),
        ("leaked slots", r.leaked_slots),
        ("objects left in /dev/shm", r.left_in_dev_shm),
        *((("logs kept in", r.work_dir),) if r.work_dir else ()),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
