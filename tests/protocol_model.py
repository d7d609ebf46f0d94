"""An explicit-state model of the slot protocol, explored breadth-first over every interleaving.

Each actor's steps are the code's steps, one atomic shared-memory, lock or semaphore operation
each (or a run of them that no other actor can observe in between: noted where so). The
comment on each step names the code it mirrors. Actors: the threads of each client handle
(which share the handle's books and its lock descriptor: a lock one thread holds, another
"takes" again at once), and the server: its dispatcher and lanes, and its reaper. ``explore``
checks these invariants in every reachable state:

- no request is answered with another request's audio (``cross-delivery``);
- no request of a handle gets a slot while an older one waits in line for it (``overtaken``);
- the server never writes a result into a slot whose claim epoch moved on since it gathered the
  request (``write after free``), and the reaper never frees a slot whose batch has not
  answered it yet (``free under a batch``);
- no two owners of a slot: a slot a handle thinks it owns is locked by that handle;
- in every state where only timeouts could still move (nothing else is enabled), no request
  waits unanswered (``lost``), no slot is left owned by nobody and not FREE (``orphan``), and
  no handle whose threads are all done still holds a slot's lock (``wedged``: the reaper can
  never free it, and every other client does without it).

``Rules`` selects the protocol: ``Rules()`` is today's code; the other switches re-introduce
earlier rules, so that tests can show the checker finds the bugs they caused.

An encode request (audio in, codes back: ``FLAG_ENCODE``, protocol/layout.py) is payload only:
it takes exactly a decode's steps (claim, submit, wait, take the answer or give up, reap), with
the same identity, states, posts and locks; only what the payload holds differs (audio in the
PCM area going in, codes coming back), and which rows the server batches together. So this
model covers it as it is: a request's payload here stands for either direction's.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

FREE, CLAIMED, READY, BUSY, DONE = range(5)
ERROR = ("error",)  # the payload of a failure answer


@dataclass(frozen=True)
class Rules:
    close_frees_done: bool = False  # the old ``_unmap``: free slots reading CLAIMED *or* DONE
    seq_only_identity: bool = False  # the old check: ``result_seq == seq`` (seq restarts at 1)
    release_before_post: bool = False  # the old order: the held set dropped before ``ring``
    # The old ``Attachment._release``: surplus slots freed and the warm one let go of without
    # the claim lock, so another thread's claim can re-take a lock about to be dropped.
    release_outside_claim_lock: bool = False
    # The old order of locks and books, which an exception between two steps splits: a lock
    # taken before it is booked (``_own``, ``_rewarm``), books dropped before the lock
    # (``let_go``, ``give``), the request numbered after its slot was taken, the caller's try
    # entered only after ``take_slot`` returned, and a cleanup that only gives back the slot
    # of a request that got one (no ``loose`` record, no ``_settle``).
    books_after_locks: bool = False
    # The old ``Server._lane_finished``: the batch's slots leave the held set by number, even
    # where another lane holds them again.
    finish_unholds_slots: bool = False
    # The old ``slot_io.publish``: DONE and the request's identity written whatever became of
    # the slot under the batch (its owner freed it, and maybe another client claimed it).
    publish_ignores_epoch: bool = False
    # The old waiting for a slot of the handle: a give leaves the slot idle for whoever looks
    # first, and a newcomer takes an idle slot or claims one ahead of the requests in line.
    unfair_waiting: bool = False


@dataclass(frozen=True)
class Bounds:
    clients: int = 2  # client handles
    threads: int = 1  # threads per handle, sharing its books, its claim lock and its locks
    handle_slots: int = 0  # the handle's ``slots`` (0: one per thread, so that none waits in line)
    slots: int = 1
    requests: int = 2  # per thread
    closes: bool = False  # a client may close its handle at any step (once)
    deaths: bool = False  # a client may be SIGKILLed at any step (once)
    timeouts: bool = False  # a waiting request may time out, or be interrupted (Ctrl-C)
    interrupts: bool = False  # a thread in a call may get an exception between any two steps (once)
    # 0: every gathered slot is a batch of its own, out of the held set when rung (any number
    # of batches at once). N: N lanes, each running one batch at a time, and finishing it
    # (``Server._lane_finished``) after its rows were rung.
    lanes: int = 0
    server_replacements: int = 0  # the server may die and a new one take the name
    # Client 0 is buggy: it may, once, write FREE into a slot of its own that a batch holds,
    # drop the slot's lock and go away (the other clients are well-behaved).
    frees_under_batch: bool = False


class Slot(NamedTuple):
    state: int = FREE
    gen: int = 0  # the claim epoch
    lock: int | None = None  # the handle whose OFD lock it is
    request: tuple = ()  # (handle, gen, seq, payload) as the client wrote it
    result: tuple = ()  # (handle, gen, seq, payload) as the server wrote it
    req_posts: int = 0
    done_posts: int = 0


class Server(NamedTuple):
    confirmed: frozenset = frozenset()  # req.I taken, not yet gathered
    rows: tuple = ()  # (slot, request copy, published, lane) of gathered requests not yet rung, sorted
    held: frozenset = frozenset()  # ``Server._held``: (slot, lane holding it); the reaper skips these
    lanes: tuple = ()  # per lane: None (idle), or (its batch's slots, whether publishing has begun)
    late_posts: frozenset = frozenset()  # Rules.release_before_post: slots released, not rung


class Handle(NamedTuple):
    """One client handle (``DecoderClient`` and its ``Attachment``): what its threads share."""

    inc: int = 0  # the server incarnation it is attached to
    handle: int = 0
    seq: int = 0  # the attachment's last request number (restarts at 1 per attachment)
    owned: frozenset = frozenset()
    using: tuple = ()  # (slot, thread) sorted: the request each owned slot is in use by
    gens: tuple = ()  # (slot, claim epoch) it owns or owned
    warm: tuple = ()  # (slot, claim epoch) of the warm slot it let go of, or ()
    loose: frozenset = frozenset()  # slots whose lock may be its own that no request owns
    claim_lock: int | None = None  # the thread holding the claim lock
    claimers: frozenset = frozenset()  # threads between deciding to claim and done
    line: tuple = ()  # threads waiting for a slot of the handle, oldest first (``Line``)
    ended: str = ""  # "closed", "dead"


class Thread(NamedTuple):
    h: int  # its handle
    pc: str = "idle"
    k: int = 0  # the request being made (its payload is (thread, k))
    seq: int = 0  # the request's number
    slot: int | None = None
    order: tuple = ()  # a release: the slots still to go (the warm one last)
    freeing: bool = False  # Rules.release_outside_claim_lock: FREE written into order[0], not unlocked
    interrupted: bool = False
    outcomes: tuple = ()  # per request: "ok" or "error"


class State(NamedTuple):
    live: int  # the incarnation serving now; one past the last means none
    slots: tuple  # per incarnation: tuple of Slot
    servers: tuple  # per incarnation: Server
    handles: tuple
    threads: tuple


class Violation(AssertionError):
    def __init__(self, what: str, trace: list[str]) -> None:
        super().__init__(what + "\n  " + "\n  ".join(trace))
        self.what, self.trace = what, trace


# pcs of a thread inside a call (an exception may land there), and of a request in flight
IN_CALL = frozenset({"take", "claim-wait", "claim", "own", "book", "start", "returned", "submit", "wait",
                     "letgo", "release", "release-free", "release-warm", "release-unlock",
                     "yield"})  # fmt: skip
IN_REQUEST = frozenset({"take", "claim-wait", "claim", "own", "book", "start", "returned", "submit", "wait"})
# Steps that touch only a handle's own books, or a slot only it can act on (its lock held):
# with one thread per handle and no interruptions nobody can tell them apart from the step
# before, so they run on at once, as one step (a reduction that keeps every other state).
RUN_ON = frozenset({"claim-wait", "claim", "own", "book", "start", "returned", "letgo", "abandon", "settle",
                    "release", "release-free", "release-warm", "release-unlock", "yield"})  # fmt: skip


_PC_METHOD = {pc: "pc_" + pc.replace("-", "_") for pc in IN_CALL | {"idle", "abandon", "settle"}}


def initial(b: Bounds) -> State:
    incs = b.server_replacements + 1
    server = Server(lanes=(None,) * b.lanes)
    return State(0, tuple(tuple(Slot() for _ in range(b.slots)) for _ in range(incs)),
                 tuple(server for _ in range(incs)),
                 tuple(Handle(handle=_handle(c, 0)) for c in range(b.clients)),
                 tuple(Thread(h=c) for c in range(b.clients) for _ in range(b.threads)))  # fmt: skip


def _handle(client: int, inc: int) -> int:
    return 100 * (client + 1) + inc  # a fresh random handle id per attachment


def _set(t: tuple, i: int, v) -> tuple:
    return t[:i] + (v,) + t[i + 1 :]


def _unlock(slot: Slot, h: int) -> Slot:
    """F_UNLCK through handle h's descriptor: drops h's lock, never another's."""
    return slot._replace(lock=None) if slot.lock == h else slot


class _Step:
    """Builds successor states for one state (each method: one actor's step)."""

    def __init__(self, s: State, b: Bounds, r: Rules) -> None:
        self.s, self.b, self.r = s, b, r
        self.out: list[tuple[str, State, str | None]] = []  # (label, next, violation or None)

    def emit(self, label: str, nxt: State, bad: str | None = None, *, timeout: bool = False) -> None:
        """A successor; ``timeout`` marks steps only a deadline takes (label starts with ~)."""
        self.out.append((("~" if timeout else "") + label, nxt, bad))

    # -- helpers -------------------------------------------------------------------------

    def name(self, t: int) -> str:
        h = self.s.threads[t].h
        return f"c{h}" if self.b.threads == 1 else f"c{h}.{t % self.b.threads}"

    def slots(self, inc: int) -> tuple:
        return self.s.slots[inc]

    def with_slot(self, s: State, inc: int, i: int, slot: Slot) -> State:
        return State(s.live, _set(s.slots, inc, _set(s.slots[inc], i, slot)), s.servers, s.handles, s.threads)

    def with_server(self, s: State, inc: int, server: Server) -> State:
        return State(s.live, s.slots, _set(s.servers, inc, server), s.handles, s.threads)

    def act(self, t: int, label: str, thread: Thread, handle: Handle | None = None,
            slot: tuple[int, Slot] | None = None, bad: str | None = None, *,
            timeout: bool = False) -> None:  # fmt: skip
        """Emit thread t's step: its new thread state, its handle's books, one slot."""
        s = self.s
        th = s.threads[t]
        slots = s.slots
        if slot is not None:
            inc = s.handles[th.h].inc
            slots = _set(slots, inc, _set(slots[inc], slot[0], slot[1]))
        handles = s.handles if handle is None else _set(s.handles, th.h, handle)
        nxt = State(s.live, slots, s.servers, handles, _set(s.threads, t, thread))
        self.emit(f"{self.name(t)} {label}", nxt, bad, timeout=timeout)

    # -- client threads (attachment.py, client.py) ------------------------------------------

    def thread(self, t: int) -> None:
        s, th = self.s, self.s.threads[t]
        hd = s.handles[th.h]
        if th.pc in ("finished", "closed", "dead"):
            return
        start = len(self.out)
        getattr(self, _PC_METHOD[th.pc])(t, th, hd)
        if self.b.interrupts and not th.interrupted and th.pc in IN_CALL:
            self.interrupt(t, th, hd)
        if self.b.threads == 1 and not self.b.interrupts:
            self.out[start:] = [move for m in self.out[start:] for move in self._run_on(t, m)]

    def _run_on(self, t: int, move: tuple) -> list[tuple]:
        """``move``, continued while thread t stands at a step of RUN_ON (see there)."""
        label, nxt, bad = move
        if bad is not None or nxt.threads[t].pc not in RUN_ON:
            return [move]
        step = _Step(nxt, self.b, self.r)
        step.thread(t)
        if not step.out:
            return [move]
        return [(label + "; " + more, after, why) for more, after, why in step.out]

    def handle(self, h: int) -> None:
        s, hd = self.s, self.s.handles[h]
        if hd.ended:
            return
        mine = [t for t, th in enumerate(s.threads) if th.h == h]
        if all(s.threads[t].pc == "finished" for t in mine):
            return  # nothing left to do: closing or dying now changes nothing that matters
        if hd.inc != s.live and any(s.threads[t].pc in IN_CALL or s.threads[t].pc in ("abandon", "settle")
                                    for t in mine):  # fmt: skip
            self.gone(h, hd, mine)
        if self.b.closes:
            self.close(h, hd, mine)
        if self.b.deaths:
            self.die(h, hd, mine)
        if self.b.frees_under_batch and h == 0:
            self.free_under_batch(h, hd, mine)

    def pc_idle(self, t: int, th: Thread, hd: Handle) -> None:
        if th.k >= self.b.requests:
            self.act(t, "is done", th._replace(pc="finished"))
        elif self.r.books_after_locks:  # the old take_slot numbered the request once it had a slot
            self.act(t, "next request", th._replace(pc="take", seq=0))
        else:
            # DecoderClient._decode: att.new_seq(), before the try.
            self.act(t, "next request", th._replace(pc="take", seq=hd.seq + 1), hd._replace(seq=hd.seq + 1))

    def _seq(self, th: Thread, hd: Handle) -> tuple[Thread, Handle]:
        """The old code numbered a request when its slot was taken (``_start_request``)."""
        if th.seq == 0:
            return th._replace(seq=hd.seq + 1), hd._replace(seq=hd.seq + 1)
        return th, hd

    def pc_take(self, t: int, th: Thread, hd: Handle) -> None:
        # Attachment._take_local: the slot handed to it in line, else an idle slot of ours
        # (owned, not in use), else a claim if our limit allows one (the handle's ``slots``) and
        # nobody is in line before it, else into the line (one store), to wait.
        if self.b.timeouts and t in hd.line:
            # take_slot's deadline, in line: it leaves (passing on a slot handed meanwhile).
            nxt = th._replace(pc="abandon", k=th.k + 1, outcomes=th.outcomes + ("error",))
            self.act(t, "times out in line", nxt, timeout=True)
        handed = [i for i, u in hd.using if u == t]
        if handed:
            i = handed[0]
            self.act(t, f"finds slot {i} handed to it", th._replace(pc="submit", slot=i), self._leave(hd, t))
            return
        busy = {i for i, _ in hd.using}
        if self.r.books_after_locks:  # the old idle list: a slot claimed, not yet booked, is not in it
            busy |= {u.slot for u in self.s.threads if u.h == th.h and u.pc == "start"}
        idle = sorted(hd.owned - busy)
        ahead = self._ahead(hd, t)
        overtaken = None
        if ahead:
            overtaken = f"overtaken: thread {t} got a slot while thread {ahead[0]} waited in line"
        limit = self.b.handle_slots or self.b.threads
        if idle:
            i = idle[-1]
            th2, hd2 = self._seq(th, hd)
            hd2 = self._leave(hd2._replace(using=tuple(sorted(hd2.using + ((i, t),)))), t)
            self.act(t, f"takes its idle slot {i}", th2._replace(pc="submit", slot=i), hd2, bad=overtaken)
        elif (len(hd.owned) + len(hd.claimers) < limit and (not ahead or self.r.unfair_waiting)
              and self._worth_a_claim(hd, th.h)):  # fmt: skip
            self.act(t, "decides to claim", th._replace(pc="claim-wait"),
                     hd._replace(claimers=hd.claimers | {t}), bad=overtaken)  # fmt: skip
        elif t not in hd.line and not self.r.books_after_locks:
            self.act(t, "joins the line", th, hd._replace(line=hd.line + (t,)))

    def _ahead(self, hd: Handle, t: int) -> list[int]:
        """Threads in line before t (all of the line if t is not in it) that hold no slot."""
        line = hd.line[: hd.line.index(t)] if t in hd.line else hd.line
        holding = {u for _, u in hd.using}
        return [u for u in line if u not in holding]

    def _leave(self, hd: Handle, t: int) -> Handle:
        return hd._replace(line=tuple(u for u in hd.line if u != t)) if t in hd.line else hd

    def _give(self, hd: Handle, i: int, t: int) -> Handle:
        """Attachment.give of thread t's slot i (CLAIMED): booked straight to the oldest thread
        in line that holds no slot (one store), else idle. The unfair rule: always idle."""
        first = None if self.r.unfair_waiting else next(iter(self._ahead(hd, -1)), None)
        using = tuple(u for u in hd.using if u != (i, t))
        if first is not None:
            using = tuple(sorted(using + ((i, first),)))
        return hd._replace(using=using)

    def _worth_a_claim(self, hd: Handle, h: int) -> bool:
        """Whether a claim attempt can change anything: a warm slot, a FREE slot, or loose ones
        to settle. Otherwise the thread sleeps on the free doorbell (and a step here would only
        go round in a circle, hiding a request that waits for ever)."""
        return bool(hd.warm or self._claimable(hd, h) or (hd.loose and not self.r.books_after_locks))

    def _claimable(self, hd: Handle, h: int) -> list[int]:
        """FREE slots whose lock h's descriptor can take (nobody's, or h's own: OFD locks)."""
        # Today's claim skips slots of its own books (a FREE written over one of them); the old
        # one had no ``loose`` record to skip.
        skip = set() if self.r.books_after_locks else hd.owned | hd.loose
        return [i for i, sl in enumerate(self.slots(hd.inc))
                if sl.state == FREE and sl.lock in (None, h) and i not in skip]  # fmt: skip

    def pc_claim_wait(self, t: int, th: Thread, hd: Handle) -> None:
        # Attachment._claim_or_none: ``with self.claim_lock`` (the thread waits while another
        # of its handle holds it), then _settle.
        if hd.claim_lock is not None:
            return
        s2, hd2 = self.settle(th.h, hd._replace(claim_lock=t))
        self.s, saved = s2, self.s
        self.act(t, "takes the claim lock", th._replace(pc="claim"), hd2)
        self.s = saved

    def settle(self, h: int, hd: Handle) -> tuple[State, Handle]:
        """Attachment._settle (the claim lock held): each loose slot owned, warm and unlocked,
        freed (ours, CLAIMED, at our epoch), or unlocked. Each slot's part happens under its
        lock: one step."""
        s = self.s
        if self.r.books_after_locks:
            return s, hd
        slots = list(s.slots[hd.inc])
        gens = dict(hd.gens)
        for i in sorted(hd.loose):
            sl = slots[i]
            if i in hd.owned:
                pass
            elif hd.warm and hd.warm[0] == i:
                sl = _unlock(sl, h)
            elif sl.lock in (None, h):
                if sl.state == CLAIMED and sl.gen == gens.get(i):
                    sl = sl._replace(state=FREE, lock=None)  # free_slot (transition 6)
                else:
                    sl = sl._replace(lock=None)
            slots[i] = sl
        s = s._replace(slots=_set(s.slots, hd.inc, tuple(slots)))
        return s, hd._replace(loose=frozenset())

    def pc_claim(self, t: int, th: Thread, hd: Handle) -> None:
        """Holding the claim lock: re-take the warm slot, or lock a FREE one, or give up."""
        r, h = self.r, th.h
        slots = self.slots(hd.inc)
        if hd.warm:
            # Attachment._rewarm: loose first (the new order), the warm slot forgotten, its lock
            # re-taken; then booked if still CLAIMED at its epoch, claimed if FREE, else dropped.
            i, gen = hd.warm
            sl = slots[i]
            loose = hd.loose if r.books_after_locks else hd.loose | {i}
            if sl.lock not in (None, h):
                self.act(t, f"finds its warm slot {i} taken", th, hd._replace(warm=(), loose=loose - {i}))
            elif sl.state == CLAIMED and sl.gen == gen:
                if r.books_after_locks:  # the old _rewarm: owned at once, the request numbered later
                    hd2 = hd._replace(warm=(), owned=hd.owned | {i}, claim_lock=None,
                                      claimers=hd.claimers - {t})  # fmt: skip
                    self.act(t, f"re-takes its warm slot {i}", th._replace(pc="start", slot=i), hd2,
                             (i, sl._replace(lock=h)))  # fmt: skip
                else:
                    self.act(t, f"re-takes the lock of its warm slot {i}", th._replace(pc="book", slot=i),
                             hd._replace(warm=(), loose=loose), (i, sl._replace(lock=h)))  # fmt: skip
            elif sl.state == FREE:
                self.act(t, f"re-takes its warm slot {i}, freed meanwhile", th._replace(pc="own", slot=i),
                         hd._replace(warm=(), loose=loose), (i, sl._replace(lock=h)))  # fmt: skip
            else:
                self.act(t, f"drops its warm slot {i}", th, hd._replace(warm=(), loose=loose - {i}))
            return
        claimable = self._claimable(hd, h)
        for i in claimable:
            # try_lock (OFD: our own descriptor's lock "succeeds"), re-check FREE under it.
            loose = hd.loose if r.books_after_locks else hd.loose | {i}
            self.act(t, f"locks slot {i}", th._replace(pc="own", slot=i), hd._replace(loose=loose),
                     (i, slots[i]._replace(lock=h)))  # fmt: skip
        if not claimable:
            # _take_or_claim: the claim failed; into the line (whoever comes later waits behind).
            line = hd.line if t in hd.line or r.books_after_locks else hd.line + (t,)
            self.act(t, "finds no slot", th._replace(pc="take"),
                     hd._replace(claim_lock=None, claimers=hd.claimers - {t}, line=line))  # fmt: skip

    def pc_own(self, t: int, th: Thread, hd: Handle) -> None:
        # Attachment._own: drain done.I and req.I, bump the claim epoch, CLAIMED (under the
        # slot's lock: nobody else acts on it); then _book, leave the claim lock and the claimers.
        i = th.slot
        sl = self.slots(hd.inc)[i]
        gen = sl.gen + 1
        new = sl._replace(state=CLAIMED, gen=gen, req_posts=0, done_posts=0)
        gens = tuple(sorted((dict(hd.gens) | {i: gen}).items()))
        if self.r.books_after_locks:  # the old _own: owned; the request is booked later
            hd2 = hd._replace(owned=hd.owned | {i}, gens=gens, claim_lock=None, claimers=hd.claimers - {t})
            self.act(t, f"claims slot {i} (epoch {gen})", th._replace(pc="start"), hd2, (i, new))
            return
        hd2 = hd._replace(owned=hd.owned | {i}, using=tuple(sorted(hd.using + ((i, t),))), gens=gens,
                          loose=hd.loose - {i}, claim_lock=None, claimers=hd.claimers - {t})  # fmt: skip
        # (out of the line once claimed: _take_or_claim's _leave_line; no other thread of the
        # handle can tell the two steps apart, the claimer is first in line or the line is empty)
        self.act(t, f"claims slot {i} (epoch {gen})", th._replace(pc="submit"), self._leave(hd2, t), (i, new))

    def pc_book(self, t: int, th: Thread, hd: Handle) -> None:
        # Attachment._book after _rewarm: owned, in use by this request, out of loose.
        i = th.slot
        hd2 = hd._replace(owned=hd.owned | {i}, using=tuple(sorted(hd.using + ((i, t),))),
                          loose=hd.loose - {i}, claim_lock=None, claimers=hd.claimers - {t})  # fmt: skip
        self.act(t, f"re-takes its warm slot {i}", th._replace(pc="submit"), self._leave(hd2, t))

    def pc_start(self, t: int, th: Thread, hd: Handle) -> None:
        # The old _start_request: the request numbered and booked after _claim_or_none returned.
        th2, hd2 = self._seq(th, hd)
        hd2 = hd2._replace(using=tuple(sorted(hd2.using + ((th.slot, t),))))
        self.act(t, f"books slot {th.slot}", th2._replace(pc="returned"), hd2)

    def pc_returned(self, t: int, th: Thread, hd: Handle) -> None:
        # The old _decode: take_slot returned; the try that cleans up starts here.
        self.act(t, "enters the try", th._replace(pc="submit"))

    def pc_submit(self, t: int, th: Thread, hd: Handle) -> None:
        # Attachment.submit: payload and identity, state READY, then post req.I.
        slot = self.slots(hd.inc)[th.slot]
        request = (hd.handle, dict(hd.gens)[th.slot], th.seq, (t, th.k))
        new = slot._replace(state=READY, request=request, req_posts=slot.req_posts + 1)
        self.act(t, f"submits request {th.k} in slot {th.slot}", th._replace(pc="wait"), None, (th.slot, new))

    def _quiescent(self, hd: Handle) -> bool:
        return not hd.using and not hd.claimers

    def _release_order(self, hd: Handle, last: int) -> tuple:
        return tuple(sorted(hd.owned - {last})) + ((last,) if last in hd.owned else ())

    def pc_wait(self, t: int, th: Thread, hd: Handle) -> None:
        slot = self.slots(hd.inc)[th.slot]
        if slot.done_posts:
            # Attachment.wait_result: take done.I, then the identity check (``is_answer``).
            taken = slot._replace(done_posts=slot.done_posts - 1)
            mine = (hd.handle, dict(hd.gens)[th.slot], th.seq)
            if self.r.seq_only_identity:
                match = len(slot.result) == 4 and slot.result[2] == th.seq
            else:
                match = slot.result[:3] == mine
            if not match:
                self.act(t, f"skips a stale post in slot {th.slot}", th, None, (th.slot, taken))
            else:
                payload = slot.result[3]
                bad = None
                if payload not in ((t, th.k), ERROR):
                    bad = f"cross-delivery: thread {t}'s request {th.k} got the audio of {payload}"
                # take_result: CLAIMED; give(): to the oldest in line, else idle; quiescent ->
                # _release (steps below).
                hd2 = self._give(hd, th.slot, t)
                outcome = "ok" if payload != ERROR else "error"
                nxt = th._replace(pc="idle", k=th.k + 1, outcomes=th.outcomes + (outcome,))
                if self._quiescent(hd2) and hd2.owned:
                    if self.r.books_after_locks:
                        # The old give: the idle list's slots out of owned at once, under the
                        # handle's lock; freed and let go of afterwards (_release). A slot
                        # claimed but not yet booked (``start``) is not in the list.
                        booking = {u.slot for u in self.s.threads if u.h == th.h and u.pc == "start"}
                        order = self._release_order(hd2._replace(owned=hd2.owned - booking), th.slot)
                        hd2 = hd2._replace(owned=hd2.owned - set(order))
                        claim = None if self.r.release_outside_claim_lock else "release"
                        nxt = nxt._replace(pc="release-free" if claim is None else "release", order=order)
                    else:
                        nxt = nxt._replace(pc="release", order=())
                self.act(t, f"takes the answer to request {th.k} from slot {th.slot}", nxt, hd2,
                         (th.slot, taken._replace(state=CLAIMED)), bad)  # fmt: skip
                if self._ahead(hd, -1) and not (self.r.unfair_waiting or self.r.books_after_locks):
                    # give() when another handle asked for a slot (``slot_wanted``, a hint any
                    # handle may store at any time): the slot goes back to the segment, not to
                    # the line; loose, out of owned, out of use; then _settle frees it.
                    i = th.slot
                    hd3 = hd._replace(loose=hd.loose | {i}, owned=hd.owned - {i},
                                      using=tuple(u for u in hd.using if u != (i, t)))  # fmt: skip
                    back = th._replace(pc="yield", k=th.k + 1, outcomes=th.outcomes + (outcome,))
                    self.act(t, f"takes the answer to request {th.k} from slot {i} and gives the slot back",
                             back, hd3, (i, taken._replace(state=CLAIMED)), bad)  # fmt: skip
        if self.b.timeouts and (self.r.books_after_locks or hd.claim_lock is None):
            # wait_result's deadline: let_go, under the claim lock (today's rule): loose first,
            # then out of owned and of use; the unlock is the next step. Then the exception goes
            # to the caller's cleanup.
            i = th.slot
            hd2 = hd._replace(owned=hd.owned - {i}, using=tuple(u for u in hd.using if u != (i, t)))
            if not self.r.books_after_locks:
                hd2 = hd2._replace(loose=hd.loose | {i}, claim_lock=t)
            nxt = th._replace(pc="letgo", k=th.k + 1, outcomes=th.outcomes + ("error",))
            self.act(t, f"times out on request {th.k} and lets go of slot {i}", nxt, hd2, timeout=True)

    def pc_letgo(self, t: int, th: Thread, hd: Handle) -> None:
        # let_go: the unlock, then out of loose; the timeout then reaches the caller's
        # cleanup (abandon: _settle, and a quiescent handle's release).
        i = th.slot
        sl = self.slots(hd.inc)[i]
        nxt = th._replace(pc="idle" if self.r.books_after_locks else "abandon", slot=None)
        lock = None if hd.claim_lock == t else hd.claim_lock
        self.act(t, f"drops the lock of slot {i}", nxt, hd._replace(loose=hd.loose - {i}, claim_lock=lock),
                 (i, _unlock(sl, th.h)))  # fmt: skip

    def pc_release(self, t: int, th: Thread, hd: Handle) -> None:
        # Attachment._release: under the claim lock (today's rule), re-check that no request is
        # in flight; every owned slot into loose, then out of owned, in one hold of the
        # handle's lock (each prefix is consistent); the most recently used goes warm.
        if self.r.books_after_locks:  # the old give emptied owned already (order is set)
            if hd.claim_lock is not None:
                return
            self.act(t, "takes the claim lock to release", th._replace(pc="release-free"),
                     hd._replace(claim_lock=t))  # fmt: skip
            return
        outside = self.r.release_outside_claim_lock
        if not outside and hd.claim_lock is not None:
            return
        lock = hd.claim_lock if outside else t
        if not self._quiescent(hd) or not hd.owned:
            self.act(t, "finds its handle busy again", th._replace(pc="idle", order=()))
            return
        last = th.slot if th.slot in hd.owned else max(hd.owned)
        order = self._release_order(hd, last)
        hd2 = hd._replace(loose=hd.loose | hd.owned, owned=frozenset(), claim_lock=lock)
        self.act(t, "starts the release", th._replace(pc="release-free", order=order), hd2)

    def pc_release_free(self, t: int, th: Thread, hd: Handle) -> None:
        if len(th.order) <= 1:
            self.act(t, "comes to its warm slot", th._replace(pc="release-warm"))
            return
        i = th.order[0]
        sl = self.slots(hd.inc)[i]
        if self.r.release_outside_claim_lock and not th.freeing:
            # Segment.free_slot, unguarded: FREE first, the unlock after it (another thread's
            # claim may come in between).
            self.act(t, f"writes FREE into slot {i}", th._replace(freeing=True), None,
                     (i, sl._replace(state=FREE)))  # fmt: skip
            return
        if th.freeing:
            self.act(t, f"unlocks slot {i}", th._replace(order=th.order[1:], freeing=False),
                     hd._replace(loose=hd.loose - {i}), (i, _unlock(sl, th.h)))  # fmt: skip
            return
        # free_slot: FREE, unlock (under the claim lock no thread of ours comes in between,
        # and no other process can act on a slot we hold locked), then out of loose.
        self.act(t, f"frees slot {i}", th._replace(order=th.order[1:]), hd._replace(loose=hd.loose - {i}),
                 (i, _unlock(sl._replace(state=FREE), th.h)))  # fmt: skip

    def pc_release_warm(self, t: int, th: Thread, hd: Handle) -> None:
        # The warm slot remembered (before its unlock: see _settle).
        (i,) = th.order
        self.act(t, f"keeps slot {i} warm", th._replace(pc="release-unlock"),
                 hd._replace(warm=(i, dict(hd.gens)[i])))  # fmt: skip

    def pc_release_unlock(self, t: int, th: Thread, hd: Handle) -> None:
        (i,) = th.order
        sl = self.slots(hd.inc)[i]
        lock = None if hd.claim_lock == t else hd.claim_lock
        self.act(t, f"drops the lock of its warm slot {i}", th._replace(pc="idle", order=(), slot=None),
                 hd._replace(loose=hd.loose - {i}, claim_lock=lock), (i, _unlock(sl, th.h)))  # fmt: skip

    def interrupt(self, t: int, th: Thread, hd: Handle) -> None:
        # A signal handler's exception between two steps: every ``with`` lock is left (the
        # claim lock), and the exception reaches the caller's cleanup.
        lock = None if hd.claim_lock == t else hd.claim_lock
        hd2 = hd._replace(claim_lock=lock)
        failed = ("error",) if th.pc in IN_REQUEST else ()
        k = th.k + 1 if th.pc in IN_REQUEST else th.k
        if self.r.books_after_locks:
            # The old cleanup: done_with(slot, seq) of a request whose take_slot returned (its
            # try had begun), nothing otherwise; the old _claim_or_none's finally left the
            # claimers.
            hd2 = hd2._replace(claimers=hd2.claimers - {t})
            nxt = th._replace(pc="idle", k=k, interrupted=True, outcomes=th.outcomes + failed, order=(),
                              freeing=False)  # fmt: skip
            if th.pc in ("submit", "wait"):
                s2, hd2 = self.done_with(t, th, hd2)
                self.s, saved = s2, self.s
                self.act(t, f"is interrupted ({th.pc})", nxt, hd2)
                self.s = saved
            else:
                self.act(t, f"is interrupted ({th.pc})", nxt, hd2)
            return
        nxt = th._replace(pc="abandon", k=k, interrupted=True, outcomes=th.outcomes + failed, order=(),
                          freeing=False)  # fmt: skip
        self.act(t, f"is interrupted ({th.pc})", nxt, hd2)

    def done_with(self, t: int, th: Thread, hd: Handle) -> tuple[State, Handle]:
        """Attachment.done_with for thread t's request: give back a CLAIMED slot (to the oldest
        in line, else idle: a slot handed to a waiter that leaves is passed on), let go of any
        other (out of owned, unlocked: the reaper frees it). One step (no second exception
        comes)."""
        s = self.s
        mine = [i for i, u in hd.using if u == t]
        for i in mine:
            sl = s.slots[hd.inc][i]
            if sl.state == CLAIMED:
                hd = self._give(hd, i, t)
            else:
                hd = hd._replace(using=tuple(u for u in hd.using if u != (i, t)))
                hd = hd._replace(owned=hd.owned - {i})
                s = self.with_slot(s, hd.inc, i, _unlock(sl, th.h))
        return s, hd

    def pc_abandon(self, t: int, th: Thread, hd: Handle) -> None:
        # Attachment.abandon: out of the claimers, done_with for the request's slot (a let go
        # takes the claim lock).
        letting_go = any(u == t and self.slots(hd.inc)[i].state != CLAIMED for i, u in hd.using)
        if letting_go and hd.claim_lock is not None:
            return
        s2, hd2 = self.done_with(t, th, self._leave(hd, t)._replace(claimers=hd.claimers - {t}))
        self.s, saved = s2, self.s
        self.act(t, "cleans up after its request", th._replace(pc="settle", slot=None), hd2)
        self.s = saved

    def pc_yield(self, t: int, th: Thread, hd: Handle) -> None:
        # give's ``_settle_now``: _settle under the claim lock; no release after it (a request
        # of ours waits in line).
        if hd.claim_lock is not None:
            return
        s2, hd2 = self.settle(th.h, hd)
        self.s, saved = s2, self.s
        self.act(t, "frees the slot it gave back", th._replace(pc="idle", slot=None), hd2)
        self.s = saved

    def pc_settle(self, t: int, th: Thread, hd: Handle) -> None:
        # abandon: _settle under the claim lock; then a quiescent handle's release.
        if hd.claim_lock is not None:
            return
        s2, hd2 = self.settle(th.h, hd)
        pc = "release" if self._quiescent(hd2) and hd2.owned else "idle"
        self.s, saved = s2, self.s
        self.act(t, "settles its handle", th._replace(pc=pc), hd2)
        self.s = saved

    def gone(self, h: int, hd: Handle, mine: list[int]) -> None:
        # The server of its attachment stopped serving (probed by lock): retire the attachment
        # (closing its lock descriptor drops every lock in it) and resubmit to the live one.
        s = self.s
        if s.live >= len(s.slots):
            return  # no server at all: the request's own deadline ends it (a timeout)
        old = tuple(_unlock(sl, h) for sl in s.slots[hd.inc])
        s2 = s._replace(slots=_set(s.slots, hd.inc, old))
        s2 = s2._replace(handles=_set(s2.handles, h, Handle(inc=s.live, handle=_handle(h, s.live))))
        threads = s2.threads
        for t in mine:
            th = threads[t]
            if th.pc in IN_REQUEST:
                earlier = sum(1 for u in mine if u < t and threads[u].pc in IN_REQUEST)
                seq = 0 if self.r.books_after_locks else 1 + earlier
                th = th._replace(pc="take", seq=seq, slot=None, order=(), freeing=False)
            elif th.pc not in ("idle", "finished"):
                th = th._replace(pc="idle", slot=None, order=(), freeing=False)
            threads = _set(threads, t, th)
        if not self.r.books_after_locks:
            n = sum(1 for t in mine if threads[t].pc == "take")
            s2 = s2._replace(handles=_set(s2.handles, h, s2.handles[h]._replace(seq=n)))
        self.emit(f"c{h} finds its server gone and resubmits", s2._replace(threads=threads))

    def close(self, h: int, hd: Handle, mine: list[int]) -> None:
        # DecoderClient.close -> Attachment._unmap: free the owned slots reading CLAIMED (the
        # old rule: CLAIMED or DONE); the lock descriptor closes, dropping every other lock.
        frees = (CLAIMED, DONE) if self.r.close_frees_done else (CLAIMED,)
        new = tuple(
            sl if sl.lock != h
            else sl._replace(state=FREE, lock=None) if i in hd.owned and sl.state in frees
            else sl._replace(lock=None)
            for i, sl in enumerate(self.slots(hd.inc))
        )  # fmt: skip
        if hd.warm:
            # _unmap: the warm slot too, re-locked and freed if still CLAIMED at its epoch.
            i, gen = hd.warm
            slot = new[i]
            if slot.lock is None and slot.state == CLAIMED and slot.gen == gen:
                new = _set(new, i, slot._replace(state=FREE))
        s = self.s
        ended = hd._replace(owned=frozenset(), warm=(), loose=frozenset(), ended="closed")
        threads = s.threads
        for t in mine:
            th = threads[t]
            failed = ("error",) if th.pc in IN_REQUEST else ()
            threads = _set(threads, t, th._replace(pc="closed", outcomes=th.outcomes + failed))
        self.emit(f"c{h} closes its handle",
                  State(s.live, _set(s.slots, hd.inc, new), s.servers, _set(s.handles, h, ended), threads))

    def die(self, h: int, hd: Handle, mine: list[int]) -> None:
        # SIGKILL: the kernel drops every lock of the process; nothing else changes.
        s = self.s
        new = tuple(_unlock(sl, h) for sl in s.slots[hd.inc])
        threads = s.threads
        for t in mine:
            threads = _set(threads, t, threads[t]._replace(pc="dead"))
        dead = _set(s.handles, h, hd._replace(owned=frozenset(), ended="dead"))
        self.emit(f"c{h} is killed", State(s.live, _set(s.slots, hd.inc, new), s.servers, dead, threads))

    def free_under_batch(self, h: int, hd: Handle, mine: list[int]) -> None:
        # A buggy client: Segment.free_slot on a slot of its own that the server decodes
        # (BUSY: FREE, unlock), then it goes away. Its own request is lost; nobody else's may be.
        s = self.s
        for i, sl in enumerate(s.slots[hd.inc]):
            if sl.lock != h or sl.state != BUSY:
                continue
            slots = _set(s.slots, hd.inc, _set(s.slots[hd.inc], i, sl._replace(state=FREE, lock=None)))
            threads = s.threads
            for t in mine:
                threads = _set(threads, t, threads[t]._replace(pc="dead"))
            gone = _set(s.handles, h, hd._replace(owned=frozenset(), ended="dead"))
            self.emit(f"c{h} frees slot {i} under its batch", State(s.live, slots, s.servers, gone, threads))

    # -- the server (server.py, lanes.py, slot_io.py) and its reaper ------------------------

    def server(self) -> None:
        s = self.s
        inc = s.live
        if inc >= len(s.slots):
            return
        srv, slots = s.servers[inc], s.slots[inc]
        rows = {row[0]: row for row in srv.rows}
        held = {i for i, _ in srv.held}
        for i, slot in enumerate(slots):
            # _scan: a READY slot (a hint) not yet confirmed nor held: take req.I.
            if slot.state == READY and i not in srv.confirmed and i not in held and slot.req_posts:
                s2 = self.with_slot(s, inc, i, slot._replace(req_posts=slot.req_posts - 1))
                self.emit(f"server takes req.{i}",
                          self.with_server(s2, inc, srv._replace(confirmed=srv.confirmed | {i})))  # fmt: skip
            if i in srv.confirmed:
                self.gather(inc, i, slot, srv)
            if i in rows:
                self.publish_or_ring(inc, i, slot, srv, rows[i])
            self.reap(inc, i, slot, srv, held)
        for lane, batch in enumerate(srv.lanes):
            if batch is not None and not any(row[3] == lane for row in srv.rows):
                self.finish(inc, lane, batch[0], srv)
        if s.live < len(s.slots) - 1:
            # The server is SIGKILLed (or stops) and the next one takes the name over.
            self.emit("server dies; a new one serves", s._replace(live=s.live + 1))

    def gather(self, inc: int, i: int, slot: Slot, srv: Server) -> None:
        # check_headers + gather: copy the header; not READY -> a stray post, ignored; a stale
        # claim epoch -> an error answer at once (_answer_failure); else BUSY and held, by a
        # lane that is free, or whose batch is still being gathered (nothing published yet).
        s = self.s
        srv2 = srv._replace(confirmed=srv.confirmed - {i})
        if slot.state != READY:
            self.emit(f"server ignores stray req.{i}", self.with_server(s, inc, srv2))
        elif slot.request[1] != slot.gen:
            fail = slot._replace(state=DONE, result=slot.request[:3] + (ERROR,),
                                 done_posts=slot.done_posts + 1)  # fmt: skip
            self.emit(f"server answers stale request in slot {i} with an error",
                      self.with_server(self.with_slot(s, inc, i, fail), inc, srv2))  # fmt: skip
        else:
            busy = self.with_slot(s, inc, i, slot._replace(state=BUSY))
            if not self.b.lanes:
                rows = tuple(sorted(srv2.rows + ((i, slot.request, False, None),)))
                self.emit(f"server gathers slot {i}", self.with_server(
                    busy, inc, srv2._replace(rows=rows, held=srv2.held | {(i, None)})))  # fmt: skip
                return
            for lane, batch in enumerate(srv.lanes):
                if batch is not None and batch[1]:
                    continue  # running: its rows are being published
                if batch is None and any(b is None for b in srv.lanes[:lane]):
                    continue  # idle lanes are alike: the first one stands for them all
                rows = tuple(sorted(srv2.rows + ((i, slot.request, False, lane),)))
                lanes = _set(srv.lanes, lane, ((batch[0] if batch else frozenset()) | {i}, False))
                srv3 = srv2._replace(rows=rows, held=srv2.held | {(i, lane)}, lanes=lanes)
                self.emit(f"lane {lane} gathers slot {i}", self.with_server(busy, inc, srv3))

    def publish_or_ring(self, inc: int, i: int, slot: Slot, srv: Server, row: tuple) -> None:
        s = self.s
        _, request, published, lane = row
        rest = tuple(r for r in srv.rows if r[0] != i)
        moved = slot.state != BUSY or slot.gen != request[1]
        if not published and not self.r.publish_ignores_epoch and moved:
            # slot_io.publish (``moved_on``): the slot is not BUSY at the request's epoch any
            # more (its owner freed it under the batch): no DONE, no post, out of the held set
            # (Server._release_and_ring), and the dispatcher is woken for what waits there.
            srv2 = srv._replace(rows=rest, held=frozenset(h for h in srv.held if h[0] != i))
            if lane is not None:
                srv2 = srv2._replace(lanes=_set(srv2.lanes, lane, (srv.lanes[lane][0], True)))
            self.emit(f"server drops the answer of slot {i}", self.with_server(s, inc, srv2))
        elif not published:
            # slot_io.publish: PCM, answer identity (the gathered copy's), the check above, then
            # state DONE (the check and the store are taken as one step here).
            bad = None
            if slot.gen != request[1]:
                bad = (f"write after free: the server wrote request {request[3]}'s answer into slot {i} "
                       "at a later epoch")  # fmt: skip
            new = slot._replace(state=DONE, result=request)
            if self.r.release_before_post:  # the old order: out of the held set, ring later
                srv2 = srv._replace(rows=rest, held=srv.held - {(i, lane)}, late_posts=srv.late_posts | {i})
            else:
                srv2 = srv._replace(rows=tuple(sorted(rest + ((i, request, True, lane),))))
            if lane is not None:  # the batch runs: it takes no more rows
                srv2 = srv2._replace(lanes=_set(srv2.lanes, lane, (srv.lanes[lane][0], True)))
            self.emit(f"server publishes slot {i}",
                      self.with_server(self.with_slot(s, inc, i, new), inc, srv2), bad)  # fmt: skip
        else:
            # Server._release_and_ring: out of the held set and done.I posted, under the lock
            # the reaper holds.
            new = slot._replace(done_posts=slot.done_posts + 1)
            srv2 = srv._replace(rows=rest, held=frozenset(h for h in srv.held if h[0] != i))
            self.emit(f"server rings slot {i}", self.with_server(self.with_slot(s, inc, i, new), inc, srv2))

    def finish(self, inc: int, lane: int, batch: frozenset, srv: Server) -> None:
        # Server._lane_finished, once every row of the lane's batch was answered: out of the
        # held set only what this batch still holds (none, normally), or, the old rule, every
        # slot of the batch by number, whoever holds it now.
        if self.r.finish_unholds_slots:
            held = frozenset(h for h in srv.held if h[0] not in batch)
        else:
            held = srv.held - {(i, lane) for i in batch}
        srv2 = srv._replace(held=held, lanes=_set(srv.lanes, lane, None))
        self.emit(f"lane {lane} finishes its batch", self.with_server(self.s, inc, srv2))

    def reap(self, inc: int, i: int, slot: Slot, srv: Server, held: set) -> None:
        s = self.s
        if i in srv.late_posts:
            # The old order's post, after the slot already left the held set.
            new = slot._replace(done_posts=slot.done_posts + 1)
            srv2 = srv._replace(late_posts=srv.late_posts - {i})
            late = self.with_server(self.with_slot(s, inc, i, new), inc, srv2)
            self.emit(f"server rings slot {i} (late)", late)
        # Server.reap: a slot not FREE, held by no batch, whose lock is free: bump the epoch,
        # drain its posts, FREE. When it runs (each tick, or at once when a claimer that found
        # no FREE slot asks through the header's ``slot_wanted``) is not modelled: it may run at
        # any step here, which covers both.
        if slot.state != FREE and i not in held and slot.lock is None:
            new = slot._replace(state=FREE, gen=slot.gen + 1, req_posts=0, done_posts=0)
            srv2 = srv._replace(confirmed=srv.confirmed - {i})
            bad = None
            if any(row[0] == i for row in srv.rows):
                bad = f"free under a batch: the reaper freed slot {i} while a batch still answers it"
            freed = self.with_server(self.with_slot(s, inc, i, new), inc, srv2)
            self.emit(f"reaper frees slot {i}", freed, bad)


def successors(s: State, b: Bounds, r: Rules) -> list[tuple[str, State, str | None]]:
    step = _Step(s, b, r)
    for t in range(len(s.threads)):
        step.thread(t)
    for h in range(len(s.handles)):
        step.handle(h)
    step.server()
    return step.out


def _final_problems(s: State) -> str | None:
    """In a state where nothing but timeouts can move: a request waiting, an orphan slot, or a
    slot locked for ever by a handle that has nothing more to do."""
    for t, th in enumerate(s.threads):
        if th.pc in IN_REQUEST:
            return f"lost: thread {t}'s request {th.k} waits forever ({th.pc})"
        if th.pc not in ("idle", "finished", "closed", "dead"):
            return f"stuck: thread {t} never gets past {th.pc}"
    if s.live < len(s.slots):
        for i, slot in enumerate(s.slots[s.live]):
            if slot.state != FREE and slot.lock is None:
                return f"orphan: slot {i} is owned by nobody and never freed"
            if slot.lock is not None and all(th.pc in ("finished", "closed", "dead")
                                             for th in s.threads if th.h == slot.lock):  # fmt: skip
                if s.handles[slot.lock].inc == s.live and not s.handles[slot.lock].ended:
                    return f"wedged: slot {i} stays locked by client {slot.lock}, which has no request on it"
    return None


def _owner_problems(s: State) -> str | None:
    for h, hd in enumerate(s.handles):
        if hd.ended:
            continue
        for i in hd.owned:
            if s.slots[hd.inc][i].lock != h:
                return f"two owners: client {h} thinks it owns slot {i}, locked by {s.slots[hd.inc][i].lock}"
    return None


def explore(b: Bounds, r: Rules = Rules(), *, limit: int = 2_000_000) -> int:
    """Visit every reachable state; raise ``Violation`` with the shortest trace to the first
    bad one. Returns the number of states."""
    start = initial(b)
    parent: dict[State, tuple[State | None, str]] = {start: (None, "start")}
    queue = deque([start])

    def trace(s: State, last: str | None = None) -> list[str]:
        steps = [] if last is None else [last]
        while parent[s][0] is not None:
            s, label = parent[s][0], parent[s][1]
            steps.append(label)
        return steps[::-1]

    while queue:
        s = queue.popleft()
        moves = successors(s, b, r)
        for label, nxt, bad in moves:
            if bad is not None:
                raise Violation(bad, trace(s, label))
            if nxt not in parent:
                parent[nxt] = (s, label)
                problem = _owner_problems(nxt)
                if problem:
                    raise Violation(problem, trace(nxt))
                queue.append(nxt)
                if len(parent) > limit:
                    raise RuntimeError(f"more than {limit} states: lower the bounds")
        if not any(not label.startswith("~") for label, _, _ in moves):
            problem = _final_problems(s)
            if problem:
                raise Violation(problem, trace(s))
    return len(parent)


__all__ = ["Bounds", "Rules", "Violation", "explore"]
