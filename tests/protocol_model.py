"""An explicit-state model of the slot protocol, explored breadth-first over every interleaving.

Each actor's steps are the code's steps, one atomic shared-memory, lock or semaphore operation
each (or a run of them that no other actor can observe in between: noted where so). The
comment on each step names the code it mirrors. ``explore`` checks four invariants in every
reachable state:

- no request is answered with another request's audio (``cross-delivery``);
- the server never writes a result into a slot whose claim epoch moved on since it gathered the
  request (``write after free``);
- no two owners of a slot: a slot a client thinks it owns is locked by that client;
- in every state where only timeouts could still move (nothing else is enabled), no request
  waits unanswered (``lost``) and no slot is left owned by nobody and not FREE (``orphan``).

``Rules`` selects the protocol: ``Rules()`` is today's code; the other switches re-introduce
earlier rules, so that tests can show the checker finds the bugs they caused.
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


@dataclass(frozen=True)
class Bounds:
    clients: int = 2
    slots: int = 1
    requests: int = 2
    closes: bool = False  # a client may close its handle at any step (once)
    deaths: bool = False  # a client may be SIGKILLed at any step (once)
    timeouts: bool = False  # a waiting request may time out, or be interrupted (Ctrl-C)
    server_replacements: int = 0  # the server may die and a new one take the name


class Slot(NamedTuple):
    state: int = FREE
    gen: int = 0  # the claim epoch
    lock: int | None = None  # the client whose OFD lock it is
    request: tuple = ()  # (handle, gen, seq, payload) as the client wrote it
    result: tuple = ()  # (handle, gen, seq, payload) as the server wrote it
    req_posts: int = 0
    done_posts: int = 0


class Server(NamedTuple):
    confirmed: frozenset = frozenset()  # req.I taken, not yet gathered
    held: tuple = ()  # (slot, request copy, published) of gathered requests, sorted
    late_posts: frozenset = frozenset()  # Rules.release_before_post: slots released, not rung


class Client(NamedTuple):
    pc: str = "idle"  # idle, claim, submit, wait, finished, closed, dead
    k: int = 0  # the request being made (its payload is (client, k))
    inc: int = 0  # the server incarnation it is attached to
    handle: int = 0
    seq: int = 0  # the attachment's last sequence number (restarts at 1 per attachment)
    slot: int | None = None
    owned: frozenset = frozenset()
    gens: tuple = ()  # (slot, claim epoch) it owns
    warm: tuple = ()  # (slot, claim epoch) of the warm slot it let go of, or ()
    outcomes: tuple = ()  # per request: "ok" or "error"


class State(NamedTuple):
    live: int  # the incarnation serving now; one past the last means none
    slots: tuple  # per incarnation: tuple of Slot
    servers: tuple  # per incarnation: Server
    clients: tuple


class Violation(AssertionError):
    def __init__(self, what: str, trace: list[str]) -> None:
        super().__init__(what + "\n  " + "\n  ".join(trace))
        self.what, self.trace = what, trace


def initial(b: Bounds) -> State:
    incs = b.server_replacements + 1
    return State(0, tuple(tuple(Slot() for _ in range(b.slots)) for _ in range(incs)),
                 tuple(Server() for _ in range(incs)),
                 tuple(Client(handle=_handle(c, 0)) for c in range(b.clients)))  # fmt: skip


def _handle(client: int, inc: int) -> int:
    return 100 * (client + 1) + inc  # a fresh random handle id per attachment


def _set(t: tuple, i: int, v) -> tuple:
    return t[:i] + (v,) + t[i + 1 :]


class _Step:
    """Builds successor states for one state (each method: one actor's step)."""

    def __init__(self, s: State, b: Bounds, r: Rules) -> None:
        self.s, self.b, self.r = s, b, r
        self.out: list[tuple[str, State, str | None]] = []  # (label, next, violation or None)

    def emit(self, label: str, nxt: State, bad: str | None = None, *, timeout: bool = False) -> None:
        """A successor; ``timeout`` marks steps only a deadline takes (label starts with ~)."""
        self.out.append((("~" if timeout else "") + label, nxt, bad))

    # -- helpers -------------------------------------------------------------------------

    def slots(self, inc: int) -> tuple:
        return self.s.slots[inc]

    def with_slot(self, s: State, inc: int, i: int, slot: Slot) -> State:
        return s._replace(slots=_set(s.slots, inc, _set(s.slots[inc], i, slot)))

    def with_client(self, s: State, c: int, client: Client) -> State:
        return s._replace(clients=_set(s.clients, c, client))

    def with_server(self, s: State, inc: int, server: Server) -> State:
        return s._replace(servers=_set(s.servers, inc, server))

    # -- clients (attachment.py, client.py) -------------------------------------------------

    def client(self, c: int) -> None:
        s, cl = self.s, self.s.clients[c]
        if cl.pc in ("finished", "closed", "dead"):
            return
        if cl.pc == "idle":
            nxt = cl._replace(pc="claim") if cl.k < self.b.requests else cl._replace(pc="finished")
            self.emit(f"c{c} next request", self.with_client(s, c, nxt))
        elif cl.pc == "claim":
            self.claim(c, cl)
        elif cl.pc == "submit":
            self.submit(c, cl)
        elif cl.pc == "wait":
            self.wait(c, cl)
        if cl.inc != s.live and cl.pc in ("claim", "submit", "wait"):
            self.gone(c, cl)
        if self.b.closes:
            self.close(c, cl)
        if self.b.deaths:
            self.die(c, cl)

    def claim(self, c: int, cl: Client) -> None:
        # Attachment._claim_or_none + _own: try_lock, re-check FREE, drain done.I and req.I,
        # bump the claim epoch, CLAIMED. One step: all of it happens under the slot's lock,
        # and no other actor acts on a FREE slot's fields (the reaper needs the lock too).
        if cl.warm:
            # Attachment._rewarm: re-take the warm slot's lock; reuse it if still CLAIMED at
            # the same epoch (under the lock: one step, as above).
            i, gen = cl.warm
            slot = self.slots(cl.inc)[i]
            if slot.lock is None and slot.state == CLAIMED and slot.gen == gen:
                nxt = cl._replace(pc="submit", slot=i, seq=cl.seq + 1, owned=cl.owned | {i}, warm=())
                self.emit(f"c{c} re-takes its warm slot {i}",
                          self.with_client(self.with_slot(self.s, cl.inc, i, slot._replace(lock=c)), c, nxt))  # fmt: skip
            cl = cl._replace(warm=())  # or forgets it, and claims like anyone
        for i, slot in enumerate(self.slots(cl.inc)):
            if slot.state != FREE or slot.lock is not None:
                continue
            gen = slot.gen + 1
            new = slot._replace(state=CLAIMED, gen=gen, lock=c, req_posts=0, done_posts=0)
            nxt = cl._replace(pc="submit", slot=i, seq=cl.seq + 1, owned=cl.owned | {i},
                              gens=tuple(sorted((dict(cl.gens) | {i: gen}).items())))  # fmt: skip
            self.emit(f"c{c} claims slot {i} (epoch {gen})",
                      self.with_client(self.with_slot(self.s, cl.inc, i, new), c, nxt))  # fmt: skip

    def submit(self, c: int, cl: Client) -> None:
        # Attachment.submit: payload and identity, state READY, then post req.I.
        slot = self.slots(cl.inc)[cl.slot]
        request = (cl.handle, dict(cl.gens)[cl.slot], cl.seq, (c, cl.k))
        new = slot._replace(state=READY, request=request, req_posts=slot.req_posts + 1)
        self.emit(f"c{c} submits request {cl.k} in slot {cl.slot}",
                  self.with_client(self.with_slot(self.s, cl.inc, cl.slot, new), c, cl._replace(pc="wait")))  # fmt: skip

    def wait(self, c: int, cl: Client) -> None:
        s, slot = self.s, self.slots(cl.inc)[cl.slot]
        if slot.done_posts:
            # Attachment.wait_result: take done.I, then the identity check (``is_answer``).
            taken = slot._replace(done_posts=slot.done_posts - 1)
            mine = (cl.handle, dict(cl.gens)[cl.slot], cl.seq)
            if self.r.seq_only_identity:
                match = len(slot.result) == 4 and slot.result[2] == cl.seq
            else:
                match = slot.result[:3] == mine
            if not match:
                self.emit(f"c{c} skips a stale post in slot {cl.slot}",
                          self.with_slot(s, cl.inc, cl.slot, taken))  # fmt: skip
            else:
                payload = slot.result[3]
                bad = None
                if payload not in ((c, cl.k), ERROR):
                    bad = f"cross-delivery: client {c}'s request {cl.k} got the audio of {payload}"
                # take_result: CLAIMED; give(): quiescent, so the slot stays warm: CLAIMED,
                # its lock dropped (_release); the reaper frees it unless we come back.
                freed = taken._replace(state=CLAIMED, lock=None)
                nxt = cl._replace(pc="idle", k=cl.k + 1, slot=None, owned=cl.owned - {cl.slot},
                                  warm=(cl.slot, dict(cl.gens)[cl.slot]),
                                  outcomes=cl.outcomes + ("ok" if payload != ERROR else "error",))  # fmt: skip
                self.emit(f"c{c} takes the answer to request {cl.k} from slot {cl.slot}",
                          self.with_client(self.with_slot(s, cl.inc, cl.slot, freed), c, nxt), bad)  # fmt: skip
        if self.b.timeouts:
            # wait_result's deadline, a cancelled coroutine, Ctrl-C: let_go (drop the lock,
            # forget the slot; the reaper frees it).
            let_go = slot._replace(lock=None)
            nxt = cl._replace(pc="idle", k=cl.k + 1, slot=None, owned=cl.owned - {cl.slot},
                              outcomes=cl.outcomes + ("error",))  # fmt: skip
            self.emit(f"c{c} times out on request {cl.k} and lets go of slot {cl.slot}",
                      self.with_client(self.with_slot(s, cl.inc, cl.slot, let_go), c, nxt), timeout=True)  # fmt: skip

    def gone(self, c: int, cl: Client) -> None:
        # The server of its attachment stopped serving (probed by lock): retire the attachment
        # (closing its lock descriptor drops every lock in it) and resubmit to the live one.
        s = self.s
        if s.live >= len(s.slots):
            return  # no server at all: the request's own deadline ends it (a timeout)
        old = tuple(sl._replace(lock=None) if sl.lock == c else sl for sl in s.slots[cl.inc])
        s2 = s._replace(slots=_set(s.slots, cl.inc, old))
        nxt = cl._replace(pc="claim", inc=s.live, handle=_handle(c, s.live), seq=0, slot=None,
                          owned=frozenset(), gens=(), warm=())  # fmt: skip
        self.emit(f"c{c} finds its server gone and resubmits request {cl.k}", self.with_client(s2, c, nxt))

    def close(self, c: int, cl: Client) -> None:
        # DecoderClient.close -> Attachment._unmap: free the slots reading CLAIMED (the old
        # rule: CLAIMED or DONE); the lock descriptor closes, dropping every other lock.
        frees = (CLAIMED, DONE) if self.r.close_frees_done else (CLAIMED,)
        new = tuple(
            (sl._replace(state=FREE, lock=None) if sl.state in frees else sl._replace(lock=None))
            if sl.lock == c and i in cl.owned else sl
            for i, sl in enumerate(self.slots(cl.inc))
        )  # fmt: skip
        if cl.warm:
            # _unmap: the warm slot too, re-locked and freed if still CLAIMED at its epoch.
            i, gen = cl.warm
            slot = new[i]
            if slot.lock is None and slot.state == CLAIMED and slot.gen == gen:
                new = _set(new, i, slot._replace(state=FREE))
        s2 = self.s._replace(slots=_set(self.s.slots, cl.inc, new))
        failed = ("error",) if cl.pc in ("claim", "submit", "wait") else ()
        self.emit(f"c{c} closes its handle", self.with_client(
            s2, c, cl._replace(pc="closed", owned=frozenset(), warm=(), outcomes=cl.outcomes + failed)))  # fmt: skip

    def die(self, c: int, cl: Client) -> None:
        # SIGKILL: the kernel drops every lock of the process; nothing else changes.
        new = tuple(sl._replace(lock=None) if sl.lock == c else sl for sl in self.slots(cl.inc))
        s2 = self.s._replace(slots=_set(self.s.slots, cl.inc, new))
        self.emit(f"c{c} is killed", self.with_client(s2, c, cl._replace(pc="dead", owned=frozenset())))

    # -- the server (server.py, slot_io.py) and its reaper ----------------------------------

    def server(self) -> None:
        s = self.s
        inc = s.live
        if inc >= len(s.slots):
            return
        srv, slots = s.servers[inc], s.slots[inc]
        held = {h[0]: h for h in srv.held}
        for i, slot in enumerate(slots):
            # _scan: a READY slot (a hint) not yet confirmed nor held: take req.I.
            if slot.state == READY and i not in srv.confirmed and i not in held and slot.req_posts:
                s2 = self.with_slot(s, inc, i, slot._replace(req_posts=slot.req_posts - 1))
                self.emit(f"server takes req.{i}",
                          self.with_server(s2, inc, srv._replace(confirmed=srv.confirmed | {i})))  # fmt: skip
            if i in srv.confirmed:
                self.gather(inc, i, slot, srv)
            if i in held:
                self.publish_or_ring(inc, i, slot, srv, held[i])
            self.reap(inc, i, slot, srv, held)
        if s.live < len(s.slots) - 1:
            # The server is SIGKILLed (or stops) and the next one takes the name over.
            self.emit("server dies; a new one serves", s._replace(live=s.live + 1))

    def gather(self, inc: int, i: int, slot: Slot, srv: Server) -> None:
        # check_headers + gather: copy the header; not READY -> a stray post, ignored; a stale
        # claim epoch -> an error answer at once (_answer_failure); else BUSY and held.
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
            held = tuple(sorted(srv2.held + ((i, slot.request, False),)))
            self.emit(f"server gathers slot {i}", self.with_server(
                self.with_slot(s, inc, i, slot._replace(state=BUSY)), inc, srv2._replace(held=held)))  # fmt: skip

    def publish_or_ring(self, inc: int, i: int, slot: Slot, srv: Server, entry: tuple) -> None:
        s = self.s
        _, request, published = entry
        rest = tuple(h for h in srv.held if h[0] != i)
        if not published:
            # slot_io.publish: PCM, answer identity (the gathered copy's), state DONE.
            bad = None
            if slot.gen != request[1]:
                bad = f"write after free: the server wrote request {request[3]}'s answer into slot {i} at a later epoch"
            new = slot._replace(state=DONE, result=request)
            if self.r.release_before_post:  # the old order: out of the held set, ring later
                srv2 = srv._replace(held=rest, late_posts=srv.late_posts | {i})
            else:
                srv2 = srv._replace(held=tuple(sorted(rest + ((i, request, True),))))
            self.emit(f"server publishes slot {i}",
                      self.with_server(self.with_slot(s, inc, i, new), inc, srv2), bad)  # fmt: skip
        else:
            # Server._release_and_ring: out of the held set and done.I posted, under the lock
            # the reaper holds.
            new = slot._replace(done_posts=slot.done_posts + 1)
            self.emit(f"server rings slot {i}",
                      self.with_server(self.with_slot(s, inc, i, new), inc, srv._replace(held=rest)))  # fmt: skip

    def reap(self, inc: int, i: int, slot: Slot, srv: Server, held: dict) -> None:
        s = self.s
        if i in srv.late_posts:
            # The old order's post, after the slot already left the held set.
            new = slot._replace(done_posts=slot.done_posts + 1)
            self.emit(f"server rings slot {i} (late)", self.with_server(
                self.with_slot(s, inc, i, new), inc, srv._replace(late_posts=srv.late_posts - {i})))  # fmt: skip
        # Server.reap: a slot not FREE, held by no batch, whose lock is free: bump the epoch,
        # drain its posts, FREE. When it runs (each tick, or at once when a claimer that found
        # no FREE slot asks through the header's ``slot_wanted``) is not modelled: it may run at
        # any step here, which covers both.
        if slot.state != FREE and i not in held and slot.lock is None:
            new = slot._replace(state=FREE, gen=slot.gen + 1, req_posts=0, done_posts=0)
            self.emit(f"reaper frees slot {i}", self.with_server(
                self.with_slot(s, inc, i, new), inc, srv._replace(confirmed=srv.confirmed - {i})))  # fmt: skip


def successors(s: State, b: Bounds, r: Rules) -> list[tuple[str, State, str | None]]:
    step = _Step(s, b, r)
    for c in range(len(s.clients)):
        step.client(c)
    step.server()
    return step.out


def _final_problems(s: State) -> str | None:
    """In a state where nothing but timeouts can move: a request waiting, or an orphan slot."""
    for c, cl in enumerate(s.clients):
        if cl.pc in ("claim", "submit", "wait"):
            return f"lost: client {c}'s request {cl.k} waits forever ({cl.pc})"
    if s.live < len(s.slots):
        for i, slot in enumerate(s.slots[s.live]):
            if slot.state != FREE and slot.lock is None:
                return f"orphan: slot {i} is owned by nobody and never freed"
    return None


def _owner_problems(s: State) -> str | None:
    for c, cl in enumerate(s.clients):
        for i in cl.owned:
            if s.slots[cl.inc][i].lock != c:
                return f"two owners: client {c} thinks it owns slot {i}, locked by {s.slots[cl.inc][i].lock}"
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
