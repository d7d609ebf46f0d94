"""The decode loop: wait → gather → batch → decode → write back → signal; reaping; stats.

One ``DecoderServer`` owns one segment (``transport.Segment``) and one decoder. It is single
threaded on purpose: between two batches nothing else touches the slot table from the server
side, so the reaper can never reclaim a slot whose result is being written.
"""

from __future__ import annotations

import logging
import secrets
import signal
import threading
import time
from typing import Any, Protocol

import numpy as np
import posix_ipc
import torch

from .batching import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_BATCH_TOKENS,
    DEFAULT_MAX_WAIT_MS,
    Pending,
    plan_batch,
    split_in_half,
)
from .errors import SegmentError, ServerAlreadyRunningError, ServerUnavailableError
from .transport import (
    BUSY,
    C_BATCHES,
    C_DECODE,
    C_FAILED,
    C_PADDED,
    C_QUEUE_WAIT,
    C_RECLAIMED,
    C_REQUESTS,
    C_TOKENS,
    DEFAULT_MAX_TOKENS,
    DEFAULT_MODE,
    DEFAULT_SLOTS,
    DONE,
    ERROR_TEXT_BYTES,
    FREE,
    HIST_BINS,
    HOP,
    MAGIC,
    N_GLOBAL,
    READY,
    SLOT_DT,
    OutputDtype,
    Segment,
    Status,
    drain,
    header_server_alive,
    read_header,
    unlink_all,
    validate_name,
)

log = logging.getLogger("bicodec_shm.server")

_OUTPUT_DTYPES = frozenset(int(d) for d in OutputDtype)
_FLOAT32 = int(OutputDtype.FLOAT32)
_SLOT_FIELDS = SLOT_DT.names

DEFAULT_REAP_INTERVAL = 0.25  # seconds; a dead client's slots come back within about this


class Detokenizer(Protocol):
    """What the server needs from a decoder (``BiCodecDecoder`` or a test double)."""

    def detokenize(
        self, semantic_ids: torch.Tensor, global_ids: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """(B, T) long, (B, 32) long, (B,) long -> (B, 320·T) float."""
        ...


class DecoderServer:
    """Serve ``decoder`` to every client process that attaches to ``name``.

    Args:
        decoder: any object with ``detokenize(semantic_ids, global_ids, lengths)``; its
            ``device`` (or its first parameter's device) decides where batches go.
        name: the segment name (letters, digits, ``_``, ``-``).
        slots: number of request slots shared by all clients.
        max_batch: most rows in one forward pass.
        max_wait_ms: how long a batch may wait to grow once the model is idle (0: go at once).
        max_batch_tokens: padded-token budget per batch (rows × longest length).
        max_tokens: longest request accepted (1500 tokens = 30 s).
        mode: permission bits of every object (0o600: this user only; 0o660: also the group).
        reap_interval: seconds between scans for slots of dead clients.
    """

    # Class-level defaults keep close() safe after a failed __init__.
    _segment: Segment | None = None

    def __init__(
        self,
        decoder: Detokenizer,
        name: str,
        *,
        slots: int = DEFAULT_SLOTS,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_wait_ms: float = DEFAULT_MAX_WAIT_MS,
        max_batch_tokens: int | None = DEFAULT_MAX_BATCH_TOKENS,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        mode: int = DEFAULT_MODE,
        reap_interval: float = DEFAULT_REAP_INTERVAL,
    ) -> None:
        validate_name(name)
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        if max_batch_tokens is not None and max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1 or None, got {max_batch_tokens}")
        self.decoder = decoder
        self.name = name
        self.max_batch = max_batch
        self.max_wait_ms = max_wait_ms
        self.max_batch_tokens = max_batch_tokens
        self.reap_interval = reap_interval
        self.device = _device_of(decoder)
        if self.device.type == "cuda":
            # cuDNN convolutions default to TF32, whose rounding differs between batch shapes:
            # batched rows would no longer equal their lone decodes to float32 precision.
            torch.backends.cudnn.allow_tf32 = False
            torch.backends.cuda.matmul.allow_tf32 = False
        config = getattr(decoder, "config", None)
        self.semantic_vocab = int(getattr(config, "semantic_vocab", 8192))
        self.global_vocab = int(getattr(config, "global_vocab", 4096))
        self._stop = threading.Event()
        self._segment = _create_or_take_over(
            name,
            n_slots=slots,
            max_tokens=max_tokens,
            mode=mode,
            semantic_vocab=self.semantic_vocab,
            global_vocab=self.global_vocab,
            max_batch=max_batch,
        )
        header = self._segment.header
        header["server_epoch"] = secrets.randbits(63)
        header["serving"] = 1
        log.info(
            "serving %r: %d slots, max_tokens=%d, max_batch=%d, max_wait_ms=%g, "
            "max_batch_tokens=%s, device=%s, mode=%o, segment %.1f MiB",
            name, slots, max_tokens, max_batch, max_wait_ms, max_batch_tokens, self.device,
            mode, self._segment.layout.total_size / 2**20,
        )  # fmt: skip

    @property
    def segment(self) -> Segment:
        if self._segment is None:
            raise ServerUnavailableError(f"server {self.name!r} is closed")
        return self._segment

    # -- main loop ----------------------------------------------------------------------

    def serve_forever(self) -> None:
        """Serve until ``stop()``, SIGINT or SIGTERM; then unlink everything."""
        restore = self._install_signal_handlers()
        seg = self.segment
        next_reap = time.monotonic()
        try:
            while not self._stop.is_set():
                woke = self._wait(self.reap_interval)
                if time.monotonic() >= next_reap:
                    self.reap()
                    next_reap = time.monotonic() + self.reap_interval
                if not self._stop.is_set():
                    self._serve_ready(seg, woke)
        finally:
            restore()
            self.close()

    def start_thread(self) -> threading.Thread:
        """Run ``serve_forever`` in a daemon thread (for in-process use and tests)."""
        thread = threading.Thread(target=self.serve_forever, name=f"bicodec-shm:{self.name}")
        thread.daemon = True
        thread.start()
        return thread

    def stop(self) -> None:
        """Ask the loop to finish its current batch and exit (safe from any thread)."""
        self._stop.set()
        seg = self._segment
        if seg is not None and seg.ready is not None:
            try:
                seg.ready.release()  # wake the loop now rather than at the next reap tick
            except posix_ipc.Error:
                pass

    def close(self) -> None:
        """Mark the segment as no longer served, then unlink and unmap it."""
        seg, self._segment = self._segment, None
        if seg is None:
            return
        try:
            seg.header["serving"] = 0
            self._fail_pending(seg, "the server stopped before decoding this request")
        finally:
            seg.close()
            seg.unlink()
            log.info("stopped %r and unlinked its shared memory", self.name)

    def __enter__(self) -> DecoderServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<DecoderServer {self.name!r} device={self.device} max_batch={self.max_batch}>"

    # -- gathering ------------------------------------------------------------------------

    def _wait(self, timeout: float) -> bool:
        """Block on the ready doorbell; True if a post was consumed."""
        try:
            self.segment.ready.acquire(timeout)
            return True
        except posix_ipc.BusyError:
            return False
        except posix_ipc.SignalError:
            return False  # a signal handler ran; the loop re-checks _stop

    def _ready_slots(self, seg: Segment) -> list[Pending]:
        states = seg.field["state"]
        if (states > DONE).any():
            for slot in (states > DONE).nonzero()[0].tolist():
                self._finish(seg, slot, Status.BAD_STATE, 0,
                             f"slot {slot} has unknown state value {int(states[slot])}")  # fmt: skip
        idx = (states == READY).nonzero()[0]
        if len(idx) == 0:
            return []
        lengths = seg.field["n_tokens"][idx].tolist()
        submitted = seg.field["t_submit_ns"][idx].tolist()
        return [Pending(s, n, t) for s, n, t in zip(idx.tolist(), lengths, submitted)]

    def _serve_ready(self, seg: Segment, woke: bool) -> None:
        ready = self._ready_slots(seg)
        if not ready:
            return
        posts = int(woke)  # doorbell posts consumed so far in this round
        if self.max_wait_ms > 0 and len(ready) < self.max_batch:
            ready, posts = self._let_batch_grow(seg, ready, posts)
        ready = [p for p in ready if self._admit(seg, p)]
        if not ready:
            return
        batch = plan_batch(ready, max_batch=self.max_batch, max_batch_tokens=self.max_batch_tokens)
        self._balance_posts(len(batch) - posts)
        now = time.monotonic_ns()
        state, started = seg.field["state"], seg.field["t_start_ns"]
        for p in batch:
            state[p.slot] = BUSY
            started[p.slot] = now
        self._decode_rows(seg, batch)

    def _let_batch_grow(self, seg: Segment, ready: list[Pending], posts: int) -> tuple[list[Pending], int]:
        """Wait up to max_wait_ms for more requests, sleeping on the doorbell (never spinning)."""
        deadline = time.monotonic() + self.max_wait_ms / 1000
        while len(ready) < self.max_batch and not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            posts += self._wait(left)
            ready = self._ready_slots(seg)
        return ready, posts

    def _balance_posts(self, n: int) -> None:
        """Keep one doorbell post per READY slot left waiting.

        n > 0: take the posts of slots just batched, without blocking (a post that has not
        arrived yet, because its client was preempted between READY and sem_post, only causes
        one extra, empty wake-up later). n < 0: this round consumed posts of slots that did not
        fit in the batch; give them back so that the next round starts at once.
        """
        ready = self.segment.ready
        for _ in range(-n):
            ready.release()
        for _ in range(n):
            try:
                ready.acquire(0)
            except posix_ipc.BusyError:
                break

    def _admit(self, seg: Segment, p: Pending) -> bool:
        """Validate a READY slot read from shared memory; fail it alone if it is corrupt."""
        problem = self._check_slot(seg, p.slot)
        if problem is None:
            return True
        status, message = problem
        self._finish(seg, p.slot, status, 0, message)
        return False

    def _check_slot(self, seg: Segment, slot: int) -> tuple[Status, str] | None:
        # One read of the whole slot header (a tuple), not one numpy access per field.
        s = dict(zip(_SLOT_FIELDS, seg.slots[slot].item()))
        n, max_tokens = s["n_tokens"], seg.layout.max_tokens
        if not 1 <= n <= max_tokens:
            return Status.BAD_LENGTH, f"semantic length {n} is outside 1..{max_tokens}"
        if s["n_global"] != N_GLOBAL:
            return Status.BAD_GLOBAL, f"{s['n_global']} global ids, expected {N_GLOBAL}"
        if s["dtype"] not in _OUTPUT_DTYPES:
            return Status.BAD_DTYPE, f"unknown output dtype code {s['dtype']}"
        if s["req_generation"] != s["generation"]:
            return Status.STALE_GENERATION, (
                f"request names slot generation {s['req_generation']} but the slot is at "
                f"{s['generation']} (it was reclaimed)"
            )
        bad = _first_out_of_range(seg.tokens[slot, :n], self.semantic_vocab)
        if bad is not None:
            return Status.BAD_SEMANTIC_ID, (
                f"semantic id {bad[1]} at position {bad[0]} is outside 0..{self.semantic_vocab - 1}"
            )
        bad = _first_out_of_range(seg.globals[slot], self.global_vocab)
        if bad is not None:
            return Status.BAD_GLOBAL, (
                f"global id {bad[1]} at position {bad[0]} is outside 0..{self.global_vocab - 1}"
            )
        return None

    # -- decoding -------------------------------------------------------------------------

    def _decode_rows(self, seg: Segment, rows: list[Pending]) -> None:
        """Decode ``rows`` as one batch; on failure split in halves and retry each."""
        t0 = time.perf_counter_ns()
        try:
            audio = self._run_decoder(seg, rows)
        except Exception as exc:  # any model failure must fail requests, not the server
            _release_accelerator_memory(self.device)
            if len(rows) == 1:
                cause = f"{type(exc).__name__}: {exc}"
                log.warning("decode of slot %d failed: %s", rows[0].slot, cause)
                self._finish(seg, rows[0].slot, Status.DECODE_FAILED, 0, f"decode failed: {cause}")
                return
            log.warning("batch of %d failed (%s); splitting and retrying", len(rows), exc)
            for half in split_in_half(rows):
                self._decode_rows(seg, half)
            return
        elapsed = time.perf_counter_ns() - t0
        self._count_batch(seg, rows, elapsed)
        for j, p in enumerate(rows):
            self._write_pcm(seg, p, audio[j])

    def _run_decoder(self, seg: Segment, rows: list[Pending]) -> np.ndarray:
        """One padded batch through the model; returns (B, 320·T) float32 on the host."""
        longest = rows[0].length
        if len(rows) == 1:  # the common case at low load: no padding buffer needed
            semantic = seg.tokens[rows[0].slot, :longest][None]
            global_ids = seg.globals[rows[0].slot][None]
        else:
            semantic = np.zeros((len(rows), longest), np.int32)
            for j, p in enumerate(rows):
                semantic[j, : p.length] = seg.tokens[p.slot, : p.length]
            global_ids = seg.globals[[p.slot for p in rows]]
        # One host->device copy per tensor per batch (widened to int64 on the way), and one
        # device->host copy back.
        out = self.decoder.detokenize(
            torch.from_numpy(semantic).to(self.device, torch.long),
            torch.from_numpy(global_ids).to(self.device, torch.long),
            torch.tensor([p.length for p in rows], dtype=torch.long, device=self.device),
        )
        audio = out.detach().to("cpu", torch.float32).numpy()
        if audio.ndim != 2 or audio.shape[0] != len(rows) or audio.shape[1] < longest * HOP:
            raise RuntimeError(
                f"decoder returned shape {tuple(audio.shape)}, expected ({len(rows)}, {longest * HOP})"
            )
        return audio

    def _write_pcm(self, seg: Segment, p: Pending, row: np.ndarray) -> None:
        n = p.length * HOP
        if seg.field["dtype"][p.slot] == _FLOAT32:
            seg.pcm_float32(p.slot, n)[:] = row[:n]
        else:
            # The seed's exact conversion: clip, scale by 32767 in float32, truncate to int16.
            # In place: ``row`` is this batch's private host copy.
            scaled = row[:n]
            np.clip(scaled, -1.0, 1.0, out=scaled)
            scaled *= np.float32(32767)
            np.copyto(seg.pcm_int16(p.slot, n), scaled, casting="unsafe")
        self._finish(seg, p.slot, Status.OK, n)

    def _finish(self, seg: Segment, slot: int, status: int, n_samples: int, error: str = "") -> None:
        """Publish a slot's result and ring its owner's doorbell."""
        f = seg.field
        notify = int(f["notify"][slot])
        if notify >= seg.layout.n_slots:
            status, error, n_samples = Status.BAD_NOTIFY, f"notify index {notify} out of range", 0
            notify = slot
        f["status"][slot] = status
        f["n_samples"][slot] = n_samples
        if error or f["error"][slot]:
            f["error"][slot] = error.encode("utf-8")[:ERROR_TEXT_BYTES]
        f["result_seq"][slot] = f["request_seq"][slot]
        f["t_done_ns"][slot] = time.monotonic_ns()
        seg.counters[C_REQUESTS] += 1
        if status != Status.OK:
            seg.counters[C_FAILED] += 1
        # Order matters: result fields above, then the state word, then the post, so that the
        # owner never sees DONE with a half-written result.
        f["state"][slot] = DONE
        seg.done[notify].release()

    def _count_batch(self, seg: Segment, rows: list[Pending], elapsed_ns: int) -> None:
        c = seg.counters
        c[C_BATCHES] += 1
        c[C_TOKENS] += sum(p.length for p in rows)
        c[C_PADDED] += len(rows) * rows[0].length
        c[C_DECODE] += elapsed_ns
        started = int(seg.field["t_start_ns"][rows[0].slot])  # the same for the whole batch
        c[C_QUEUE_WAIT] += sum(max(0, started - p.submitted_ns) for p in rows)
        seg.header["batch_hist"][min(len(rows), HIST_BINS - 1)] += 1

    def _fail_pending(self, seg: Segment, message: str) -> None:
        """On a clean stop, answer every queued request rather than leave it to time out."""
        for slot in (seg.field["state"] == READY).nonzero()[0].tolist():
            self._finish(seg, slot, Status.DECODE_FAILED, 0, message)

    # -- reaping ----------------------------------------------------------------------------

    def reap(self) -> int:
        """Reclaim slots whose owner died; returns how many were reclaimed.

        A live owner holds its slot's OFD lock for as long as it owns the slot. If the server
        can take that lock, the owner is gone (the kernel dropped the lock when it died).
        """
        seg = self.segment
        f = seg.field
        reclaimed = 0
        for slot in (f["state"] != FREE).nonzero()[0].tolist():
            if not seg.try_lock_slot(slot):
                continue  # owner alive
            try:
                f["generation"][slot] += 1  # a late result can never match the next owner
                f["owner_pid"][slot] = 0
                f["state"][slot] = FREE
                drain(seg.done[slot])
                reclaimed += 1
            finally:
                seg.unlock_slot(slot)
        if reclaimed:
            seg.counters[C_RECLAIMED] += reclaimed
            log.info("reclaimed %d slot(s) of dead clients", reclaimed)
        return reclaimed

    # -- signals ----------------------------------------------------------------------------

    def _install_signal_handlers(self) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

        def handler(signum: int, frame: object) -> None:
            log.info("received %s, stopping", signal.Signals(signum).name)
            self.stop()

        for sig in previous:
            signal.signal(sig, handler)

        def restore() -> None:
            for sig, old in previous.items():
                signal.signal(sig, old)

        return restore


def _create_or_take_over(name: str, **kwargs: Any) -> Segment:
    """Create the segment; if the name is taken by a dead server's leftovers, take it over."""
    try:
        return Segment.create(name, **kwargs)
    except posix_ipc.ExistentialError:
        pass
    header = read_header(name)
    if header is not None:
        pid = int(header["server_pid"])
        if header_server_alive(header):
            raise ServerAlreadyRunningError(
                f"a bicodec-shm server (pid {pid}) is already serving {name!r}; stop it first "
                "or choose another --name"
            )
        if int(header["magic"]) not in (0, MAGIC):
            raise SegmentError(
                f"/dev/shm/{name} exists and is not a bicodec-shm segment; refusing to remove it"
            )
        log.warning("taking over %r, left behind by dead server pid %d", name, pid)
        unlink_all(name, int(header["n_slots"]) or None)
    else:
        unlink_all(name)  # stale semaphores without a segment
    return Segment.create(name, **kwargs)


def _first_out_of_range(ids: np.ndarray, vocab: int) -> tuple[int, int] | None:
    if len(ids) == 0 or (ids.min() >= 0 and ids.max() < vocab):
        return None  # the common case, without allocating a mask
    bad = np.flatnonzero((ids < 0) | (ids >= vocab))
    if len(bad) == 0:
        return None
    return int(bad[0]), int(ids[bad[0]])


def _device_of(decoder: object) -> torch.device:
    device = getattr(decoder, "device", None)
    if device is not None:
        return torch.device(device)
    parameters = getattr(decoder, "parameters", None)
    if callable(parameters):
        for p in parameters():
            return p.device
    return torch.device("cpu")


def _release_accelerator_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()  # after an OOM, so that the halves of a split batch can fit
