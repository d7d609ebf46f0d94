"""Where the server's CPU per request goes, with the IPC waits taken out.

``bench_ipc.py`` measures the server's CPU per request as it is deployed: a server process,
client processes, and the wake-ups between them. This script takes the waits out, to show what
the server's own code costs per request and in which step.

How: one process drives a real ``DecoderServer`` (the no-op decoder of ``bench_ipc.py``, on
the CPU) and B real ``DecoderClient`` handles through real shared memory and semaphores, one
batch of B at a time. The clients write their requests and ring; then this thread runs the
lane's steps for one batch, exactly as a lane runs them (take: confirm, validate, plan, gather;
launch: the decoder call and the int16 conversion; publish: the slot writes, the counters, the
posts); then the clients read their answers. Server time is this thread's CPU time
(``time.thread_time_ns``) over the server's steps only, divided by B.

Two passes per batch size: a plain one gives the total; a second, with each step wrapped in a
timer, gives the split (the timers cost a little, so the split's sum is printed beside the
total). The last row times what the "decoder call" step does (the adapter's three ``from_numpy`` and
the no-op ``detokenize``) alone, in a tight loop with warm caches: the gap between that and the
step's cost inside the loop is what the clients' work between batches costs the server in
cache misses.

Usage::

    python benchmarks/bench_server_cpu.py            # batch 1 and 16
    python benchmarks/bench_server_cpu.py --quick    # a few seconds, for a smoke check
    python benchmarks/bench_server_cpu.py --batches 1,4,16

Prints a table and writes JSON (default ``benchmarks/out/bench_server_cpu.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import sys
import time
import timeit
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ipc import N_GLOBAL, N_TOKENS, _NoopDecoder  # noqa: E402  (the same no-op decoder)

from bicodec_shm.client.decoder_client import DecoderClient  # noqa: E402
from bicodec_shm.client.requests import submit  # noqa: E402
from bicodec_shm.protocol.layout import NO_BELL
from bicodec_shm.protocol.names import leftover_objects, random_name  # noqa: E402
from bicodec_shm.server import encoding as encoding_module  # noqa: E402
from bicodec_shm.server import server as server_module  # noqa: E402
from bicodec_shm.server.batching import DEFAULT_CUDA_MAX_BATCH_TOKENS  # noqa: E402
from bicodec_shm.server.lanes import Lane, Runner  # noqa: E402
from bicodec_shm.server.server import DecoderServer  # noqa: E402

DEFAULT_BATCHES = (1, 16)
REQUESTS = 3000  # per batch size and pass (so batch 16 runs ~190 batches)
WARMUP = 0.1  # the first tenth of each pass is not counted
TIMEOUT = 10.0  # seconds for any one client step; the no-op server answers in microseconds

# The split: (label, depth, where the step lives, attribute). "server" steps are the
# DecoderServer's methods, "server.py" and "encoding.py" the functions those modules call (each
# looks its functions up in its own namespace: a decode's slot writes go through encoding.py's
# publish_result), "runner" the lane's Runner, "counters" the server's counters.
STEPS = (
    ("take (a batch from the slot table)", 0, "server", "_take"),
    ("confirm and validate", 1, "server", "_scan"),
    ("plan", 1, "planner", "plan"),
    ("gather", 1, "server.py", "gather"),
    ("lane started (counters)", 0, "server", "_lane_started"),
    ("launch", 0, "runner", "launch"),
    ("decoder call", 1, "adapter", "detokenize"),
    ("int16 conversion", 1, "runner", "_to_int16"),
    ("publish", 0, "server", "_publish"),
    ("slot writes", 1, "encoding.py", "publish"),
    ("counters", 1, "counters", "count_batch"),
    ("posts", 1, "server", "_release_and_ring"),
    ("lane finished (counters)", 0, "server", "_lane_finished"),
)


class _Rig:
    """A server, its one lane and B clients, in this process, driven one batch at a time."""

    def __init__(self, batch: int, wrap: Callable[[Any, Any], None] | None = None) -> None:
        self.name = random_name("bcshm-cpu")
        self.batch = batch
        self.server = DecoderServer(_NoopDecoder(), self.name, slots=max(8, batch), max_batch=batch,
                                    max_wait_ms=0, rejoin_ms=0, batching="static",
                                    max_batch_tokens=DEFAULT_CUDA_MAX_BATCH_TOKENS)  # fmt: skip
        # batching="static": every batch of B, as asked (a no-op decoder's batches would measure
        # as not paying, and the server would decode the rows alone).
        try:
            self.runner = Runner(self.server.decoder, self.server.device)
            if wrap is not None:  # before the lane binds the server's methods
                wrap(self.server, self.runner)
            s = self.server
            self.lane = Lane(0, self.runner, take=s._take, publish=s._publish, fail=s._fail_row,
                             started=s._lane_started, finished=s._lane_finished, threads=None,
                             pipeline=False)  # fmt: skip
            self.clients = [DecoderClient(self.name, slots=1) for _ in range(batch)]
            rng = np.random.default_rng(0)
            self.requests = [self.clients[0]._prepare(rng.integers(0, 8192, N_TOKENS).astype(np.int32),
                                                      rng.integers(0, 4096, N_GLOBAL).astype(np.int32),
                                                      "int16")
                             for _ in range(batch)]  # fmt: skip
        except BaseException:
            self.close()
            raise

    def one_batch(self) -> int:
        """Send B requests, serve them as one batch, read the answers; the server's CPU ns."""
        held = []
        for client, request in zip(self.clients, self.requests):
            att = client._attachment(time.monotonic() + TIMEOUT)
            slot, seq = att.take_slot(time.monotonic() + TIMEOUT)
            submit(att, slot, seq, request, NO_BELL)
            held.append((att, slot, seq))
        t0 = time.thread_time_ns()
        batch = self.server._take(False)
        if batch is None or len(batch.requests) != self.batch:
            raise RuntimeError(f"expected one batch of {self.batch}, got {batch and len(batch.requests)}")
        self.server._lane_started(batch, 0)
        self.lane._decode_and_release(batch)
        spent = time.thread_time_ns() - t0
        for att, slot, seq in held:
            pcm = att.wait_result(slot, seq, time.monotonic() + TIMEOUT)
            if pcm.shape != (N_TOKENS * 320,):
                raise RuntimeError(f"answer of shape {pcm.shape}")
        return spent

    def close(self) -> None:
        for client in getattr(self, "clients", []):
            client.close()
        self.server._teardown()  # unlinks the segment and its semaphores


@contextlib.contextmanager
def _timers(spent: dict[str, int]) -> Iterator[Callable[[Any, Any], None]]:
    """Wrap every step of ``STEPS`` in a CPU-time accumulator; restores the module's
    functions afterwards. Yields the function that wraps a rig's server and runner."""

    def timed(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def step(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0) + time.thread_time_ns() - t0

        return step

    modules = {"server.py": server_module, "encoding.py": encoding_module}
    saved = {(where, attr): getattr(modules[where], attr) for _, _, where, attr in STEPS if where in modules}
    for label, _, where, attr in STEPS:
        if where in modules:
            setattr(modules[where], attr, timed(label, saved[where, attr]))

    def wrap(server: DecoderServer, runner: Runner) -> None:
        owners = {"server": server, "runner": runner, "adapter": runner.adapter, "planner": server._planner,
                  "counters": server._counters}
        for label, _, where, attr in STEPS:
            if where in owners:
                setattr(owners[where], attr, timed(label, getattr(owners[where], attr)))

    try:
        yield wrap
    finally:
        for (where, attr), fn in saved.items():
            setattr(modules[where], attr, fn)


def _run_pass(batch: int, n_batches: int, names: list[str], bar: Any,
              wrap: Callable[[Any, Any], None] | None = None,
              warmed: Callable[[], None] | None = None) -> float:  # fmt: skip
    """Server CPU per request (us) over the counted batches of one pass; ``warmed()`` is
    called when the warm-up ends."""
    rig = _Rig(batch, wrap)
    names.append(rig.name)
    try:
        skip = int(n_batches * WARMUP)
        total = 0
        for i in range(n_batches):
            if i == skip and warmed is not None:
                warmed()
            spent = rig.one_batch()
            if i >= skip:
                total += spent
            bar.update(1)
        return total / ((n_batches - skip) * batch) / 1e3
    finally:
        rig.close()


def _decoder_call_alone(batch: int, number: int) -> float:
    """What the split's "decoder call" step does (the BiCodec adapter: three ``from_numpy``,
    then the no-op ``detokenize``) for one batch, in a tight loop with warm caches, in us."""
    rng = np.random.default_rng(0)
    semantic = rng.integers(0, 8192, (batch, N_TOKENS))
    glb = rng.integers(0, 4096, (batch, N_GLOBAL))
    lengths = np.full(batch, N_TOKENS, np.int64)
    decoder = _NoopDecoder()

    def call() -> Any:
        return decoder.detokenize(torch.from_numpy(semantic), torch.from_numpy(glb),
                                  torch.from_numpy(lengths))  # fmt: skip

    with torch.inference_mode():
        return min(timeit.repeat(call, number=number, repeat=5)) / number * 1e6


def bench(batches: tuple[int, ...], requests: int, *, progress: bool = True) -> dict[str, Any]:
    torch.set_num_threads(1)  # as bench_ipc.py's no-op server
    names: list[str] = []
    plan = {b: max(20, requests // b) for b in batches}
    rows: dict[str, Any] = {}
    with tqdm(total=2 * sum(plan.values()), desc="server CPU", unit="batch", disable=not progress,
              file=sys.stderr, dynamic_ncols=True) as bar:  # fmt: skip
        for b in batches:
            bar.set_description(f"batch {b}: total")
            total = _run_pass(b, plan[b], names, bar)
            spent: dict[str, int] = {}
            bar.set_description(f"batch {b}: split")
            with _timers(spent) as wrap:
                timed_total = _run_pass(b, plan[b], names, bar, wrap, warmed=spent.clear)
            counted = (plan[b] - int(plan[b] * WARMUP)) * b
            split = {label: spent.get(label, 0) / counted / 1e3 for label, *_ in STEPS}
            rows[str(b)] = {
                "batch": b,
                "batches": plan[b],
                "server_cpu_us": total,
                "server_cpu_us_with_timers": timed_total,
                "split_us": split,
                "decoder_call_alone_warm_us": _decoder_call_alone(b, 500) / b,
            }
    left = [n for n in names if leftover_objects(n)]
    return {"benchmark": "bench_server_cpu", "rows": rows, "shm_names": names, "left_in_dev_shm": left}


def format_table(result: dict[str, Any]) -> str:
    rows = result["rows"]
    batches = list(rows)
    head = ["server CPU per request (us), no IPC waits", *(f"batch {b}" for b in batches)]
    body = [["total (plain pass)", *(f"{rows[b]['server_cpu_us']:.1f}" for b in batches)],
            ["total (with the timers below)",
             *(f"{rows[b]['server_cpu_us_with_timers']:.1f}" for b in batches)]]  # fmt: skip
    for label, depth, *_ in STEPS:
        body.append(["  " * (depth + 1) + label, *(f"{rows[b]['split_us'][label]:.1f}" for b in batches)])
    body.append(["decoder call alone, warm (tight loop)",
                 *(f"{rows[b]['decoder_call_alone_warm_us']:.1f}" for b in batches)])  # fmt: skip
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in [head, *body]]  # fmt: skip
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default=",".join(map(str, DEFAULT_BATCHES)),
                   help="batch sizes, comma-separated (default: %(default)s)")  # fmt: skip
    p.add_argument("--requests", type=int, default=REQUESTS, help="requests per batch size and pass")
    p.add_argument("--quick", action="store_true", help="a few hundred requests: a smoke check")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out",
                                                  "bench_server_cpu.json"))  # fmt: skip
    args = p.parse_args(argv)
    batches = tuple(int(b) for b in args.batches.split(","))
    if any(b < 1 for b in batches):
        p.error("--batches: every batch size must be >= 1")
    t0 = time.perf_counter()
    result = bench(batches, 200 if args.quick else args.requests, progress=not args.no_progress)
    result["elapsed_s"] = time.perf_counter() - t0
    result["timestamp"] = datetime.datetime.now(datetime.timezone.utc).isoformat()
    result["environment"] = {"python": platform.python_version(), "platform": platform.platform(),
                             "cpu_count": os.cpu_count(), "loadavg": os.getloadavg(),
                             "torch": torch.__version__, "numpy": np.__version__}  # fmt: skip
    print(format_table(result))
    print("the same no-op decoder and one lane as bench_ipc.py's server; see its rows for the "
          "CPU the wake-ups between processes add")  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.json}")
    if result["left_in_dev_shm"]:
        print(f"left in /dev/shm: {result['left_in_dev_shm']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
