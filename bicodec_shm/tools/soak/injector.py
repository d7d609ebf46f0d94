"""Exceptions injected into the package's code as a signal handler's would land: ``Injected``
and ``Interrupted``, the opcodes after which CPython runs a pending handler, and ``_Injector``,
which raises at a random one of those points of a call (``sys.settrace``). The soak's own
modules are left alone: an exception lands in the package, never in the harness."""

from __future__ import annotations

import contextlib
import dis
import functools
import os
import random
import sys
import threading

# Where injected exceptions land: the package's own code (this harness, every module of the
# soak's folder, excluded), and the standard library's Python code it runs (its locks'
# conditions, its context managers), where a signal lands as well as anywhere.
_HARNESS = os.path.dirname(os.path.abspath(__file__)) + os.sep
_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_INJECTED = (_PACKAGE, threading.__file__, contextlib.__file__)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, as a SIGALRM handler raises it in the middle of a call (the main thread)."""


class Injected(KeyboardInterrupt):
    """An exception at a random bytecode of the package's code, in whichever caller thread
    runs it: what a signal handler raises in the main thread (a SIGALRM deadline, Celery's soft
    time limit), and an asynchronous exception (``PyThreadState_SetAsyncExc``) in any thread."""


# Where CPython runs a pending signal handler (and raises an asynchronous exception): on entry
# to a function or a resumed generator, after a call into C returns, and at a backward jump.
# Nowhere else: not between a store and the next call, and not between a ``with`` block's last
# statement and its ``__exit__`` (no exception can arrive there, so nothing may be asked to
# survive one).
_OP = dis.opmap
_CALLS = {_OP[n] for n in ("CALL", "CALL_FUNCTION", "CALL_FUNCTION_KW", "CALL_METHOD", "CALL_FUNCTION_EX")
          if n in _OP}  # fmt: skip
_PRECALL = _OP.get("PRECALL", -1)  # 3.11: a specialized PRECALL makes the call and skips CALL
_BACKWARD = {_OP[n] for n in ("JUMP_BACKWARD", "JUMP_ABSOLUTE") if n in _OP}


@functools.lru_cache(maxsize=None)
def _next_instruction(code) -> dict[int, int]:
    """Offset of each instruction of ``code`` -> offset of the one after it (caches skipped)."""
    offsets = [i.offset for i in dis.get_instructions(code)]
    return dict(zip(offsets, offsets[1:]))


class _Injector:
    """Runs a call, and for a share of calls raises ``Injected`` at a random one of the points
    where a signal handler's exception could arrive in the package's code while it runs
    (``sys.settrace`` call and opcode events; see ``_CALLS``). So between any two steps of the
    client's state changes, not only where a wait returns. Per thread: ``sys.settrace`` traces
    the calling thread only."""

    def __init__(self, share: float, rng: random.Random) -> None:
        self.share, self.rng = share, rng
        self.passed = 0  # injection points passed in traced calls (how ``_DECODE_POINTS`` was measured)

    def run(self, call, span: int):
        if not self.share or self.rng.random() >= self.share:
            return call()
        left = [self.rng.randrange(1, span)]
        frames_entered = [0]  # Python frames entered so far (a call that entered none was C)

        def point() -> None:
            self.passed += 1
            left[0] -= 1
            if left[0] == 0:
                raise Injected()  # CPython unsets the trace function; the frame raises

        in_finalizer = [0]

        def finalizer(frame, event, arg):
            if event == "return":
                in_finalizer[0] -= 1
            return finalizer

        def enter(frame, event, arg):
            frames_entered[0] += 1
            if frame.f_code.co_name == "__del__":
                # A finalizer the garbage collector runs during the call: an exception there
                # never reaches a caller (Python prints and drops it). Not injected into.
                in_finalizer[0] += 1
                return finalizer
            path = frame.f_code.co_filename
            if in_finalizer[0] or not path.startswith(_INJECTED) or path.startswith(_HARNESS):
                return None
            frame.f_trace_opcodes = True
            code = frame.f_code.co_code
            after = _next_instruction(frame.f_code)
            last = [-1, frames_entered[0]]  # this frame's previous instruction; frames entered then

            def step(frame, event, arg):
                if event == "opcode":
                    at = frame.f_lasti
                    prev, c_call = last[0], frames_entered[0] == last[1]
                    last[0], last[1] = at, frames_entered[0]
                    if prev < 0:
                        return step
                    op = code[prev]
                    # A call into C that *returned* (the next instruction runs, not a handler:
                    # CPython checks for signals on the way out of a call that succeeded only).
                    returned = c_call and (
                        (op in _CALLS and at == after.get(prev))
                        or (op == _PRECALL and at == after.get(after.get(prev, -1))))
                    if returned or op in _BACKWARD:
                        point()
                return step

            point()  # the frame's entry (or its resumption)
            return step

        sys.settrace(enter)
        try:
            return call()
        finally:
            sys.settrace(None)
