"""One client attachment to one server incarnation: slots claimed on demand, requests, results.

numpy and posix_ipc only. ``DecoderClient`` (client/decoder_client.py) holds one ``Attachment`` at a time and
replaces it whole when its server goes away; everything here belongs to one segment and dies
with it. See layout.py for the layout and the identity rule, and segment.py for the slot states and
the memory-ordering rule.

- **Slots on demand.** A request takes an idle slot of this attachment, else claims a FREE slot
  of the segment (up to ``max_slots``), else waits in line (slot_waits.py): a slot given back
  goes straight to the oldest live waiter, and nobody claims ahead of it. The OFD lock on a
  claimed slot is its ownership; the kernel drops it if we die. A claim bumps the slot's claim
  epoch. When the attachment's last request finishes, every slot goes back to the segment but
  one *warm* slot, which stays CLAIMED with its lock dropped and its ``owner_pid`` 0: the next
  request re-takes its lock if nobody touched it (same claim epoch), which is cheaper than a
  claim and lets the server's rejoin window wait for us; and the server's reaper frees it
  (counting an idle expiry, not a reclaim) at its next tick otherwise, or at once when a
  claimer finds no FREE slot and says so (the header's ``slot_wanted``, then a ``ready`` post).
  So an idle handle holds no slot for longer than a reap interval, and idle workers never keep
  a new one out, nor make it wait for the tick. A busy handle (callers always in line) is never
  quiescent: once another handle has said it found no FREE slot, ``give`` sends the next slot
  back to the segment instead of to our line, so busy workers never keep a new one out either.
- **A request is ``(slot, seq)``**: ``take_slot`` hands out both, and every later step (give
  back, let go, the answer's identity check) names both, so a step repeated by an interrupted
  caller can never touch the next request on the same slot.
- **Synchronous requests** wait on their slot's own ``done`` semaphore (through semwait.py, so
  a signal handler's exception reaches the caller).
- **asyncio requests** ask the server to ring this attachment's *bell* besides ``done``: one
  waiter thread per attachment resolves their futures (async_answers.py).
- **Letting go.** A request nobody waits for any more (its timeout, a cancelled coroutine,
  Ctrl-C, an exception from a signal handler) *lets go* of its slot: it drops the slot's lock
  and forgets it. The server's reaper frees the slot once no batch holds it, after the
  server's last write and post to it. A client frees a slot itself only in state CLAIMED.
- **Threads and interruptions.** Threads share one attachment, and so one lock descriptor: a
  slot lock that one thread holds, another thread of ours "takes" again at once. So every step
  that drops a slot's lock (giving slots back, letting go of the warm slot or of a request's)
  runs under the claim lock, like every claim. An exception from a signal handler may land between any two
  bytecodes of the main thread: every step records first what it is about to do to a lock
  (``loose``: slots whose lock may be ours that no request owns), so that whatever an
  interruption leaves, ``abandon`` (the caller's cleanup) and the next claim finish
  (``_settle``); a request is numbered before its caller's ``try``, so its cleanup always knows
  what to look for.
- **Retiring.** When the server goes away, or the handle closes, ``retire`` fails every waiter
  and pending future at once. The segment is unmapped when the last thread using it leaves:
  every use of the mapping or its semaphores happens inside ``use()``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import os
import random
import secrets
import threading
import time
import weakref
from collections.abc import Iterator, Sequence

import numpy as np
import posix_ipc

from ..codecs.audio import EncodedAudio
from ..codecs.layout import DEFAULT_NOISE_SEED
from ..errors import BiCodecShmError, DecodeError, DecodeTimeoutError, NoEncoderError, ServerUnavailableError
from .async_answers import AsyncAnswers, resolve
from .layout import CLAIMED, DONE, FLAG_ENCODE, FREE, MAX_DUE_IN_US, READY, OutputDtype, Phase, Status
from .posts import drain, post
from .segment import Segment
from .slot_waits import SlotWaits
from .waiting import SLICE, Gone, Line, Wakeups

_FLOAT32 = int(OutputDtype.FLOAT32)


class _User:
    """A token for one ``Attachment.use()`` in progress (weakly referenced)."""

    __slots__ = ("__weakref__",)


class Attachment(AsyncAnswers, SlotWaits):
    """The mapped segment of one server incarnation and what this process owns in it.

    Args:
        name: the server's segment name.
        max_slots: most slots this attachment may own at once (its request concurrency).
        owner_uid: the uid that must own the segment (None: our own euid).
    """

    segment: Segment | None = None

    def __init__(self, name: str, *, max_slots: int, owner_uid: int | None) -> None:
        self.segment = Segment.attach(name, owner_uid=owner_uid)
        # Limits the client validates against: from the copy of the header that attaching
        # checked (its digest), never read again from the header, which any client may write.
        layout = self.segment.layout
        self.codec = layout.codec  # the served codec's token layout (codecs.CodecLayout)
        self.semantic_vocab = self.codec.level_vocab[0]
        self.global_vocab = self.codec.global_vocab
        self.max_tokens = layout.max_tokens
        self.encode_min_samples, self.max_audio_samples = layout.encode_min_samples, layout.max_audio_samples
        self.n_slots = layout.n_slots
        self.name = name
        self.max_slots = max_slots
        self.handle_id = secrets.randbits(63)
        self.seq = itertools.count(1)
        self.lock = threading.Lock()
        self.changed = Wakeups()  # the last user of a retired attachment left (under ``lock``)
        self.line = Line()  # requests waiting for a slot of ours, oldest first (under ``lock``)
        self.owned: set[int] = set()  # slots whose lock we hold, each in use or idle
        self.idle: list[int] = []  # a hint: owned slots not in use, the most recently used last
        self.warm: tuple[int, int] | None = None  # (slot, claim epoch) let go of while warm
        self.using: dict[int, int] = {}  # slot -> seq of the request that has it
        # Slots whose lock may be ours that no request owns: a step that takes or drops a lock
        # records the slot here first and forgets it last (``_settle``).
        self.loose: set[int] = set()
        self.claimers: set[int] = set()  # requests (seq) between deciding to claim and done
        # One claim, or one drop of a slot lock, at a time: see the module docstring.
        self.claim_lock = threading.Lock()
        self.generation: dict[int, int] = {}  # slot -> the claim epoch we own it at
        # ``slot_wanted`` values: those our own claimers stored, and the last one we gave a
        # slot back for (``give``), so that each request for a slot costs us one slot at most.
        self.asked: collections.deque[int] = collections.deque(maxlen=16)
        self.answered_want = 0
        self.pending: dict[int, tuple[int, asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self.bell: int | None = None
        self.waiter: threading.Thread | None = None
        # One token per use() in progress: the mapping must outlive them. Weak: a use() whose
        # cleanup an exception cut short still leaves once its frame is gone.
        self.users: weakref.WeakSet[_User] = weakref.WeakSet()
        self.retired: BaseException | None = None  # why this attachment takes no more work
        self.stopped_cleanly = False  # the server stopped on purpose (not a crash)
        self.unmapped = False

    @property
    def in_use(self) -> int:
        return len(self.using)

    @property
    def claiming(self) -> int:
        return len(self.claimers)

    def new_seq(self) -> int:
        """The number of a new request: taken before the caller's ``try``, so that its cleanup
        (``abandon``) can find whatever the request came to hold."""
        return next(self.seq)

    # -- using the mapping safely --------------------------------------------------------

    @contextlib.contextmanager
    def use(self) -> Iterator[Segment]:
        """Hold the mapping for the duration of the block; raise if the attachment retired."""
        token = _User()  # added and discarded in one step each, inside the try: an exception
        try:  # anywhere in between (a signal handler's) cannot leave a user counted for ever
            with self.lock:
                if self.retired is not None:
                    raise self._retired_error()
                self.users.add(token)
            try:
                yield self.segment  # type: ignore[misc]
            except posix_ipc.Error as exc:
                # A semaphore vanished or was closed under us: the server went away.
                raise Gone() from exc
            except ServerUnavailableError as exc:  # raised by Segment when it finds the server gone
                raise Gone() from exc
        finally:
            with self.lock:
                self.users.discard(token)
                last = not self.users and self.retired is not None
                if last:
                    self.changed.notify_all()
            if last:
                self._unmap()

    def _retired_error(self) -> BaseException:
        """A fresh exception for each caller (one instance raised in several threads would
        share, and garble, its traceback)."""
        reason = self.retired
        return Gone() if reason is None or isinstance(reason, Gone) else type(reason)(str(reason))

    def serving(self) -> bool:
        seg = self.segment
        return seg is not None and not self.unmapped and seg.serving()

    def server_phase(self) -> int | None:
        """The server's phase from the header (a hint, read without pairing), or None."""
        seg = self.segment
        try:
            return None if seg is None or seg.header is None else int(seg.header["phase"])
        except (TypeError, ValueError):
            return None

    def check_alive(self) -> None:
        """Raise ``Gone`` (and retire) if the server no longer serves."""
        if not self.serving():
            self.retire_gone()
            raise Gone()

    def retire_gone(self) -> None:
        """Retire because the server stopped serving; note whether it stopped on purpose."""
        phase = self.server_phase()
        self.stopped_cleanly = phase is not None and phase >= Phase.STOPPING
        self.retire(Gone())

    # -- slots -------------------------------------------------------------------------------

    def _sleep(self, waiter: threading.Lock, timeout: float) -> None:
        """Sleep on ``waiter`` (from ``changed.add()``) until woken or ``timeout``; outside the
        attachment's lock (see ``Wakeups``)."""
        try:
            waiter.acquire(timeout=timeout)
        finally:
            with self.lock:
                self.changed.discard(waiter)

    def _take_or_claim(self, seq: int, deadline: float,
                       loop: asyncio.AbstractEventLoop | None) -> tuple[int | None, bool]:  # fmt: skip
        """The slot handed to request ``seq`` in line, else an idle slot of ours, else a FREE
        slot of the segment if our limit allows one and nobody is in line before it. Returns
        (the slot or None, whether a claim was tried): with None, the request is in line
        (``loop``: its event loop, None for a thread) and waits to be handed a slot or to come
        first, or (a claim was tried) for the segment to have a FREE slot."""
        slot, may_claim = self._take_local(seq, deadline, loop)
        if slot is None and may_claim:
            slot = self._claim_or_none(seq)
            if slot is None:
                with self.lock:  # in line from now on: whoever comes later waits behind it
                    self.line.join(seq, deadline, loop)
        if slot is not None:
            self._leave_line(seq, passing_on=False)
        return slot, may_claim

    def _take_local(self, seq: int, deadline: float,
                    loop: asyncio.AbstractEventLoop | None) -> tuple[int | None, bool]:  # fmt: skip
        with self.lock:
            if self.retired is not None:
                raise self._retired_error()
            waiter = self.line.get(seq)
            if waiter is not None:
                waiter.rearm()  # before looking: a wake-up from here on is not lost
                for slot, holder in self.using.items():
                    if holder == seq:
                        return slot, False  # handed to us by ``give``
            # Idle means owned and not in use; the list only remembers which was used last (an
            # interruption may leave an entry stale, or a slot out of it). A slot is idle only
            # while nobody is in line: ``give`` hands it to the oldest waiter instead.
            while self.idle:
                slot = self.idle.pop()
                if slot in self.owned and slot not in self.using:
                    self.using[slot] = seq  # one store: the slot is this request's
                    return slot, False
            spare = self.owned.difference(self.using)
            if spare:
                slot = spare.pop()
                self.using[slot] = seq
                return slot, False
            first = self.line.first(self.using)
            may_claim = len(self.owned) + len(self.claimers) < self.max_slots
            if may_claim and (first is None or first is waiter):  # nobody in line before us
                self.claimers.add(seq)  # undone by _claim_or_none, or by abandon(seq)
                return None, True
            self.line.join(seq, deadline, loop)
            return None, False

    def _claim_or_none(self, seq: int) -> int | None:
        """Claim one FREE slot of the segment (lock first, then re-check) for request ``seq``;
        None if none.

        Under the claim lock: the slot locks exclude other processes (other open file
        descriptions), not the threads that share ours. A second thread would "take" a lock we
        already hold, and its unlock would drop ours.
        """
        try:
            with self.claim_lock, self.use() as seg:
                self._settle(seg)
                if self.warm is not None:
                    slot = self._rewarm(seg, seq)
                    if slot is not None:
                        return slot
                states = seg.field["state"]
                free = np.flatnonzero(states == FREE)  # a hint: the lock decides
                if len(free):
                    start = random.randrange(len(free))  # spread claimers over the table
                    for slot in np.roll(free, -start).tolist():
                        if slot in self.owned or slot in self.loose:
                            continue  # ours already (a FREE written over it): our lock would "succeed"
                        self.loose.add(slot)  # first: from here its lock may be ours
                        if not seg.try_lock_slot(slot):
                            self.loose.discard(slot)
                            continue
                        if states[slot] != FREE:  # a claim or a reap raced us
                            seg.unlock_slot(slot)
                            self.loose.discard(slot)
                            continue
                        self._own(seg, slot, seq)
                        return slot
                return None
        finally:
            with self.lock:
                self.claimers.discard(seq)

    def _own(self, seg: Segment, slot: int, seq: int) -> None:
        """Make a FREE slot whose lock we just took (it is in ``loose``) request ``seq``'s
        (transition 1). Interrupted anywhere, the slot is still in ``loose``: ``_settle``
        frees it if it got as far as CLAIMED, and unlocks it otherwise."""
        # Stale posts of an earlier owner's life should not wake our first request (a bounded
        # drain: a flood of posts must not keep us here under the claim lock; any post left,
        # or coming late, names an earlier claim epoch or request: it is skipped).
        drain(seg.done(slot))
        drain(seg.req(slot))
        f = seg.field
        # A new claim epoch: we hold the lock, nobody else writes it (a buggy client may have
        # left any value there: it wraps, as the reaper's in-place bump does).
        gen = (int(f["generation"][slot]) + 1) % 2**64
        self.generation[slot] = gen  # remembered before it is written: _settle knows our epoch
        f["generation"][slot] = gen
        f["owner_pid"][slot] = os.getpid()
        f["handle_id"][slot] = self.handle_id
        f["state"][slot] = CLAIMED
        self._book(slot, seq)

    def _book(self, slot: int, seq: int) -> None:
        """A slot whose lock we hold (in ``loose``) becomes request ``seq``'s. In this order,
        so that every prefix is a state the others read right: owned (idle, as ``_take_local``
        sees it, until the next store), in use by ``seq``, out of ``loose``."""
        with self.lock:
            self.owned.add(slot)
            self.using[slot] = seq
            self.loose.discard(slot)

    def _settle(self, seg: Segment) -> None:
        """Finish what an interrupted step left: each slot in ``loose`` ends up owned, warm
        with its lock dropped, back in the segment (ours and CLAIMED), or with its lock dropped
        (FREE already, or let go of with a request the server may still answer: the reaper
        frees it once the server is done with it). Called with the claim lock held, so that no
        claim, release or let go is half done in another thread: what is in ``loose`` now was
        left by an interruption. Idempotent: a slot leaves ``loose`` only once its lock is
        settled."""
        f = seg.field
        for slot in list(self.loose):
            with self.lock:
                owned = slot in self.owned
                warm = self.warm is not None and self.warm[0] == slot
            if owned:
                pass  # a claim got as far as owning it: an owned slot is its request's
            elif warm:
                seg.unlock_slot(slot)  # letting go of the warm slot was interrupted
            elif seg.try_lock_slot(slot):  # it is ours now, if it was not already
                ours = int(f["generation"][slot]) == self.generation.get(slot)  # our claim epoch
                if int(f["state"][slot]) == CLAIMED and ours:
                    seg.free_slot(slot)  # ours, and no request's: transition 6
                else:
                    seg.unlock_slot(slot)
            self.loose.discard(slot)  # (a lock held by another process is not ours to settle)

    def give(self, slot: int, seq: int) -> None:
        """Request ``seq`` is finished with ``slot`` (state CLAIMED): reuse it, or give it back.

        Once no request of ours is in flight, every slot goes back to the segment (transition
        6): a quiescent handle holds nothing that another process may need. A handle that is
        never quiescent (callers always in line) would keep its slots for ever, so when another
        handle has asked for a slot since we last gave one back (``slot_wanted``), this slot
        goes back to the segment too, and our own line claims again like everyone else."""
        with self.lock:
            if self.retired is not None or self.using.get(slot) != seq:
                return  # retired (the slots go with the attachment), or given back already
            waiter = self.line.first(self.using)
            # Read only with someone in line (the common case costs nothing), and under the
            # lock, not retired: the mapping cannot go before the lock is released.
            wanted = 0 if waiter is None else self._slot_wanted_elsewhere()
            if waiter is not None and not wanted:
                # Straight to the oldest waiter, never idle in between for a newcomer to take.
                self.using[slot] = waiter.seq  # one store: the slot is that request's
                waiter.wake()  # it finds the slot booked to it, and leaves the line with it
                return
            if wanted:
                # Back to the segment. In this order, so that an interruption anywhere leaves a
                # state the caller's cleanup (abandon) finishes: in ``loose`` while its lock is
                # ours, then no request's (owned and idle, should we stop here), then not
                # owned; ``_settle`` frees it (ours, CLAIMED).
                self.answered_want = wanted
                self.loose.add(slot)
                del self.using[slot]
                self.owned.discard(slot)
                quiescent = False
            else:
                del self.using[slot]  # one store: the slot is idle (owned, not in use)
                self.idle.append(slot)
                quiescent = not self.using and not self.claimers
        if wanted:
            self._settle_now()
        elif quiescent:
            self._release()

    def _slot_wanted_elsewhere(self) -> int:
        """The header's ``slot_wanted`` if another handle stored it (it found no FREE slot)
        and we have not given a slot back for it yet; else 0. A hint, read without pairing.
        Called under ``lock`` with the attachment not retired: the segment is mapped."""
        value = int(self.segment.header["slot_wanted"])
        return 0 if value in (0, self.answered_want) or value in self.asked else value

    def _settle_now(self) -> bool:
        """Finish what ``loose`` holds (``_settle``) under the claim lock, as every drop of a
        slot lock runs. False if the attachment retired (its slots go with it)."""
        try:
            with self.claim_lock, self.use() as seg:
                self._settle(seg)
        except (Gone, BiCodecShmError):
            return False
        return True

    def let_go(self, slot: int, seq: int) -> None:
        """Nobody waits for request ``seq`` any more: drop the lock on its slot and forget the
        slot, whatever state it is in. The server's reaper frees it once no batch holds it
        (after the server's last write and post), so it never reaches a next owner early.

        Under the claim lock, like every drop of a slot lock: once the reaper has freed the
        slot, another thread of ours may claim it, and a late unlock through our descriptor
        would drop that thread's lock."""
        with self.claim_lock:
            with self.lock:
                if self.retired is not None or self.using.get(slot) != seq:
                    return
                # In this order: in ``loose`` while its lock may still be ours, then not owned
                # (so never idle to another request), then no request's.
                self.loose.add(slot)
                self.owned.discard(slot)
                del self.using[slot]
                self.line.wake_first(self.using)  # room for a claim: the oldest waiter's
            try:
                with self.use() as seg:
                    seg.unlock_slot(slot)
                    self.loose.discard(slot)
            except (Gone, BiCodecShmError, OSError):
                pass  # retired meanwhile: the lock went with the attachment

    def abandon(self, seq: int) -> None:
        """Request ``seq`` ended with an exception, wherever after ``new_seq`` it came: give back
        or let go of the slot it had (``done_with``), forget it as a claimer or a pending
        asyncio request, and finish any step the exception interrupted (``_settle``).
        Idempotent, so a caller may repeat it."""
        with self.lock:
            self.claimers.discard(seq)
            if self.line.leave(seq):
                self.line.wake_first(self.using)
            for slot, entry in list(self.pending.items()):
                if entry[0] == seq:
                    del self.pending[slot]
            mine = [slot for slot, q in self.using.items() if q == seq]
        for slot in mine:
            self.done_with(slot, seq)
        if not self._settle_now():
            return  # retired: the slots go with the attachment
        with self.lock:
            quiescent = bool(self.owned) and not self.using and not self.claimers
        if quiescent:
            self._release()  # in case the interruption came between a give and its release

    def done_with(self, slot: int, seq: int) -> None:
        """After a failure of request ``seq`` anywhere after ``take_slot``: give the slot back
        if our own writes never made it READY (state CLAIMED: the server has not seen it),
        else let go of it. Idempotent: does nothing once the slot went back."""
        seg = self.segment
        try:
            claimed = seg is not None and not self.unmapped and int(seg.field["state"][slot]) == CLAIMED
        except (KeyError, TypeError, IndexError):
            claimed = False
        if claimed:
            self.give(slot, seq)
        else:
            self.let_go(slot, seq)

    def _release(self) -> None:
        """With no request of ours in flight: free every owned slot (transition 6) but the most
        recently used, which we let go of warm and keep in mind (see the module docstring: the
        reaper frees it unless we come back first, and counts it as expired: its owner_pid is 0).

        Under the claim lock, like a claim: a claim in another thread of ours would "take" again
        a lock we are about to drop (our open file description holds it) and then own a slot
        that nobody has locked. Each slot is in ``loose`` until its lock is dropped."""
        try:
            with self.claim_lock, self.use() as seg:
                with self.lock:
                    if self.using or self.claimers or not self.owned:
                        return  # a request came meanwhile: the slots are its to use
                    recent = list(dict.fromkeys(reversed(self.idle)))[::-1]  # the last used last
                    order = [s for s in self.owned if s not in recent]
                    order += [s for s in recent if s in self.owned]
                    self.loose.update(order)  # first: no longer owned, their locks still ours
                    self.owned.clear()
                    self.idle.clear()
                warm = order.pop()
                for slot in order:
                    seg.free_slot(slot)
                    self.loose.discard(slot)
                # owner_pid 0 marks the slot as let go of warm, for the reaper to count it
                # as an idle expiry rather than a reclaim; written while the lock is still
                # ours (an interruption before ``self.warm`` leaves it for _settle to free).
                seg.field["owner_pid"][warm] = 0
                self.warm = (warm, self.generation[warm])  # before the unlock: see _settle
                seg.unlock_slot(warm)
                self.loose.discard(warm)
        except (Gone, BiCodecShmError):
            pass  # the server went away, or the handle closed: the slots go with the attachment

    def _rewarm(self, seg: Segment, seq: int) -> int | None:
        """Re-take the warm slot for request ``seq`` if it is still as we left it (CLAIMED, same
        claim epoch: the reaper has not freed it, so nobody else has had it); None otherwise.
        Called with the claim lock held."""
        slot, gen = self.warm
        self.loose.add(slot)  # first: from here its lock may be ours
        self.warm = None
        if not seg.try_lock_slot(slot):
            self.loose.discard(slot)
            return None  # the reaper, or a claimer after it, has it now
        f = seg.field
        if int(f["state"][slot]) == CLAIMED and int(f["generation"][slot]) == gen:
            f["owner_pid"][slot] = os.getpid()  # held again (``_release`` zeroed it)
            self._book(slot, seq)
            return slot
        if int(f["state"][slot]) == FREE:
            self._own(seg, slot, seq)  # freed by the reaper meanwhile: an ordinary claim
            return slot
        seg.unlock_slot(slot)
        self.loose.discard(slot)
        return None

    # -- one request ---------------------------------------------------------------------------

    def submit(self, slot: int, seq: int, semantic: np.ndarray | Sequence[np.ndarray],
               global_ids: np.ndarray | None, dtype: int, notify: int, *,
               noise_seed: int = DEFAULT_NOISE_SEED, flags: int = 0,
               start_frame: int = 0, due_at_ns: int = 0,
               audio: np.ndarray | None = None) -> None:  # fmt: skip
        """Write request ``seq`` into ``slot`` and ring the server. ``audio``: an encode
        request's clip (N,) float32, written instead of codes (``semantic`` is then empty).


        ``semantic``: level 0's codes (T,) int32, or every level's codes (validated against
        ``self.codec``); ``global_ids`` (n_global,) int32, or None for a codec without them;
        ``due_at_ns``: the CLOCK_MONOTONIC time its audio is due (0: due now), written as the
        microseconds left at this submit: a request that waited for a slot, or is resubmitted
        to a restarted server, is due that much sooner."""
        with self.use() as seg:
            f, n_audio = seg.field, 0 if audio is None else audio.shape[0]
            if audio is not None:  # payload first: the clip, and the frames it spans ...
                seg.pcm32[slot, :n_audio] = audio
                n, flags = -(-n_audio // seg.codec.samples_per_frame), flags | FLAG_ENCODE
            else:  # ... or the codes
                levels = [semantic] if isinstance(semantic, np.ndarray) else semantic
                n = levels[0].shape[0]
                seg.tokens[slot, :n] = levels[0]
                for i in range(1, len(levels)):
                    start = seg.layout.level_offset(i)
                    seg.tokens[slot, start : start + levels[i].shape[0]] = levels[i]
                if global_ids is not None:
                    seg.globals[slot] = global_ids
            f["n_tokens"][slot] = n
            f["audio_samples"][slot] = n_audio
            f["n_global"][slot] = seg.codec.n_global
            f["noise_seed"][slot] = noise_seed
            f["flags"][slot] = flags
            f["start_frame"][slot] = start_frame
            f["dtype"][slot] = dtype
            f["notify"][slot] = notify
            seg.request_id[slot] = (self.handle_id, self.generation[slot], seq)  # its identity
            f["status"][slot] = Status.OK
            now = f["t_submit_ns"][slot] = time.monotonic_ns()
            f["due_in_us"][slot] = min(max(0, due_at_ns - now) // 1000, MAX_DUE_IN_US)
            # Order matters: payload and fields above, then the state word, then req.I (the
            # server reads the request only after taking it), then the wake-up doorbell.
            f["state"][slot] = READY
            post(seg.req(slot))
            post(seg.ready)

    def is_answer(self, seg: Segment, slot: int, seq: int) -> bool:
        """Whether the result in ``slot`` answers request ``seq`` of ours (read only after
        taking ``done.I``): the identity rule of layout.py.

        The state first: the server writes DONE last, after the answer's identity. A post
        taken before the server's own (a stale one, or a flood of them) may come while the
        server is still between the two; taking the answer then, and submitting the next
        request, would have that DONE land on top of it."""
        return (seg.field["state"][slot] == DONE
                and seg.result_id[slot].tolist() == [self.handle_id, self.generation[slot], seq])  # fmt: skip

    def wait_result(self, slot: int, seq: int, deadline: float) -> np.ndarray:
        """Block until request ``seq`` in ``slot`` is answered; its PCM (a private copy).

        On its timeout it lets go of the slot and raises ``DecodeTimeoutError``."""
        while True:
            with self.use() as seg:
                got = seg.wait(seg.done(slot), min(SLICE, max(0.0, deadline - time.monotonic())))
                # Read the result only after taking done.I (the pairing operation), and only
                # if it is the answer to this very request rather than a stale post.
                if got and self.is_answer(seg, slot, seq):
                    return self.take_result(seg, slot, seq)
            if got:
                continue
            if not self.serving():
                self.retire_gone()
                raise Gone()
            if time.monotonic() >= deadline:
                self.let_go(slot, seq)
                raise self.timeout_error()

    def timeout_error(self) -> DecodeTimeoutError:
        if (self.server_phase() or 0) >= Phase.STOPPING:
            why = "it is stopping"
        else:
            why = "it still serves: it may be overloaded"
        return DecodeTimeoutError(
            f"no answer from the decoder server {self.name!r} within the timeout ({why})")

    def take_result(self, seg: Segment, slot: int, seq: int) -> np.ndarray | EncodedAudio:
        """Copy a DONE slot's PCM (an encode's codes) out, or raise its error; hand the slot back."""
        f = seg.field
        try:
            status = int(f["status"][slot])
            if status != Status.OK:
                detail = seg.error_text(slot)
                name = Status(status).name if status in Status._value2member_map_ else str(status)
                if status == Status.NO_ENCODER:
                    raise NoEncoderError(f"{self.name!r}: {detail}", code=status, detail=detail)
                raise DecodeError(f"server rejected the request ({name}): {detail}",
                                  code=status, detail=detail)  # fmt: skip
            if f["flags"][slot] & FLAG_ENCODE:  # our own request's flags
                return _codes(seg, slot)
            n = min(int(f["n_samples"][slot]), seg.pcm32.shape[1])  # never trust a length
            if f["dtype"][slot] == _FLOAT32:
                return seg.pcm32[slot, :n].copy()
            return seg.pcm16[slot, :n].copy()
        finally:
            f["state"][slot] = CLAIMED  # transition 5: the server is done with this request
            self.give(slot, seq)

    # -- retiring ---------------------------------------------------------------------------

    def retire(self, reason: BaseException) -> None:
        """Take no more work: wake every waiter and fail every pending future with ``reason``
        (``Gone`` makes the callers resubmit elsewhere). Unmaps once nobody uses the mapping."""
        with self.lock:
            if self.retired is not None:
                return
            self.retired = reason
            pending, self.pending = list(self.pending.values()), {}
            self.changed.notify_all()
            self.line.wake_all()  # each finds the attachment retired
            unused = not self.users
        for _, loop, future in pending:
            resolve(loop, future, self._retired_error(), False)
        if unused:
            self._unmap()

    def close(self, reason: BaseException, *, wait: float = 1.0) -> None:
        """Retire, give idle slots back, and unmap once the threads in flight have left."""
        self.retire(reason)
        waiter = self.waiter
        if waiter is not None and waiter is not threading.current_thread():
            waiter.join(wait)
        until = time.monotonic() + wait
        while True:
            with self.lock:
                if not self.users or time.monotonic() >= until:
                    break
                waiter = self.changed.add()
            self._sleep(waiter, max(0.0, until - time.monotonic()))
        self._unmap()

    def _unmap(self) -> None:
        with self.lock:
            if self.unmapped or self.users:
                return
            self.unmapped = True
            seg, self.segment = self.segment, None
            owned = list(self.owned)
        if seg is None:
            return
        if seg.field:
            # Free the slots that are ours alone (CLAIMED: no request of theirs reached the
            # server, or its answer was taken). A slot in any other state (READY, BUSY, DONE)
            # may still be written or posted by the server: we only drop its lock, with the
            # lock descriptor below, and the reaper frees it once the server is done with it.
            states = seg.field["state"]
            warm, self.warm = self.warm, None
            if warm is not None and seg.try_lock_slot(warm[0]):
                if int(states[warm[0]]) == CLAIMED and int(seg.field["generation"][warm[0]]) == warm[1]:
                    owned.append(warm[0])  # still as we left it: free it now, not at a reap
                else:
                    seg.unlock_slot(warm[0])
            for slot in owned:
                if int(states[slot]) == CLAIMED:
                    try:
                        seg.free_slot(slot)
                    except (posix_ipc.Error, BiCodecShmError):
                        pass  # the server is gone (its doorbell with it): nobody waits
        seg.close()  # closes the lock descriptor: every lock of ours drops with it

    def forget_after_fork(self) -> None:
        """In a forked child: nothing here is ours (the locks were closed at fork)."""
        self.retired = Gone()
        self.unmapped = True
        seg, self.segment = self.segment, None
        if seg is not None:
            seg.close()


def _codes(seg: Segment, slot: int) -> EncodedAudio:
    """A private copy of an encode's answer in ``slot``: its frames, never past what the slot
    holds, of every level's codes, and its global ids."""
    frames = min(int(seg.field["result_frames"][slot]), seg.layout.max_tokens)
    at = seg.layout.level_offset
    codes = tuple(seg.tokens[slot, at(i) : at(i) + rate * frames].copy()
                  for i, rate in enumerate(seg.codec.level_rates))  # fmt: skip
    return EncodedAudio(codes, seg.globals[slot].copy() if seg.codec.n_global else None)
