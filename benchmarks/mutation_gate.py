"""Mutation gate: plant each of a curated list of plausible bugs, one at a time, and check that
the tests meant to catch it fail.

    python benchmarks/mutation_gate.py                  # every mutant (a few minutes)
    python benchmarks/mutation_gate.py -k int16 -k fork # only mutants whose name contains these
    python benchmarks/mutation_gate.py --list

For each mutant the repository's package, tests, benchmarks and examples are copied into a
temporary directory, the mutant's exact text edits are applied there (each old text must occur
exactly once), and its targeted tests run with ``PYTHONPATH`` and the working directory at the
copy, so that subprocesses the tests start (servers, workers) import the mutated package too.
Verdicts: ``killed`` (the tests failed), ``survived`` (they ran and passed: a hole in the
suite), ``not tested`` (nothing ran: the selection collected no test, or every test it selected
skipped, for a missing permission, tool or device: the mutant was never checked), ``timeout``
(counted as killed: the bug hangs them), ``error`` (the edit did not apply, or pytest could not
run the selection); pytest's JUnit XML report tells passed from skipped. First, unless
``--no-baseline``, the union of the selections runs on an unmutated copy: each must pass (a
selection that fails without any bug would make every verdict "killed", one that only skips
would make it "not tested").

Prints a table (mutant, verdict, seconds) and writes the same as JSON (``--json``). Exits 0 only
if the baseline passed and every mutant was killed: a survivor or a mutant not tested fails it.

Why a curated list rather than mutmut or cosmic-ray: those mutate operators at random across
every line and run the whole selection per mutant, which here means thousands of mutants at
several seconds each (multi-process tests, real shared memory), and most of what they report is
equivalent or uninteresting. Each mutant below is a bug someone could write, or has written (bugs
found and fixed before), paired with the test that must catch it: a survivor names the test
to fix. The list grows with each bug fixed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("bicodec_shm", "tests", "benchmarks", "examples", "docs", "pyproject.toml", "README.md")
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", "out", ".pytest_cache")


@dataclass(frozen=True)
class Mutant:
    """A named bug: ``edits`` are (file, exact old text, new text); ``tests`` pytest arguments."""

    name: str
    why: str
    edits: tuple[tuple[str, str, str], ...]
    tests: tuple[str, ...]
    timeout: float = 180.0


def m(name: str, why: str, file: str, old: str, new: str, *tests: str, timeout: float = 180.0) -> Mutant:
    return Mutant(name, why, ((file, old, new),), tests, timeout)


MUTANTS: tuple[Mutant, ...] = (
    # -- fork, limits, internal errors, squatted names, signals ------------------------------------
    Mutant("f28-3-sem-open-close-release-the-gil",
           "sem_open/sem_close through ctypes.CDLL: a fork inside one leaves glibc's lock held",
           (("bicodec_shm/protocol/semwait.py", "_sem_open = _libc_gil.sem_open",
             "_sem_open = _libc.sem_open"),
            ("bicodec_shm/protocol/semwait.py", "_sem_close = _libc_gil.sem_close",
             "_sem_close = _libc.sem_close")),
           ("tests/test_semwait.py", "-k", "fork_while_threads"), timeout=240.0),
    m("f28-9-early-check-uses-the-last-server-s-limit",
      "decode() refuses what the server last attached could not hold, not what no server could",
      "bicodec_shm/client/decoder_client.py", "max_len=MAX_FRAMES, limit=ANY_SLOT_LIMIT)  # fmt: skip",
      "max_len=self._att.max_tokens if self._att is not None else MAX_FRAMES,\n"
      "                                  limit=ANY_SLOT_LIMIT)  # fmt: skip",
      "tests/test_client_boundary.py", "-k", "larger_max_tokens"),
    m("f28-9-a-stale-attachment-refuses-by-its-limits",
      "a request that does not fit an attachment whose server went away is refused, not resubmitted",
      "bicodec_shm/client/requests.py",
      "        att.check_alive()  # raises Gone (and retires the attachment) if its server went away\n", "",
      "tests/test_client_boundary.py", "-k", "larger_max_tokens"),
    m("f28-10-a-replaced-group-router-raises-gone",
      "a call that picks from a group router another thread retired gets Gone('')",
      "bicodec_shm/client/router.py",
      "            if isinstance(self._closed, Gone):\n"
      "                return None  # replaced (the group under the name changed): the caller looks again\n",
      "", "tests/test_client_boundary.py", "-k", "group-replaced"),
    m("f28-10-re-attach-past-the-deadline",
      "a server that serves but fails every attachment keeps a call re-attaching for ever",
      "bicodec_shm/client/decoder_client.py",
      "        if now >= deadline:\n            raise self._lost_error(exc)\n", "",
      "tests/test_client_boundary.py", "-k", "semaphores_were_removed"),
    m("f28-11-another-user-s-semaphore-stops-the-clean-up",
      "a PermissionsError unlinking another user's semaphore escapes and leaves our objects",
      "bicodec_shm/protocol/names.py",
      "            except posix_ipc.PermissionsError:\n"
      "                pass  # another user's, in the sticky /dev/shm: not ours to remove (create says so)\n",
      "", "tests/test_squatted_names.py", timeout=300.0),
    m("f28-12-snac-s-jit-warning-silenced-as-deprecation-only",
      "only DeprecationWarning filtered: torch 2.14's FutureWarning stops the snac/dac references' import",
      "tests/support.py", 'warnings.filterwarnings("ignore", JIT_DEPRECATED)',
      'warnings.filterwarnings("ignore", JIT_DEPRECATED, DeprecationWarning)',
      "tests/test_snac_model.py", "-k", "jit_deprecation"),
    m("f28-13-readme-servers-inherit-the-run-s-ignored-sigint",
      "the README's servers start with the test run's SIGINT disposition (ignored in `pytest &`)",
      "tests/test_readme.py",
      'argv = [sys.executable, "-c", AT_DEFAULT_SIGINT, "bash", "-c", f"exec {command}"]',
      'argv = ["bash", "-c", f"exec {command}"]',
      "tests/test_readme.py", "-k", "background_command"),
    m("f28-13-sigterm-while-starting-kills-without-clean-up",
      "no stop handlers during start-up: SIGTERM kills serve and leaves the reserved name",
      "bicodec_shm/server/signals.py", "self._restore = on_stop_signals(self._on_signal)",
      "self._restore = lambda: None",
      "tests/test_server_signals.py::test_a_stop_signal_at_any_moment_stops_the_server_promptly_and_"
      "leaves_nothing[name reserved-SIGTERM]",
      "tests/test_server_signals.py::test_the_start_up_s_signal_handling_is_restored_afterwards"),
    m("f28-13-ctrl-c-after-the-segment-exists-leaks-it",
      "an exception after Segment.create in DecoderServer.__init__ leaves the segment behind",
      "bicodec_shm/server/server.py",
      "            )  # fmt: skip\n        except BaseException:\n"
      "            self._teardown()\n            raise\n",
      "            )  # fmt: skip\n        except BaseException:\n            raise\n",
      "tests/test_server_signals.py", "-k", "announces_itself"),
    m("f28-13-interrupted-reservation-left-behind",
      "an interrupt between creating the name and returning it leaves the name's file",
      "bicodec_shm/protocol/names.py", "        _remove_unowned_reservation(name)\n        raise\n",
      "        raise\n", "tests/test_server_signals.py", "-k", "interrupt_between"),
    m("stop-signal-raises-inside-torch-import",
      "a stop signal raises while torch imports, where Python runs inside C++ callbacks and the "
      "exception can end the process in std::terminate, leaving the reserved name",
      "bicodec_shm/tools/cli.py", "            startup.deferred()\n            from ..server.kernel_warmup",
      "            from ..server.kernel_warmup", "tests/test_server_signals.py", "-k", "torch_imports"),
    m("f28-13-no-stack-dump-on-sigusr1", "SIGUSR1 does not print a serving server's stacks",
      "bicodec_shm/tools/cli.py", "    dumps = _register_stack_dumps()\n", "    dumps = False\n",
      "tests/test_server_signals.py", "-k", "sigusr1"),
    # -- the table of mutants ----------------------------------------------------------------------
    m("snake-without-1/alpha", "Snake as x + sin²(αx)", "bicodec_shm/model/modules.py",
      "return torch.addcmul(x, s, (self.alpha + 1e-9).reciprocal()).to(x.dtype)",
      "return (x + s).to(x.dtype)",
      "tests/test_spark_reference.py"),
    m("no-d_vector-after-prenet", "the speaker vector not added after the prenet",
      "bicodec_shm/model/bicodec/decoder.py",
      "x = (self.prenet(z, d, mask) + d[:, :, None]).to(self.dtype)",
      "x = self.prenet(z, d, mask).to(self.dtype)",
      "tests/test_spark_reference.py"),
    m("server-int16-rounds", "the server rounds to int16 instead of truncating",
      "bicodec_shm/server/lanes.py",
      'np.multiply(clipped, np.float32(32767), out=pcm, casting="unsafe")',
      'np.rint(clipped * np.float32(32767), out=clipped)\n        pcm[:] = clipped',
      "tests/test_server.py", "-k", "int16_is_the_seeds"),
    m("stream-int16-rounds", "the stream rounds to int16", "bicodec_shm/client/streaming.py",
      'return scaled.astype("<i2").tobytes()', 'return np.rint(scaled).astype("<i2").tobytes()',
      "tests/test_streaming.py", "-k", "snr_floor_of_each_preset"),
    m("default-preset-no-crossfade", "streaming default with crossfade 0",
      "bicodec_shm/client/stream_settings.py",
      "lookahead=20, crossfade=640", "lookahead=20, crossfade=0",
      "tests/test_streaming.py", "-k", "snr_floor_of_each_preset"),
    m("default-preset-lookahead16-left29", "less lookahead, more left context, same window",
      "bicodec_shm/client/stream_settings.py",
      "left_context=25, lookahead=20, crossfade=640", "left_context=29, lookahead=16, crossfade=640",
      "tests/test_streaming.py", "-k", "snr_floor_of_each_preset"),
    m("padded-tokens-counted-as-tokens", "padded_tokens counts valid tokens",
      "bicodec_shm/server/counters.py",
      "delta = np.array([rows, 1, 0, 0, tokens, rows * longest,",
      "delta = np.array([rows, 1, 0, 0, tokens, tokens,",
      "tests/test_metrics.py", "-k", "known_sequence"),
    m("latency-histogram-fed-queue-times", "one-row batches: latency bins from queue times",
      "bicodec_shm/server/counters.py",
      "N_TIME_BINS + bisect.bisect_left(_BUCKETS, latency)]",
      "N_TIME_BINS + bisect.bisect_left(_BUCKETS, queued)]",
      "tests/test_metrics.py", "-k", "known_sequence"),
    m("latency-histogram-fed-queue-times-batched", "multi-row batches: latency bins from queue times",
      "bicodec_shm/server/counters.py",
      "np.searchsorted(_BUCKETS_NS, latency_ns) + N_TIME_BINS",
      "np.searchsorted(_BUCKETS_NS, queued_ns) + N_TIME_BINS",
      "tests/test_metrics.py", "-k", "known_sequence"),
    m("thread-per-decode_async", "decode_async runs decode in a worker thread",
      "bicodec_shm/client/decoder_client.py",
      '        """``decode`` for asyncio: never blocks the event loop, starts no thread per call."""\n',
      '        """``decode`` for asyncio: never blocks the event loop, starts no thread per call."""\n'
      "        return await asyncio.to_thread(self.decode, semantic_ids, global_ids, dtype=dtype,\n"
      "                                       timeout=timeout)\n",
      "tests/test_client.py", "-k", "200_concurrent"),
    m("no-at-fork-hook", "the client's at-fork hook removed (only the lazy pid check left)",
      "bicodec_shm/client/decoder_client.py",
      "os.register_at_fork(after_in_child=_after_fork_in_child)", "pass  # no at-fork hook",
      "tests/test_client.py", "-k", "at_fork_hook"),
    m("pickle-in-slot_io", "slot_io imports pickle", "bicodec_shm/protocol/slot_io.py",
      "from __future__ import annotations\n", "from __future__ import annotations\n\nimport pickle  # noqa\n",
      "tests/test_public_api.py", "-k", "unpickled"),
    m("eval-in-attachment", "attachment evaluates text", "bicodec_shm/protocol/attachment.py",
      "from __future__ import annotations\n",
      "from __future__ import annotations\n\n_parse = lambda text: eval(text)  # noqa\n",
      "tests/test_public_api.py", "-k", "unpickled"),
    m("liveness-by-proc-pid", "a client judges the server alive by /proc/<server_pid>",
      "bicodec_shm/protocol/segment.py",
      "            return held_elsewhere(fd, SERVING_BYTE)\n        except OSError:",
      "            return os.path.exists(f\"/proc/{int(self.header['server_pid'])}\")\n"
      "        except OSError:",
      "tests/test_deployment.py", "-k", "server_in_another_pid_namespace", timeout=240),
    m("greedy-slot-claims-at-attach", "a handle claims all its slots when it attaches",
      "bicodec_shm/client/decoder_client.py",
      "        return Attachment(self.name, max_slots=self.max_slots, owner_uid=self.owner_uid)",
      "        att = Attachment(self.name, max_slots=self.max_slots, owner_uid=self.owner_uid)\n"
      "        for _ in range(self.max_slots):\n"
      "            att._claim_or_none(att.new_seq())\n"
      "        return att",
      "tests/test_client.py", "-k", "claimed_on_demand"),
    # -- protocol faults found and fixed, each brought back ----------------------------------------
    Mutant("f1-unmap-frees-DONE-slots", "close() frees a slot whose answer is written, not posted",
           (("bicodec_shm/protocol/attachment.py",
             "            for slot in owned:\n                if int(states[slot]) == CLAIMED:",
             "            for slot in owned:\n"
             "                if int(states[slot]) in (CLAIMED, 4):  # 4 is DONE"),),
           ("tests/test_review_findings.py", "-k", "test_1_")),  # fmt: skip
    m("identity-checks-only-seq", "is_answer compares the sequence number only",
      "bicodec_shm/protocol/attachment.py",
      "seg.result_id[slot].tolist() == [self.handle_id, self.generation[slot], seq]",
      "int(seg.result_id[slot][2]) == seq",
      "tests/test_review_findings.py", "-k", "test_1_an_answer"),
    m("f2-submit-time-not-clamped", "a client's t_submit_ns trusted as written",
      "bicodec_shm/protocol/slot_io.py",
      "submitted_ns=_clip(submitted, seen - TRUSTED_QUEUE_NS, seen),",
      'submitted_ns=rows["t_submit_ns"].astype(np.int64),',
      "tests/test_review_findings.py", "-k", "test_2_ or s6_"),
    m("f2-submit-time-not-clamped-one-row", "the single-row path trusts a client's t_submit_ns",
      "bicodec_shm/protocol/slot_io.py",
      "submitted = min(max(t_submit, seen - TRUSTED_QUEUE_NS), seen)",
      "submitted = t_submit",
      "tests/test_review_findings.py", "-k", "test_2_ or s6_"),
    m("f3-ctrl-c-keeps-the-slot", "KeyboardInterrupt in decode skips giving the slot back",
      "bicodec_shm/client/decoder_client.py",
      "            except BaseException:\n                # Ctrl-C, a signal handler's",
      "            except Exception:\n                # Ctrl-C, a signal handler's",
      "tests/test_review_findings.py", "-k", "test_3_4"),
    m("f5-no-refit-to-the-attachment", "a request not re-checked against the server it goes to",
      "bicodec_shm/client/requests.py",
      "if request.checked == att.codec and request.levels[0].shape[0] <= att.max_tokens:",
      "if True:",
      "tests/test_review_findings.py", "-k", "test_5_"),
    m("f6-successor-refused-while-stopping", "a successor refuses a server that is stopping",
      "bicodec_shm/protocol/names.py",
      "serving = held_elsewhere(fd, SERVING_BYTE) and not _stopping(fd)",
      "serving = held_elsewhere(fd, SERVING_BYTE)",
      "tests/test_review_findings.py", "-k", "test_6_"),
    m("f12-free-doorbell-unbounded", "the free doorbell posted on every give-back",
      "bicodec_shm/protocol/segment.py", "if free.value < FREE_BELL_CAP:", "if True:",
      "tests/test_review_findings.py", "-k", "test_12_"),
    m("f14-ring-before-release", "_release_and_ring posts before the slots leave the held set",
      "bicodec_shm/server/server.py",
      "            for slot in (*slots, *moved):\n                self._held.pop(slot, None)\n"
      "            ring(self.segment, slots, bells)",
      "            ring(self.segment, slots, bells)\n"
      "            for slot in (*slots, *moved):\n                self._held.pop(slot, None)",
      "tests/test_review_findings.py", "-k", "test_14_"),
    m("f15-dead-members-counted-up", "group totals count a member that does not serve",
      "bicodec_shm/protocol/group.py",
      'up = [m for m in members if "requests" in m and m.get("server_alive")]',
      'up = [m for m in members if "requests" in m]',
      "tests/test_review_findings.py", "-k", "test_15_"),
    # -- waiting for a slot, waiting without a bell ------------------------------------------------
    m("claim-waits-for-the-reap-tick", "the server ignores a claimer that asks for a slot: idle "
      "handles' warm slots come back only at the reaper's next tick",
      "bicodec_shm/server/server.py",
      "        elif asked:\n            self.reap(asked=True)\n",
      "",
      "tests/test_waiting_latency.py", "-k", "without_waiting_for_the_reaper_tick"),
    m("claimer-never-asks-for-a-slot", "a claimer that finds no FREE slot sleeps on `free` without telling "
      "the server", "bicodec_shm/protocol/slot_waits.py",
      "            self.asked.append(_ask_for_a_slot(seg))\n            seg.wait(seg.free, timeout)",
      "            seg.wait(seg.free, timeout)",
      "tests/test_waiting_latency.py", "-k", "without_waiting_for_the_reaper_tick and sync"),
    m("no-bell-polls-at-the-slice", "_claim_bell returns NO_BELL but leaves self.bell None: the waiter "
      "sleeps whole 100 ms slices", "bicodec_shm/protocol/async_answers.py",
      "                self.bell = NO_BELL\n                return NO_BELL",
      "                return NO_BELL",
      "tests/test_waiting_latency.py", "-k", "no_bell"),
    m("attach-leaks-ExistentialError", "a segment unlinked between the lock open and the mapping's "
      "open raises posix_ipc's ExistentialError to the caller", "bicodec_shm/protocol/segment.py",
      "        except posix_ipc.ExistentialError:  # unlinked since our lock descriptor's open (a restart)\n",
      "        except ZeroDivisionError:  # unlinked since our lock descriptor's open (a restart)\n",
      "tests/test_attach_races.py"),
    m("slot-wait-on-a-condition", "waiting for one of the handle's own slots with threading.Condition.wait "
      "on the handle's lock: a signal handler's exception inside it releases that lock twice",
      "bicodec_shm/protocol/slot_waits.py",
      "        with self.lock:\n            waiter = self.line.get(seq)\n"
      "        if waiter is not None and waiter.lock is not None:\n"
      "            waiter.lock.acquire(timeout=timeout)\n",
      "        with self.lock:\n            if self.line.get(seq) is not None:\n"
      "                __import__('threading').Condition(self.lock).wait(timeout)\n",
      "tests/test_signal_waits.py", "-k", "any_point"),
    m("lane-tuner-keeps-the-slower", "the lane tuner settles on the arrangement measured slower",
      "bicodec_shm/server/lane_tuner.py",
      "best = min(means, key=means.__getitem__)\n        incumbent = self._incumbent",
      "best = max(means, key=means.__getitem__)\n        incumbent = self._incumbent",
      "tests/test_lane_tuner.py"),
    m("fixed-lanes-still-tuned", "--lanes N is overridden by the tuner",
      "bicodec_shm/server/lane_control.py",
      "if lanes is None and tunable and len(candidates) > 1:",
      "if tunable and len(candidates) > 1:",
      "tests/test_lane_tuner.py", "-k", "fixed"),
    # -- threads sharing a handle, exceptions between steps, lanes' finish -------------------------
    m("f28-1-release-outside-the-claim-lock", "slots given back and the warm one let go of without the "
      "claim lock: another thread of the handle re-takes a lock about to be dropped",
      "bicodec_shm/protocol/attachment.py",
      "            with self.claim_lock, self.use() as seg:\n                with self.lock:\n"
      "                    if self.using or self.claimers or not self.owned:",
      "            with self.use() as seg:\n                with self.lock:\n"
      "                    if self.using or self.claimers or not self.owned:",
      "tests/test_client.py", "-k", "never_own_an_unlocked_slot"),
    m("f28-1-let-go-outside-the-claim-lock", "let_go drops its lock outside the claim lock: a claim "
      "settles and takes the slot first, and the late unlock drops the claimer's lock",
      "bicodec_shm/protocol/attachment.py",
      "        with self.claim_lock:\n            with self.lock:\n"
      "                if self.retired is not None or self.using.get(slot) != seq:",
      "        if True:\n            with self.lock:\n"
      "                if self.retired is not None or self.using.get(slot) != seq:",
      "tests/test_client.py", "-k", "never_own_an_unlocked_slot"),
    m("f28-4-try-after-take-slot", "the request's cleanup begins only after take_slot returned",
      "bicodec_shm/client/decoder_client.py",
      "            try:\n                slot, _ = att.take_slot(deadline, seq)\n",
      "            slot, _ = att.take_slot(deadline, seq)\n            try:\n",
      "tests/test_client.py", "-k", "any_bytecode"),
    m("f28-4-lock-before-books", "a claim locks a slot before recording it: an exception in between "
      "leaves it locked and owned by no request",
      "bicodec_shm/protocol/attachment.py",
      "                        self.loose.add(slot)  # first: from here its lock may be ours\n"
      "                        if not seg.try_lock_slot(slot):",
      "                        if not seg.try_lock_slot(slot):",
      "tests/test_client.py", "-k", "any_bytecode"),
    m("f28-5-finish-unholds-by-number", "a lane's finish takes its batch's slots out of the held set "
      "by number, also where another lane holds them again",
      "bicodec_shm/server/server.py",
      "                if self._held.get(slot) == seen:\n                    del self._held[slot]",
      "                self._held.pop(slot, None)",
      "tests/test_server.py", "-k", "never_unholds_a_slot_another_lane_holds"),
    m("stale-confirmed-row-kept", "a slot batched and confirmed again keeps its old checked row too",
      "bicodec_shm/server/server.py",
      "if confirmed.get(s) == t]",
      "if s in confirmed]",
      "tests/test_dispatch.py"),
    # -- wrong audio, fork hangs, tuner and claims, each brought back ------------------------------
    Mutant("i28-2-host-launches-share-one-buffer", "a host-output asynchronous decoder's launches "
           "convert at launch into one shared buffer (batch k overwrites k-1's unpublished audio)",
           (("bicodec_shm/server/lanes.py",
             "return _InFlight(batch, None, t0, event, finish=convert)",
             "return _InFlight(batch, convert(), t0, event)"),
            ("bicodec_shm/server/lanes.py",
             "pinned, host = self._pinned[self._flip], self._host[self._flip]",
             "pinned, host = self._pinned[self._flip], self._host[0]")),
           ("tests/test_lanes.py", "-k", "pipelined_host_output")),  # fmt: skip
    m("i28-2-host-output-converted-at-launch", "a host output converted before its event completes",
      "bicodec_shm/server/lanes.py",
      "return _InFlight(batch, None, t0, event, finish=convert)",
      "return _InFlight(batch, convert(), t0, event)",
      "tests/test_lanes.py", "-k", "host"),
    m("i28-2-host-launches-in-flight-share-buffers", "two host launches in flight convert into one set",
      "bicodec_shm/server/lanes.py",
      "pinned, host = self._pinned[self._flip], self._host[self._flip]",
      "pinned, host = self._pinned[self._flip], self._host[0]",
      "tests/test_lanes.py", "-k", "host"),
    m("i28-6-tuner-assumes-every-lane-busy", "the lane tuner scores decode time / tokens / lanes",
      "bicodec_shm/server/lane_tuner.py",
      "return sum(s.share_ns for s in self.samples) / 1e9 / tokens if",
      "return sum(s.decode_ns for s in self.samples) / 1e9 / tokens / self.lanes if",
      "tests/test_lane_tuner.py", "-k", "load_it_sees or one-client"),
    m("i28-6-busy-time-not-shared", "decodes running at once each count the whole time",
      "bicodec_shm/server/lane_tuner.py",
      "self._shared += (now - self._at) / self._running",
      "self._shared += now - self._at",
      "tests/test_lane_tuner.py", "-k", "share or load_it_sees"),
    m("i28-6-server-gives-no-share", "the server gives the tuner each batch's decode time, not its share",
      "bicodec_shm/server/lane_tuner.py",
      "return BatchSample(planned_ns, start_ns, self._clock(), tokens, rows, padded_tokens, share, queued)",
      "return BatchSample(planned_ns, start_ns, self._clock(), tokens, rows, padded_tokens, None, queued)",
      "tests/test_lane_tuner.py", "-k", "narrow"),
    m("load-read-without-the-queue", "the lane tuner reads load only from batches side by side, "
      "not from requests waiting behind one lane",
      "bicodec_shm/server/lane_tuner.py",
      "return max(at_once, float(sample.queued))", "return at_once",
      "tests/test_lane_tuner.py", "-k", "queued"),
    m("server-counts-no-queue", "the server does not tell the tuner how many requests a plan found",
      "bicodec_shm/server/server.py",
      "batch.queued = len(everything)", "batch.queued = 0",
      "tests/test_lane_tuner.py", "-k", "one-row-batches"),
    m("load-read-on-narrow-lanes", "a fresh CPU server reads its load on two one-thread lanes, so "
      "one client's first requests decode on half the cores",
      "bicodec_shm/server/lane_control.py",
      "            lanes = candidates[0]\n", "            lanes = min(2, candidates[-1])\n",
      "tests/test_lane_tuner.py", "-k", "fresh_server"),
    m("lanes-only-up-to-the-cores", "the lane tuner never tries more lanes than cores",
      "bicodec_shm/server/lane_control.py",
      "if c <= LANES_PER_CORE * cores]", "if c <= cores]",
      "tests/test_lane_tuner.py", "-k", "fresh_server or settles"),
    m("short-batches-share-the-cores", "load predicts more lanes than cores behind batches of a few ms",
      "bicodec_shm/server/lane_tuner.py",
      "if self._cores is None or self._longest_ns >= LONG_BATCH_S * 1e9:", "if True:",
      "tests/test_lane_tuner.py", "-k", "share_the_cores or fresh_server"),
    m("long-batches-never-share-the-cores", "load predicts only lanes of a core each, behind batches "
      "of seconds",
      "bicodec_shm/server/lane_tuner.py",
      "self._longest_ns >= LONG_BATCH_S * 1e9", "self._longest_ns >= float('inf')",
      "tests/test_lane_tuner.py", "-k", "share_the_cores or long_batch"),
    m("long-batch-in-the-hold-ignored", "a long batch after the prediction changes nothing until the "
      "first exploration",
      "bicodec_shm/server/lane_tuner.py",
      "            return None\n        self._longest_ns = max(self._longest_ns, sample.decode_ns)\n"
      "        at_once = _load_of(sample)",
      "            return None\n        at_once = _load_of(sample)",
      "tests/test_lane_tuner.py", "-k", "long_batch"),
    m("long-batch-alone-shares-the-cores", "in the first hold a long batch without load still turns "
      "lanes of a core each into the most",
      "bicodec_shm/server/lane_tuner.py",
      "        if at_once <= LOADED:\n            return None\n        lanes = self._loaded_lanes()",
      "        lanes = self._loaded_lanes()",
      "tests/test_lane_tuner.py", "-k", "long_batch"),
    # -- CPU lanes' traced graphs (model/traced.py) -------------------------------------------------
    m("qwen3-lanes-decode-eagerly", "Qwen3-TTS's CPU lanes decode every window eagerly (the GIL taken "
      "turn about)",
      "bicodec_shm/model/qwen3_tts/serving.py",
      "        self.window_decoder = cpu_lane_graphs(", "        self.window_decoder = None and (",
      "tests/test_traced.py", "-k", "qwen3"),
    m("graph-built-but-not-run", "the graph is traced and the eager forward still runs",
      "bicodec_shm/model/traced.py",
      "        if graph is None:\n            return self.module(*tensors)",
      "        if graph is not None:\n            return self.module(*tensors)",
      "tests/test_traced.py", "-k", "without_the_modules_python"),
    m("graph-failure-fails-the-request", "a graph that fails at run time fails the batch instead of "
      "decoding it eagerly",
      "bicodec_shm/model/traced.py",
      "            self._give_up(f\"its graph failed",
      "            raise\n            self._give_up(f\"its graph failed",
      "tests/test_traced.py", "-k", "run_time"),
    m("snac-graph-ignores-its-branch", "one SNAC graph for every length, whether it fills the "
      "attention's windows or not",
      "bicodec_shm/model/snac/serving.py",
      "        return TracedForward(self, key=self.branch)", "        return TracedForward(self)",
      "tests/test_traced.py", "-k", "snac or branch"),
    m("padded-snac-batch-through-the-graph", "a padded SNAC batch takes the graph without its mask",
      "bicodec_shm/model/snac/decoder.py",
      "        if unpadded_forward is not None and shortest == frames:",
      "        if unpadded_forward is not None:",
      "tests/test_traced.py", "-k", "snac"),
    m("each-lane-traces-its-own", "every lane's adapter traces graphs of its own",
      "bicodec_shm/model/traced.py",
      "        if graphs is None:\n            graphs = owner.__dict__",
      "        if True:\n            graphs = owner.__dict__",
      "tests/test_traced.py", "-k", "share"),
    m("two-lanes-trace-at-once", "lanes that call at once each trace a graph",
      "bicodec_shm/model/traced.py",
      "            if branch in self.graphs or self.failed:\n"
      "                return self.graphs.get(branch)\n", "",
      "tests/test_traced.py", "-k", "trace_once"),
    m("trace-counted-as-a-batch-cost", "a batch that traced a graph feeds the batch cost fit",
      "bicodec_shm/server/server.py", "if decoded.device_ns and not batch.warmup_ns:",
      "if decoded.device_ns:", "tests/test_traced.py", "-k", "traced_a_graph"),
    m("trace-read-by-the-lane-tuner", "a batch that traced a graph is a sample of the lane tuner "
      "(a long batch: lanes that share the cores)", "bicodec_shm/server/lane_control.py",
      "if sample is None or batch.warmup_ns or threads", "if sample is None or threads",
      "tests/test_traced.py", "-k", "traced_a_graph"),
    m("trace-wait-not-warm-up", "a lane waiting for another lane's trace counts no warm-up",
      "bicodec_shm/model/traced.py",
      "        finally:  # the lock's wait counts too: the batch waited for a trace either way\n"
      "            _WARMUP.ns = getattr(_WARMUP, \"ns\", 0) + time.perf_counter_ns() - t0",
      "        finally:\n            pass",
      "tests/test_traced.py", "-k", "warm_up"),
    m("bicodec-lanes-eager", "a BiCodec server's CPU lanes decode eagerly (no graph: they take turns "
      "on the GIL)", "bicodec_shm/server/adapters.py",
      "        if self.unpadded_forward is None:\n", "        if True:\n",
      "tests/test_traced.py", "-k", "bicodec_servers_cpu_lanes"),
    m("bicodec-graph-on-padded-rows", "a padded BiCodec batch goes through the unpadded graph (no mask)",
      "bicodec_shm/model/bicodec/decoder.py", "if unpadded_forward is not None and lens is None:",
      "if unpadded_forward is not None:", "tests/test_traced.py", "-k", "bicodec_batches"),
    m("stopping-phase-not-copied-to-the-name", "stop() marks STOPPING in the memfd only: a rolling "
      "restart's successor under --mode 0o660 reads SERVING in the name's object and exits",
      "bicodec_shm/protocol/segment.py", "            self.header[\"phase\"] = Phase.STOPPING\n"
      "            self._copy_header()\n\n    def stop_serving",
      "            self.header[\"phase\"] = Phase.STOPPING\n\n    def stop_serving",
      "tests/test_review_findings.py", "-k", "successor_waits_for_a_server_that_finishes"),
    # -- the encode direction (audio in, codes back) ---------------------------------------------
    m("qwen3-loader-loads-upstreams-tokenizer", "install_loader leaves qwen-tts's tokenizer class in "
      "place: from_pretrained loads its weights", "bicodec_shm/integrations/qwen3_tts.py",
      "    target.Qwen3TTSTokenizer = SharedTokenizerLoader\n", "",
      "tests/test_qwen3_tts_encode_serving.py", "-k", "install_loader_makes"),
    m("bicodec-resampled-at-hq", "a clip at another rate is resampled for BiCodec at soxr's HQ, not "
      "Spark-TTS's VHQ", "bicodec_shm/codecs/resample.py", 'SOXR_VHQ = Resampling("VHQ")',
      'SOXR_VHQ = Resampling("HQ")', "tests/test_encode_resample.py", "-k", "spark_tts_resampled_clip"),
    m("qwen3-resampled-without-librosas-length", "a clip resampled for Qwen3-TTS keeps soxr's length, "
      "not librosa's ceil(n * 24000 / sr)", "bicodec_shm/codecs/resample.py",
      'LIBROSA = Resampling("HQ", fixed_length=True)', 'LIBROSA = Resampling("HQ")',
      "tests/test_encode_resample.py", "-k", "qwen_tts_resampled_clip"),
    m("encode-rows-batched-with-decodes", "a plan takes encode and decode rows into one forward pass",
      "bicodec_shm/server/encoding.py", "    if not encodes.any():\n        return ready, False",
      "    if True:\n        return ready, False", "tests/test_encode.py", "-k", "apart_from_decodes"),
    m("encode-without-an-encoder", "a server without --encode takes an encode request as a decode",
      "bicodec_shm/protocol/slot_io.py", 'if int(row["flags"]) & FLAG_ENCODE and not layout.encodes:',
      "if False:", "tests/test_encode.py", "-k", "hostile"),
    # -- batching and dispatch measured on the live traffic ----------------------------------------
    m("join-always-pays", "a row joins a batch whatever the measured costs say",
      "bicodec_shm/server/batch_costs.py",
      "        return grown < self.lone_ns(length)", "        return True",
      "tests/test_batch_costs.py", "-k", "near_equal or alone or join_rule"),
    m("join-ignores-padding", "a longer row's padding of the others is not charged",
      "bicodec_shm/server/batch_costs.py",
      "grown = self.batch_ns(rows + 1, max(longest, length)) - self.batch_ns(rows, longest)",
      "grown = self.batch_ns(rows + 1, longest) - self.batch_ns(rows, longest)",
      "tests/test_batch_costs.py", "-k", "near_equal or join_rule"),
    m("cpu-batches-unbounded", "a CPU lane batches every row that pays, however long its rows wait",
      "bicodec_shm/server/server.py", "latency_bound=not device_like", "latency_bound=False",
      "tests/test_batch_costs.py", "-k", "bounds_its_batches or twice"),
    m("device-batches-bounded", "a device's batches are held to a CPU lane's latency bound",
      "bicodec_shm/server/server.py", "latency_bound=not device_like", "latency_bound=True",
      "tests/test_batch_costs.py", "-k", "bounds_its_batches"),
    m("bound-skipped-when-every-row-fits", "the latency bound is not checked when every ready row fits",
      "bicodec_shm/server/batching.py", "        and (within is None or within(n, longest))\n", "",
      "tests/test_batch_costs.py", "-k", "twice"),
    m("bound-from-the-last-row", "the latency bound is read off the row due last, not the most urgent",
      "bicodec_shm/server/batch_costs.py",
      "urgent = int(np.lexsort((np.arange(len(due_ns)), due_ns))[0])",
      "urgent = int(np.lexsort((np.arange(len(due_ns)), due_ns))[-1])",
      "tests/test_batch_costs.py", "-k", "twice"),
    m("batching-static-still-measured", "batching='static' is narrowed by the measurement anyway",
      "bicodec_shm/server/server.py", 'measured=batching == "auto"', "measured=True",
      "tests/test_batch_costs.py", "-k", "batching_static"),
    m("no-probes", "once batching does not pay, no batch is ever tried again",
      "bicodec_shm/server/batch_costs.py",
      "if len(chosen) == 1 and self.costs.wants_probe(key):", "if False:",
      "tests/test_batch_costs.py", "-k", "probe"),
    m("one-lane-takes-everything", "a free CPU lane plans every ready request, the other idles",
      "bicodec_shm/server/server.py", "if self._pipeline or self.lanes < 2:", "if True:",
      "tests/test_batch_costs.py", "-k", "side_by_side"),
    m("dispatch-idle-not-charged", "waiting for the clients is judged as if the device never idled",
      "bicodec_shm/server/dispatch_policy.py",
      "idle = turnaround + (host if self.pipelined else 0.0)", "idle = 0.0",
      "tests/test_dispatch_policy.py", "-k", "turnaround or small_fixed"),
    m("dispatch-votes-where-no-row-joins", "a batch no joining row could grow votes against waiting",
      "bicodec_shm/server/dispatch_policy.py",
      "        if len(merged) <= len(first):\n", "        if False:\n",
      "tests/test_dispatch_policy.py", "-k", "without_a_vote"),
    m("dispatch-flag-overridden", "dispatch='pipeline' or 'wait' is overridden by the measurement",
      "bicodec_shm/server/dispatch_policy.py", 'if self.mode != "auto":', "if False:",
      "tests/test_dispatch_policy.py", "-k", "fixed_dispatch or dispatch_pipeline"),
    m("pipelined-lane-never-waits", "the dispatcher never tells a pipelined lane to wait",
      "bicodec_shm/server/server.py",
      "if running is not None and self._wants_wait(ready, running.lengths.tolist(), key):",
      "if False:",
      "tests/test_dispatch_policy.py", "-k", "large_fixed_cost_waits_and"),
    # -- DAC ---------------------------------------------------------------------------------------
    m("dac-stage-length-times-stride", "DAC's masks take frames x upsampling as each stage's length "
      "(a stride-5 block gives 5L - 1 steps)", "bicodec_shm/model/dac/config.py",
      "lengths.append((lengths[-1] + 1) * s - 2 * math.ceil(s / 2))",
      "lengths.append(lengths[-1] * s)",
      "tests/test_dac_model.py", "-k", "tiny_batched or tiny_matches"),
    m("dac-mask-keeps-one-padded-step", "DAC's stage mask lets each row's first padded step through",
      "bicodec_shm/model/dac/layers.py",
      "valid = steps[None, :] < lens[:, None]  # (B, n - low)",
      "valid = steps[None, :] <= lens[:, None]  # (B, n - low)",
      "tests/test_dac_model.py", "-k", "tiny_batched"),
    m("fit-validates-every-request-again", "a request checked against its codec is checked again "
      "in full against the attachment that sends it", "bicodec_shm/client/requests.py",
      "    if request.checked == att.codec and request.levels[0].shape[0] <= att.max_tokens:\n"
      "        return\n", "",
      "tests/test_snac_serving.py", "-k", "validated_once"),
    m("dia-delay-off-by-one", "Dia's codebook c read one row late",
      "bicodec_shm/codecs/dia.py",
      "index = np.arange(frames)[None, :] + np.asarray(delays)[:, None]",
      "index = np.arange(frames)[None, :] + np.asarray(delays)[:, None] + (np.asarray(delays)[:, None] > 0)",
      "tests/test_dac_serving.py", "-k", "dia_rows"),
    # -- idle expiry apart from reclaimed slots ----------------------------------------------------
    m("reaper-counts-idle-expiry-as-reclaimed", "the reaper counts an idle handle's warm slot as "
      "reclaimed, like a dead client's (stats reads like a leak under healthy traffic)",
      "bicodec_shm/server/reaping.py",
      'idle = state == CLAIMED and int(f["owner_pid"][slot]) == 0', "idle = False",
      "tests/test_server.py", "-k", "expired_not_reclaimed"),
    m("rewarmed-slot-keeps-owner-pid-zero", "a handle that re-takes its warm slot leaves owner_pid 0: "
      "dying with it then counts as an idle expiry", "bicodec_shm/protocol/attachment.py",
      '            f["owner_pid"][slot] = os.getpid()  # held again (``_release`` zeroed it)\n', "",
      "tests/test_server.py", "-k", "comes_back_before_the_reap"),
    # -- the Orpheus drop-in on vLLM's items, what each preset gives ---------------------------------
    m("orpheus-item-read-as-its-last-token", "each streamed item adds only the last <custom_token_N> "
      "it holds, as Orpheus reads it (a merged vLLM step loses tokens)",
      "bicodec_shm/integrations/orpheus_tts.py", "for match in _CUSTOM_TOKEN.finditer(text):",
      "for match in list(_CUSTOM_TOKEN.finditer(text))[-1:]:",
      "tests/test_orpheus_vllm_items.py", "-k", "merged_item_adds_every_token"),
    m("orpheus-repeated-item-read-again", "every item read as a delta: vLLM's repeated last item "
      "(cumulative text) adds its tokens again",
      "bicodec_shm/integrations/orpheus_tts.py",
      "whole = item.startswith(was.text)  # the whole text so far (an equal item adds nothing)",
      "whole = False",
      "tests/test_orpheus_vllm_items.py", "-k", "repeated_last_item"),
    m("orpheus-split-token-dropped", "an unclosed <custom_token_... at an item's end is dropped, "
      "not read with the next item's text",
      "bicodec_shm/integrations/orpheus_tts.py", "rest=_unclosed(text[end:]),", 'rest="",',
      "tests/test_orpheus_vllm_items.py", "-k", "read_as_text_wherever"),
    m("orpheus-only-an-items-first-token-checked", "a merged item's later tokens are not checked "
      "against their positions: a bad one is decoded",
      "bicodec_shm/integrations/orpheus_tts.py",
      "                self._check(was.audio_tokens + len(audio), digits)\n",
      "                if not audio:\n"
      "                    self._check(was.audio_tokens + len(audio), digits)\n",
      "tests/test_orpheus_vllm_items.py", "-k", "bad_token_in_a_merged_item"),
    m("orpheus-windows-of-an-item-in-one-chunk", "the orpheus preset yields one chunk for all the "
      "windows one item completes, not one chunk per window as Orpheus",
      "bicodec_shm/integrations/orpheus_tts.py",
      "chunks = [_orpheus_slice(self._decode(*w)) for w in self._reading.todo]",
      'chunks = [b"".join(_orpheus_slice(self._decode(*w)) for w in self._reading.todo)]',
      "tests/test_orpheus_vllm_items.py", "-k", "play_every_frame_of_their_text and orpheus-sync"),
    m("orpheus-docs-default-yields-orpheus-chunks", "the integrations page says the default preset "
      "yields Orpheus's chunks, as only preset=\"orpheus\" does",
      "docs/integrations.md",
      "other chunks and 3 more frames (0, n-2, n-1); 15 dB SNR on the frames both play |",
      "Orpheus's chunks, within 1 int16 step |",
      "tests/test_orpheus_tts.py", "-k", "integrations_page_says"),
    # -- the gate's verdicts, and a stop's bound ---------------------------------------------------
    m("stop-s-wake-up-taken-by-the-drain", "the dispatcher sleeps on the doorbell after a scan that "
      "drained stop()'s post: the server ends only at the reap tick",
      "bicodec_shm/server/server.py",
      "                if self._stop.is_set():  # a stop since the loop's check: its post went in the\n",
      "                if False:  # a stop since the loop's check: its post went in the\n",
      "tests/test_server.py", "-k", "drain_takes", timeout=120.0),
    m("stop-leaves-parked-lanes-asleep", "stop() does not wake the lanes the tuner parked: they see "
      "it at their next poll (reap_interval)", "bicodec_shm/server/server.py",
      "        self._lanes.wake()  # parked lanes look at the stop now, not at their next poll\n", "",
      "tests/test_server.py", "-k", "tuner_parked", timeout=120.0),
    m("a-selection-that-only-skipped-survives", "the gate reads pytest's exit 0 as survived when "
      "every selected test skipped", "benchmarks/mutation_gate.py",
      'return "survived" if outcomes(junit_xml)["passed"] > 0 '  # (split: this file holds the text once)
      'else "not tested"', 'return "survived"',
      "tests/test_mutation_gate.py", "-k", "not_tested"),
    m("ci-skips-the-tests-of-an-unprivileged-user", "under CI, no Python for uid 1000 skips the "
      "tests instead of failing them", "tests/support.py", "    if in_ci():\n        pytest.fail(",
      "    if False:\n        pytest.fail(", "tests/test_unprivileged_python.py", "-k", "under_ci"),
    # -- a stream's windows and a long utterance fit the attached server's --max-tokens ----------
    m("stream-windows-sized-by-the-codec-default", "a DecodeStream over a client plans windows for "
      "the codec's default 1500 tokens, not its server's --max-tokens (200: 'split the request' for "
      "good)", "bicodec_shm/client/streaming.py",
      'limit = getattr(self._decoder, "max_tokens", None) if not self._in_process else None',
      "limit = None", "tests/test_stream_limits.py", "-k", "plans_its_windows_from"),
    m("stream-keeps-windows-a-restarted-server-refuses", "a window refused as too long by a server "
      "restarted with a smaller --max-tokens is not planned again: the stream raises for good",
      "bicodec_shm/client/streaming.py", "        return self._limit() != limit\n",
      "        return False\n", "tests/test_stream_limits.py", "-k", "between and plan"),
    m("stream-settings-not-fitted-to-a-small-limit", "a limit below one window's context + chunk + "
      "lookahead leaves every window too long for the server",
      "bicodec_shm/client/streaming.py", "        s = self.settings.fitted(limit)\n",
      "        s = self.settings\n", "tests/test_stream_limits.py", "-k", "every_limit or 150"),
    m("stream-blends-more-tail-than-the-window-decodes", "after a restart to a tiny limit the held "
      "crossfade tail is blended with samples before the window's start (negative slice)",
      "bicodec_shm/client/streaming.py", "blend = min(len(tail), start)", "blend = len(tail)",
      "tests/test_stream_limits.py", "-k", "every_limit"),
    m("client-limit-of-a-server-that-went-away", "DecoderClient.max_tokens answers for the server "
      "it attached last even after a restart with another limit (a stream plans for the old one)",
      "bicodec_shm/client/decoder_client.py",
      "if self._group is None and att is not None and att.retired is None and not att.serving():",
      "if False:", "tests/test_stream_limits.py", "-k", "1500 and pushes"),
    m("group-limit-of-its-largest-member", "a group handle's max_tokens is its largest member's: "
      "a window planned for it is refused by the others", "bicodec_shm/client/router.py",
      "return min(limits, default=None)", "return max(limits, default=None)",
      "tests/test_client_boundary.py", "-k", "least_members"),
    m("long-row-sent-whole", "SharedAudioTokenizer sends a 3000-token row as one request: 'more "
      "than the 1500 a slot holds'", "bicodec_shm/client/long_requests.py",
      "    if n <= limit:\n        return [(0, 0, n, n)]\n", "    return [(0, 0, n, n)]\n",
      "tests/test_spark_tts.py", "tests/test_long_requests.py", "-k", "3000"),
    m("long-row-context-short-of-the-receptive-field", "a long row's windows carry 16 tokens of "
      "context, under the model's receptive field", "bicodec_shm/client/long_requests.py",
      "context: int = RECEPTIVE_FIELD)", "context: int = RECEPTIVE_FIELD // 4)",
      "tests/test_spark_tts.py", "tests/test_long_requests.py", "-k", "3000 or tile"),
    Mutant("long-row-windows-one-after-another", "a long row's windows are sent one at a time: "
           "they never batch", (("bicodec_shm/client/long_requests.py",
                                 "for i in range(1, len(calls))]", "for i in range(0)]"),
                                ("bicodec_shm/client/long_requests.py", "            run(0)\n",
                                 "            for i in range(len(calls)):\n                run(i)\n")),
           ("tests/test_spark_tts.py", "-k", "3000"), timeout=120.0),
    m("long-row-keeps-windows-a-restarted-server-refuses", "a long row planned for a server "
      "restarted with a smaller --max-tokens is refused for good",
      "bicodec_shm/client/long_requests.py",
      "            if client.max_tokens != limit:\n"
      "                continue  # the server was replaced by one with another limit: plan for it\n",
      "            if False:\n                continue\n",
      "tests/test_spark_tts.py", "-k", "planned_again"),
    Mutant("spark-bfloat16-escapes-as-a-type-error", "a bfloat16 tensor reaches .numpy(), whose "
           "TypeError reaches the caller", (("bicodec_shm/integrations/inputs.py",
                                            'if getattr(dtype, "is_floating_point", False) or '
                                            'getattr(dtype, "is_complex", False):', "if False:"),
                                           ("bicodec_shm/integrations/inputs.py",
                                            "except (TypeError, RuntimeError) as exc:",
                                            "except RuntimeError as exc:")),
           ("tests/test_spark_tts.py", "-k", "any_other_dtype")),
    m("receptive-field-misses-the-sampling-stages", "the receptive field counts only the main "
      "backbone's convs (prenet reach 39, not 57)", "bicodec_shm/model/bicodec/config.py",
      "stages = len(p.sample_ratios) * (1 + SAMPLING_BACKBONE_LAYERS) + 1 + p.vocos_num_layers",
      "stages = 1 + p.vocos_num_layers", "tests/test_model.py", "-k", "receptive"),
    # -- codec claims: DAC's own length, another codec's --model-dir -------------------------------
    Mutant("dac-answer-padded-to-frames-times-spf",
           "a served DAC 24/16 kHz answer carries 320·n samples, the last 8 zero, not upstream's 320·n - 8",
           (("bicodec_shm/protocol/slot_io.py", "seg.codec.decoded_samples(int(req.lengths[0]))",
             "int(req.lengths[0]) * seg.codec.samples_per_frame"),
            ("bicodec_shm/protocol/slot_io.py", "seg.codec.decoded_samples(req.lengths)",
             "req.lengths * seg.codec.samples_per_frame")),
           ("tests/test_dac_serving.py", "-k", "upstreams_length")),
    m("dac-layout-without-end-trim", "DACConfig.layout leaves end_trim 0: the server takes its "
      "24/16 kHz decodes for 320·n long", "bicodec_shm/model/dac/config.py",
      "            end_trim=self.samples_per_frame - self.decoded_samples(1),\n", "",
      "tests/test_dac_model.py", "-k", "odd_strides"),
    m("dac-decoder-pads-to-frames-times-spf", "DACDecoder.detokenize pads its 24/16 kHz audio to 320·T",
      "bicodec_shm/model/dac/decoder.py",
      "        out = self(ids.to(device), stage_mask)[:, 0].float()  # (B, 1, N) -> (B, N)\n",
      "        out = self(ids.to(device), stage_mask)[:, 0].float()  # (B, 1, N) -> (B, N)\n"
      "        out = torch.nn.functional.pad(out, (0, cfg.samples_per_frame * frames - out.shape[1]))\n",
      "tests/test_dac_model.py", "-k", "odd_strides or tiny_matches"),
    m("header-drops-end-trim", "a client reads a DAC 24 kHz server's layout without its end_trim",
      "bicodec_shm/protocol/header.py", '        end_trim=int(h["end_trim"]),\n', "",
      "tests/test_dac_serving.py", "-k", "upstreams_length"),
    m("stream-expects-frames-times-spf", "DecodeStream expects a DAC 24 kHz window of 320·n samples",
      "bicodec_shm/client/streaming.py",
      "want = hop * (w.w1 - w.w0) - (self._layout.end_trim if self._layout is not None else 0)",
      "want = hop * (w.w1 - w.w0)",
      "tests/test_dac_streaming.py", "-k", "exact_length"),
    m("stream-allows-no-lookahead-where-windows-decode-short", "a DAC 24/16 kHz stream without "
      "lookahead loses 8 samples at every joint", "bicodec_shm/client/streaming.py",
      "            if layout.end_trim and settings.lookahead < 1:", "            if False:",
      "tests/test_dac_streaming.py", "-k", "lookahead"),
    m("model-dir-of-another-codec-unrecognised", "serve --model-dir of a SNAC folder without --codec "
      "says BiCodec's files are missing, not which --codec to pass", "bicodec_shm/tools/model_args.py",
      "        if found is not None and found != codec:", "        if False:",
      "tests/test_cli.py", "-k", "another_codec"),
    m("http-decode-refuses-a-body-past-max-tokens", "the HTTP example's /v1/decode answers a 2,000-id "
      "body with 'split the request' where its stream route takes 30,000", "examples/decode_api.py",
      "            if len(semantic) <= max_tokens:", "            if True:",
      "tests/test_http_example.py", "-k", "longer_than_the_decoders_max_tokens"),
    m("a-column-of-ids-called-a-batch", "a (100, 1) array of ids is refused as 'a batch of 100 rows'",
      "bicodec_shm/codecs/validation.py", "    if all(d == 1 for d in arr.shape[1:]):", "    if False:",
      "tests/test_client.py", "-k", "column"),
    # -- model folders cannot exhaust memory, metrics stay local -----------------------------------
    m("yaml-aliases-accepted", "config.yaml's anchors and aliases load: a 1 KB alias tree stands for "
      "billions of leaves", "bicodec_shm/model/bicodec/checkpoint.py",
      "        if self.check_event(yaml.AliasEvent):", "        if False:",
      "tests/test_checkpoint.py", "-k", "alias", timeout=240.0),
    m("config-message-prints-the-whole-repr", "a bad config value is quoted by its full repr(): a "
      "pickle memo tree of a few bytes formats to gigabytes", "bicodec_shm/model/config_values.py",
      """raise ValueError(f"'{key}' must be an integer, got {shown(value)}")""",
      """raise ValueError(f"'{key}' must be an integer, got {value!r}")""",
      "tests/test_checkpoint.py", "-k", "memo_tree and decoder_dim", timeout=240.0),
    m("compressed-torch-archive-accepted", "a .pth whose records are deflated loads: a zip bomb "
      "reads far more than the file", "bicodec_shm/model/weights.py",
      "            if record.compress_type != zipfile.ZIP_STORED:", "            if False:",
      "tests/test_checkpoint.py", "-k", "compressed"),
    m("config-file-read-whole", "config.yaml is read whatever its size",
      "bicodec_shm/model/weights.py", "    if len(data) > MAX_CONFIG_BYTES:", "    if False:",
      "tests/test_checkpoint.py", "-k", "oversized"),
    m("deep-config-raises-recursion-error", "a config nested deeper than the stack escapes as a raw "
      "RecursionError", "bicodec_shm/model/weights.py",
      "except (*parse_errors, UnicodeDecodeError, ValueError, RecursionError) as exc:",
      "except (*parse_errors, UnicodeDecodeError, ValueError) as exc:",
      "tests/test_checkpoint.py", "-k", "deeply"),
    m("bicodec-model-built-before-shapes-checked", "from_pretrained allocates what config.yaml asks "
      "for before the file is shown to hold it", "bicodec_shm/model/bicodec/decoder.py",
      "state = weights.read_state_dict(file, weights.meta_model(cls, config, file))",
      "state = weights.read_state_dict(file, cls(config))",
      "tests/test_checkpoint.py", "-k", "test_shapes_are_checked_on_the_meta", timeout=240.0),
    m("dac-model-built-before-shapes-checked", "from_pretrained allocates what the kwargs ask for "
      "before the file is shown to hold it", "bicodec_shm/model/dac/decoder.py",
      "state = checkpoint.fold(tensors, meta_model(cls, config, file), file)",
      "state = checkpoint.fold(tensors, cls(config), file)",
      "tests/test_checkpoint.py", "-k", "dac_shapes_are_checked", timeout=240.0),
    m("meta-model-built-on-the-cpu", "the shapes-first model is built with its memory",
      "bicodec_shm/model/weights.py", '            kwargs["device"] = "meta"',
      '            kwargs["device"] = "cpu"',
      "tests/test_checkpoint.py", "-k", "meta_device", timeout=240.0),
    m("config-dimensions-uncapped", "a config may ask for any width: 2**20 codebook entries are built",
      "bicodec_shm/model/config_values.py", "MAX_DIM = 2**16", "MAX_DIM = 2**62",
      "tests/test_checkpoint.py", "-k", "capped", timeout=240.0),
    m("weight-limit-unchecked", "a config asking for 16 G weights is built on the meta device and "
      "only then found not to fit", "bicodec_shm/model/weights.py", "    if n > MAX_ELEMENTS:",
      "    if False:", "tests/test_checkpoint.py", "-k", "weight_limit", timeout=240.0),
    m("metrics-exporter-binds-every-interface", "MetricsExporter's default host is 0.0.0.0",
      "bicodec_shm/server/metrics.py", 'DEFAULT_HOST = "127.0.0.1"', 'DEFAULT_HOST = "0.0.0.0"',
      "tests/test_metrics.py", "-k", "loopback"),
    m("server-metrics-binds-every-interface", "DecoderServer's metrics_host defaults to 0.0.0.0",
      "bicodec_shm/server/server.py", 'metrics_host: str = "127.0.0.1",', 'metrics_host: str = "0.0.0.0",',
      "tests/test_metrics.py", "-k", "loopback"),
    m("serve-metrics-binds-every-interface", "serve --metrics-host defaults to 0.0.0.0",
      "bicodec_shm/tools/cli.py", 's.add_argument("--metrics-host", default="127.0.0.1"',
      's.add_argument("--metrics-host", default="0.0.0.0"', "tests/test_metrics.py", "-k", "loopback"),
    m("metrics-request-without-deadline", "a half-sent request holds its connection forever",
      "bicodec_shm/server/metrics_http.py",
      'head = await asyncio.wait_for(reader.readuntil(b"\\r\\n\\r\\n"), self._timeout)',
      'head = await reader.readuntil(b"\\r\\n\\r\\n")',
      "tests/test_metrics.py", "-k", "half_sent or byte_at"),
    m("metrics-connections-unbounded", "idle connections pile up without a bound",
      "bicodec_shm/server/metrics_http.py", "        if len(self._open) > MAX_CONNECTIONS:",
      "        if False:", "tests/test_metrics.py", "-k", "half_sent"),
    # -- operator tools and clients trust nothing another user made ------------------------------
    m("open-object-trusts-any-owner", "a name's object is used whoever owns it: another user's "
      "served-looking 0666 object passes the health probe, is taken over by serve, unlinked by "
      "cleanup", "bicodec_shm/protocol/objects.py", "        if st.st_uid != expected:",
      "        if False:", "tests/test_foreign_objects.py", "-k",
      "healthz or served_looking or (every_tool and 0666) or client_refuses"),
    m("probe-trusts-the-names-owner", "probe takes the owner from a stat of the name: another "
      "user's object with its SERVING byte held probes SERVING", "bicodec_shm/protocol/names.py",
      "        fd = open_object(name, owner_uid=owner_uid)\n    except (posix_ipc.Error, BiCodecShmError):\n"
      "        # Not ours to open",
      "        fd = open_object(name, owner_uid=os.stat(f'/dev/shm/{name}').st_uid)\n"
      "    except (posix_ipc.Error, BiCodecShmError, OSError):\n        # Not ours to open",
      "tests/test_foreign_objects.py", "-k", "healthz"),
    m("open-object-follows-links", "a name is opened through a symbolic link, to a file of ours",
      "bicodec_shm/protocol/objects.py", "os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | flags",
      "os.O_RDWR | os.O_CLOEXEC | flags", "tests/test_foreign_objects.py", "-k", "symbolic"),
    m("open-refusal-is-a-raw-oserror", "a name that cannot be opened raises the OSError (ELOOP, "
      "EACCES): a traceback from serve, stats, cleanup and DecoderClient()",
      "bicodec_shm/protocol/objects.py",
      '        raise SegmentError(f"{_unopenable(path, exc)}: refusing it; {remedy}") from None',
      "        raise", "tests/test_foreign_objects.py", "-k", "symbolic or roots_0600"),
    m("header-slot-count-unbounded", "a header's slot count is bounded by the object's size alone: "
      "a sparse object claiming millions of slots makes stats read them all",
      "bicodec_shm/protocol/header.py",
      "    if not (1 <= n_slots <= MAX_SLOTS and 1 <= max_tokens <= MAX_FRAMES):",
      "    if not (1 <= n_slots and 1 <= max_tokens):", "tests/test_foreign_objects.py", "-k", "more_slots"),
    m("stats-passes-a-header-clients-refuse", "stats of a served name whose header clients refuse "
      "exits 0", "bicodec_shm/tools/stats_cmd.py",
      "            raise  # a header clients refuse: so does the health probe", "            pass",
      "tests/test_foreign_objects.py", "-k", "more_slots"),
    m("ray-stop-kills-the-header-pid", "NodeDecoder.stop SIGKILLs the server_pid any client may "
      "write into the header", "bicodec_shm/deploy/ray.py",
      "                try:\n                    os.killpg(keeper.pid, signal.SIGKILL)\n"
      "                except ProcessLookupError:\n"
      "                    pass  # every process of the group has exited meanwhile\n",
      "                pid = _server_pid(self.name)\n                if pid:\n"
      "                    os.kill(pid, signal.SIGKILL)\n                keeper.kill()\n",
      "tests/test_ray_stop.py"),
    Mutant("name-dollar-matches-before-newline", "validate_name with ^...$ and re.match: 'tts\\n' "
           "passes as a name", (
               ("bicodec_shm/protocol/names.py", 'r"[A-Za-z0-9_-]{1,120}(\\.[0-9]{1,3})?")',
                'r"^[A-Za-z0-9_-]{1,120}(\\.[0-9]{1,3})?$")'),
               ("bicodec_shm/protocol/names.py", "or not _NAME_RE.fullmatch(name):",
                "or not _NAME_RE.match(name):"),
           ), ("tests/test_transport.py", "-k", "names_are_validated")),
    m("bench-json-follows-part-link", "bench --json PATH writes the predictable PATH.part, "
      "following a symbolic link planted there", "bicodec_shm/tools/bench/cli.py",
      '    fd, part = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".part")',
      '    part = path + ".part"\n    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)',
      "tests/test_bench.py", "-k", "fresh_temporary_file"),
    m("http-claim-trusts-any-binder", "the HTTP example takes any bound claim name for a fellow "
      "worker's: another user binding it first silences the bad-setting line",
      "examples/http_tts/app.py", "        return not _claimed_by_this_user(address)", "        return False",
      "tests/test_http_example.py", "-k", "claim_name"),
    # -- a buggy or hostile client harms only its own requests ------------------------------------
    m("drain-runs-until-the-semaphore-is-empty", "a drain that takes posts until none is left: one "
      "client posting in a tight loop outruns it and the server never leaves its scan",
      "bicodec_shm/protocol/posts.py",
      "    for n in range(most):\n        try:\n            sem.acquire(0)\n"
      "        except posix_ipc.BusyError:\n            return n\n    return most\n",
      "    n = 0\n    while True:\n        try:\n            sem.acquire(0)\n"
      "        except posix_ipc.BusyError:\n            return n\n        n += 1\n",
      "tests/test_hostile_clients.py", "-k", "flood_of_posts or maximum_value", timeout=420.0),
    m("publish-into-a-slot-freed-under-its-batch", "a one-row publish writes DONE and the old "
      "identity whatever became of the slot: its next owner's READY is overwritten, never answered",
      "bicodec_shm/protocol/slot_io.py",
      "        if f[\"state\"][s] != BUSY or f[\"generation\"][s] != req.ids[0, 1]:\n"
      "            return now, [0]\n", "",
      "tests/test_hostile_clients.py", "-k", "freed_while_it_is_decoded"),
    m("batch-publish-into-slots-freed-under-it", "the vectorised publish answers every row, also "
      "one whose slot its client freed and another claimed under the batch",
      "bicodec_shm/protocol/slot_io.py", "    moved = moved_on(seg, req)\n",
      "    moved = np.zeros(len(slots), bool)\n",
      "tests/test_slot_io.py", "-k", "freed_and_claimed_again_under_its_batch"),
    m("gather-marks-busy-a-slot-freed-since-its-confirmation", "gather sets BUSY on a slot its "
      "client freed after the request was confirmed, over the next owner's claim",
      "bicodec_shm/protocol/slot_io.py", "    moved = _not_ready_at_epoch(seg, req)\n",
      "    moved = None\n", "tests/test_slot_io.py", "-k", "since_its_request_was_confirmed"),
    m("error-answer-into-a-slot-freed-under-its-batch", "an error answer of a batch row is written "
      "into its slot after its client freed it and another claimed it",
      "bicodec_shm/protocol/slot_io.py",
      '    if validated and (f["state"][slot] not in (READY, BUSY) or f["generation"][slot] != ids[1]):\n'
      "        return None\n", "",
      "tests/test_slot_io.py", "-k", "error_answer_for_a_slot_claimed_again"),
    m("answer-taken-on-its-identity-alone", "a client takes an answer whose identity is written "
      "before its DONE: after a stale post, it submits its next request under the server's DONE",
      "bicodec_shm/protocol/attachment.py", '        return (seg.field["state"][slot] == DONE\n'
      "                and seg.result_id", "        return (seg.result_id",
      "tests/test_hostile_clients.py", "-k", "identity_is_not_taken_before_its_done"),
    m("attach-trusts-an-overwritten-header", "a client attaches to a header another client "
      "overwrote, and validates its requests against what it says",
      "bicodec_shm/protocol/header.py", '    if int(h["digest"]) != description_digest(h):\n',
      "    if False:\n", "tests/test_hostile_clients.py", "-k", "overwritten_header"),
    m("header-description-never-restored", "the server leaves what a client overwrote in its "
      "header's description: every client attaching later is refused until the server restarts",
      "bicodec_shm/server/server.py",
      "            seg.restore_description()  # what a client may have overwritten, from our own copies\n",
      "", "tests/test_hostile_clients.py", "-k", "restores_what_a_client_overwrote"),
    m("header-counters-never-restored", "the server leaves a client's scribble on its counters: "
      "stats and metrics show it until the next batch or failure rewrites them",
      "bicodec_shm/server/server.py", "            self._counters.restore(seg)\n", "",
      "tests/test_hostile_clients.py", "-k", "restores_what_a_client_overwrote"),
    # -- first come, first served: one handle's waiters for a slot -----------------------------
    m("fair-waiters-newcomer-claims-ahead-of-the-line", "a newcomer claims the room a slot let go of "
      "left, ahead of the requests already in line", "bicodec_shm/protocol/attachment.py",
      "            if may_claim and (first is None or first is waiter):  # nobody in line before us\n",
      "            if may_claim:\n",
      "tests/test_fair_waiters.py", "-k", "oldest_waiter and let_go_of"),
    Mutant("fair-waiters-requeue-at-the-back", "a waiter whose slice ends goes to the back of the line",
           (("bicodec_shm/protocol/slot_waits.py",
             "            waiter.lock.acquire(timeout=timeout)\n",
             "            if not waiter.lock.acquire(timeout=timeout):\n"
             "                with self.lock:\n"
             "                    self.line.waiters[seq] = self.line.waiters.pop(seq)\n"),
            ("bicodec_shm/protocol/slot_waits.py",
             "                        except asyncio.TimeoutError:\n                            pass\n",
             "                        except asyncio.TimeoutError:\n"
             "                            with self.lock:\n"
             "                                self.line.waiters[seq] = self.line.waiters.pop(seq)\n")),
           ("tests/test_fair_waiters.py", "-k", "oldest_waiter")),
    m("fair-waiters-give-leaves-the-slot-up-for-grabs", "give() wakes the oldest waiter but leaves the "
      "slot idle: a newcomer takes it first", "bicodec_shm/protocol/attachment.py",
      "                self.using[slot] = waiter.seq  # one store: the slot is that request's\n"
      "                waiter.wake()  # it finds the slot booked to it, and leaves the line with it\n"
      "                return\n",
      "                waiter.wake()\n",
      "tests/test_fair_waiters.py", "-k", "oldest_waiter and given_back"),
    m("fair-waiters-wake-all", "give() leaves the slot idle and wakes every waiter (the old sync path): "
      "whoever looks first takes it, the thread that gave it back among them",
      "bicodec_shm/protocol/attachment.py",
      "                self.using[slot] = waiter.seq  # one store: the slot is that request's\n"
      "                waiter.wake()  # it finds the slot booked to it, and leaves the line with it\n"
      "                return\n",
      "                self.line.wake_all()\n",
      "tests/test_fair_waiters.py", "-k", "oldest_waiter and given_back"),
    m("fair-waiters-leaver-strands-its-slot", "a waiter that leaves with an error keeps the slot it "
      "was handed: nobody is served until its request is cleaned up", "bicodec_shm/protocol/slot_waits.py",
      "            handed = handed if passing_on else []\n", "            handed = []\n",
      "tests/test_fair_waiters.py", "-k", "passes_on"),
    Mutant("fair-waiters-interrupted-waiter-stays-in-line", "a request interrupted (Ctrl-C, a signal "
           "handler's exception) while in line is never taken off it: the line waits behind it",
           (("bicodec_shm/protocol/slot_waits.py",
             "                self._check_slot_wait(deadline)\n        except BaseException:\n"
             "            self._leave_line(seq, passing_on=True)\n            raise\n\n"
             "    def _sleep_in_line",
             "                self._check_slot_wait(deadline)\n        except Exception:\n"
             "            self._leave_line(seq, passing_on=True)\n            raise\n\n"
             "    def _sleep_in_line"),
            ("bicodec_shm/protocol/attachment.py",
             "            if self.line.leave(seq):\n                self.line.wake_first(self.using)\n", "")),
           ("tests/test_client.py", "-k", "waiting_in_line")),
    m("busy-handle-keeps-its-slots", "a handle with callers always in line hands each slot to its own "
      "next caller even when another handle asked for one: that handle waits until it times out",
      "bicodec_shm/protocol/attachment.py", "            if waiter is not None and not wanted:\n",
      "            if waiter is not None:\n",
      "tests/test_slot_sharing.py"),
    m("give-back-unowns-before-unbooking", "give() sends a slot back to the segment taking it out of owned "
      "before out of use: an exception in between, and the cleanup books it to the request in line "
      "while the handle frees it", "bicodec_shm/protocol/attachment.py",
      "                self.loose.add(slot)\n                del self.using[slot]\n"
      "                self.owned.discard(slot)\n",
      "                self.loose.add(slot)\n                self.owned.discard(slot)\n"
      "                del self.using[slot]\n",
      "tests/test_client.py", "-k", "giving_a_slot_back"),
    m("playing-stream-without-lead", "a playing stream's windows go out due when its listener runs dry, "
      "with no lead: a new stream's first window waits behind every late window seen before it",
      "bicodec_shm/client/streaming.py", "time.monotonic()) + PLAYING_LEAD_S}", "time.monotonic())}",
      "tests/test_due_order.py", "-k", "first_window_due_now"),
    m("lone-lane-never-drops-a-thread", "a lone request of a few milliseconds runs on every core, "
      "where the second thread stalls it whenever the client holds a core",
      "bicodec_shm/server/lanes.py", "if not (threads and threads > 1 and self._one_thread is not None",
      "if True or not (threads and threads > 1 and self._one_thread is not None",
      "tests/test_lane_tuner.py", "-k", "few_millisecond"),
    m("one-thread-ignores-the-queue", "a short request drops to one thread while others wait: a "
      "loaded lone lane runs on one core", "bicodec_shm/server/lane_control.py",
      "len(batch.requests) != 1 or batch.queued != 1:", "len(batch.requests) != 1:",
      "tests/test_lane_tuner.py", "-k", "lone_measured_short"),
    # -- kernels built before serving (server/kernel_warmup.py) ----------------------------------
    m("warm-up-skips-one-thread", "the warm-up builds kernels at the lanes' shares of the cores "
      "only, not at the one thread a lone short request runs on",
      "bicodec_shm/server/lane_control.py", "return sorted({1} | {max(1, self.cores // lanes)",
      "return sorted(set() | {max(1, self.cores // lanes)",
      "tests/test_kernel_warmup.py", "-k", "one_thread_and_at_each"),
    m("warm-up-ignores-its-budget", "a full-size decoder's warm-up runs every shape, seconds each, "
      "before the server serves", "bicodec_shm/server/kernel_warmup.py",
      "if time.perf_counter() - start >= budget_s:", "if time.perf_counter() - start >= 1e9:",
      "tests/test_kernel_warmup.py", "-k", "budget"),
    m("opening-windows-without-the-ramp", "the warm-up prepares whole chunks where a stream's "
      "first windows ramp up (2, 4, 8 frames)", "bicodec_shm/client/stream_settings.py",
      "ramp = emitted < self.chunk_tokens and self.first_chunk < self.chunk_tokens", "ramp = False",
      "tests/test_kernel_warmup.py", "-k", "opening_windows"),
    m("serve-keeps-onednn-cache-default", "serve leaves oneDNN's 1024 kernels, which a warm-up's "
      "shapes fill", "bicodec_shm/tools/cli.py",
      'os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(KERNEL_CACHE_CAPACITY))',
      "KERNEL_CACHE_CAPACITY", "tests/test_kernel_warmup.py", "-k", "raises_the_kernel_cache"),
    m("failed-construction-keeps-the-reserved-name", "a server that fails before its segment "
      "exists leaves the name it reserved while the model loaded",
      "bicodec_shm/protocol/names.py", "            release_name(reserved, name)\n        raise",
      "            pass\n        raise",
      "tests/test_server_signals.py", "-k", "releases_the_reserved_name"),
    # -- Qwen3-TTS's 12 Hz tokenizer against qwen-tts ---------------------------------------------
    m("qwen3-conv-pads-both-sides", "the causal convolutions pad half their history on the right "
      "(a 'same' convolution): not causal, and not upstream's audio",
      "bicodec_shm/model/qwen3_tts/layers.py", "return self.conv(F.pad(x, (self.left, 0)))",
      "return self.conv(F.pad(x, (self.left - self.left // 2, self.left // 2)))",
      "tests/test_qwen3_tts_model.py", "-k", "lone_decodes and 73"),
    m("qwen3-sliding-window-off-by-one", "a query attends to window + 1 keys (itself and 72 before), "
      "not transformers' 72",
      "bicodec_shm/model/qwen3_tts/transformer.py", "allowed = (behind >= 0) & (behind < self.window)",
      "allowed = (behind >= 0) & (behind <= self.window)",
      "tests/test_qwen3_tts_model.py", "-k", "lone_decodes and 73"),
    m("qwen3-snakebeta-without-exp", "SnakeBeta takes its stored log-alpha as alpha (no exp)",
      "bicodec_shm/model/qwen3_tts/layers.py", "alpha = torch.exp(self.alpha)[None, :, None]",
      "alpha = self.alpha[None, :, None]",
      "tests/test_qwen3_tts_model.py", "-k", "lone_decodes and 73"),
    m("qwen3-attention-scaled-by-the-mlps-layer-scale", "the attention branch is scaled by the MLP's "
      "layer scale",
      "bicodec_shm/model/qwen3_tts/transformer.py", "x = x + self.self_attn_layer_scale(self.self_attn(",
      "x = x + self.mlp_layer_scale(self.self_attn(",
      "tests/test_qwen3_tts_model.py", "-k", "lone_decodes and 73"),
    m("qwen3-one-pass-not-upstreams-chunks", "a row is decoded in one pass, not in qwen-tts's 300-frame "
      "chunks with 25 frames of context: frames after 300 see 72 frames back",
      "bicodec_shm/model/qwen3_tts/decoder.py", "CHUNK_FRAMES = 300  #", "CHUNK_FRAMES = 10**6  #",
      "tests/test_qwen3_tts_model.py", "-k", "lone_decodes and 301"),
    m("qwen3-later-chunk-takes-the-first-rows", "a chunk that reaches only some rows decodes the first "
      "rows of the batch instead of those",
      "bicodec_shm/model/qwen3_tts/decoder.py", "= ids[i, :, first - context : end]",
      "= ids[j, :, first - context : end]",
      "tests/test_qwen3_tts_model.py", "-k", "mixed_length_batch"),
    m("qwen3-encoder-batch-without-padding-fill", "a padded batch's rows are not filled past their "
      "ends before a strided convolution: a row's partial last frame reads the other rows' width, "
      "as in qwen-tts's own batched encode",
      "bicodec_shm/model/qwen3_tts/encoder.py", "    if min(lens) < width:\n",
      "    if min(lens) < width and False:\n",
      "tests/test_qwen3_tts_encoder.py", "-k", "mixed_length_batch"),
    m("qwen3-encoder-replicate-padding-as-zeros", "the downsampling's replicate padding is filled with "
      "zeros past a row's end, not with the row's last column",
      "bicodec_shm/model/qwen3_tts/encoder.py", 'if conv.pad_mode == "constant":',
      'if conv.pad_mode in ("constant", "replicate"):',
      "tests/test_qwen3_tts_encoder.py", "-k", "mixed_length_batch"),
    m("qwen3-encoder-floor-frames", "a row keeps floor(samples / 1920) frames (at least 1), not "
      "qwen-tts's ceil: a partial last frame is dropped",
      "bicodec_shm/model/qwen3_tts/encoder_config.py", "return -(-samples // self.samples_per_frame)",
      "return max(1, samples // self.samples_per_frame)",
      "tests/test_qwen3_tts_encoder.py", "-k", "lone_encodes"),
    # -- a fresh server starts from the load's prediction ----------------------------------------
    m("fresh-start-most-lanes-for-one-client", "one request at a time is predicted the most lanes",
      "bicodec_shm/server/lane_tuner.py",
      "lanes = self._loaded_lanes() if loaded else self.candidates[0]", "lanes = self._loaded_lanes()",
      "tests/test_lane_tuner.py", "-k", "one_request_at_a_time or reads_the_load or fresh_server"),
    m("fresh-start-one-lane-under-load", "concurrent requests are predicted one lane",
      "bicodec_shm/server/lane_tuner.py",
      "lanes = self._loaded_lanes() if loaded else self.candidates[0]", "lanes = self.candidates[0]",
      "tests/test_lane_tuner.py", "-k", "concurrent_requests or reads_the_load or fresh_server"),
    m("fresh-start-load-ignores-overlap", "the load read is a batch's rows, not the requests decoding "
      "at once",
      "bicodec_shm/server/lane_tuner.py",
      "at_once = sample.rows * sample.decode_ns / share if share > 0 else float(sample.rows)",
      "at_once = float(sample.rows)",
      "tests/test_lane_tuner.py", "-k", "concurrent_requests or reads_the_load"),
    m("fresh-start-never-explores", "the prediction holds for ever: a slower one is never replaced",
      "bicodec_shm/server/lane_tuner.py",
      "self._hold_ns = self.tuning.first_hold_seconds * 1e9", "self._hold_ns = float(\"inf\")",
      "tests/test_lane_tuner.py", "-k", "first_hold or settles"),
    m("fresh-start-explores-at-once", "the prediction is explored at once, not after its first hold",
      "bicodec_shm/server/lane_tuner.py",
      "self._hold_ns = self.tuning.first_hold_seconds * 1e9", "self._hold_ns = 0.0",
      "tests/test_lane_tuner.py", "-k", "one_request_at_a_time or first_hold or fresh_server"),
    m("fresh-server-explores-first", "a fresh CPU server explores at once instead of predicting",
      "bicodec_shm/server/lane_control.py",
      "self.tuner = LaneTuner(candidates, lanes, tuning, predict=True, cores=cores)",
      "self.tuner = LaneTuner(candidates, lanes, tuning, cores=cores)",
      "tests/test_lane_tuner.py", "-k", "fresh_server"),
    m("fresh-start-late-load-waits-a-minute", "clients that start after the first wait for the first "
      "exploration: one lane predicted holds through load for the whole first hold",
      "bicodec_shm/server/lane_tuner.py",
      "return self._reread_load(sample) if self._predicted else None", "return None",
      "tests/test_lane_tuner.py", "-k", "later_load"),
    m("fresh-start-reads-after-the-batching-settles", "the load is read only once the batching policy "
      "is measured: one client's first 20 requests decode on narrow lanes",
      "bicodec_shm/server/lane_control.py",
      "if not self.tuner.reading_load and not settled(threads):", "if not settled(threads):",
      "tests/test_lane_tuner.py", "-k", "fresh_server"),

    # -- waiting only where it pays, and deliberate waits apart from the host gap -----------------
    m("dispatch-waits-for-clients-measured-late", "a lane waits for clients measured not to come back "
      "within the window (light load: the whole window, for nobody)", "bicodec_shm/server/dispatch_policy.py",
      "if self.measured and (not len(joining) or turnaround is None or not len(ready)):", "if False:",
      "tests/test_dispatch_policy.py", "-k", "slower_than or light_load or turns_back"),
    m("dispatch-window-stretched-for-nobody", "the wait window stretches to the cap where nobody comes "
      "back within it", "bicodec_shm/server/dispatch_policy.py",
      "if _share(outcomes, stretched) - _share(outcomes, window) >= MIN_STRETCH_GAIN:", "if True:",
      "tests/test_dispatch_policy.py", "-k", "stretches_only or slower_than"),
    m("dispatch-clear-votes-keep-the-verdict", "votes where nobody would join count, but never turn the "
      "stored verdict back", "bicodec_shm/server/dispatch_policy.py",
      "        if prevailing != self._prevailing:\n",
      '        if prevailing != self._prevailing and "ns_per_row_now" in numbers:\n',
      "tests/test_dispatch_policy.py", "-k", "turns_back or slower_than"),
    m("dispatch-absent-clients-cost-no-window", "a wait for clients that may not come back is charged "
      "their turnaround, not the window the lane waits out", "bicodec_shm/server/dispatch_policy.py",
      "stays = max(0.0, window - turnaround) if len(joining) < len(coming) else 0.0", "stays = 0.0",
      "tests/test_dispatch_policy.py", "-k", "whole_window"),
    m("idle-pipelined-lane-waits-without-asking", "a pipelined lane with an idle device waits the window "
      "without asking the policy", "bicodec_shm/server/rejoin.py",
      "return window if self.policy.rejoins_within(window, len(coming)) else 0.0", "return window",
      "tests/test_dispatch_policy.py", "-k", "only_for_clients_measured or light_load"),
    m("busy-pipelined-lane-waits-for-anyone", "a pipelined lane with a batch in flight waits rejoin_ms "
      "for clients measured not to come back in time", "bicodec_shm/server/rejoin.py",
      "return self.rejoin_ms if self.policy.rejoins_within(self.rejoin_ms, len(coming)) else 0.0",
      "return self.rejoin_ms", "tests/test_dispatch_policy.py", "-k", "busy_pipelined or dispatch_pipeline"),
    m("dispatch-pipeline-waits-while-busy", "dispatch='pipeline' still waits for the clients of the batch "
      "before the running one", "bicodec_shm/server/dispatch_policy.py",
      'if self.mode in ("pipeline", "wait"):  # fixed', "if False:",
      "tests/test_dispatch_policy.py", "-k", "dispatch_pipeline"),
    m("told-to-wait-forgotten", "a pipelined lane told to let its batch end asks the policy again "
      "instead of waiting", "bicodec_shm/server/rejoin.py",
      'told, self._lane.told = getattr(self._lane, "told", False), False', "told = False",
      "tests/test_dispatch_policy.py", "-k", "told_to_wait"),
    m("waited-counted-as-host-gap", "a lane's deliberate waits are counted as host gap too",
      "bicodec_shm/server/server.py", "self._counters.lane_started(self.segment, gap - waited, waited)",
      "self._counters.lane_started(self.segment, gap, waited)",
      "tests/test_dispatch_policy.py", "-k", "deliberate"),
    # -- Qwen3-TTS's drop-in for qwen-tts's speech_tokenizer.decode ----------------------------------
    m("qwen3-dropin-rows-one-after-another", "a call's rows are decoded one after another, so they "
      "never batch with each other",
      "bicodec_shm/client/long_requests.py", "    for thread in threads:\n        thread.start()\n",
      "    for thread in threads:\n        thread.start()\n        thread.join()\n",
      "tests/test_qwen3_tts_dropin.py", "-k", "one_batch"),
    m("qwen3-dropin-padding-decoded", "the -1 padding qwen-tts's pad_sequence adds is decoded as frames",
      "bicodec_shm/integrations/qwen3_tts.py", "n = int(padding[0]) if len(padding) else len(row)",
      "n = len(row)", "tests/test_qwen3_tts_dropin.py", "-k", "input_form or empty_row"),
    m("qwen3-window-start-ignored", "the server cuts a stream's window 300 frames into the window, not on "
      "the utterance's chunk grid", "bicodec_shm/model/qwen3_tts/serving.py",
      "starts = None if starts is None else starts.tolist()", "starts = None",
      "tests/test_qwen3_streaming.py", "-k", "server_process"),
    m("qwen3-grid-from-the-row", "a row's chunk cuts counted from the row's start, not its utterance's",
      "bicodec_shm/model/qwen3_tts/decoder.py", "range((start // CHUNK_FRAMES + 1) * CHUNK_FRAMES - start,",
      "range(CHUNK_FRAMES,", "tests/test_qwen3_tts_model.py", "-k", "start_inside"),
    m("first-chunk-ramp-flat", "after a short first chunk the regions jump to full chunks (a listener "
      "starved after the first audio)", "bicodec_shm/client/streaming.py",
      "step = min(s.chunk_tokens, max(s.first_chunk, e))",
      "step = s.first_chunk if e == 0 else s.chunk_tokens",
      "tests/test_qwen3_streaming.py", "-k", "short_first_chunk"),

    # -- serving by when the audio is due ----------------------------------------------------------
    m("plan-by-arrival-not-due", "the server plans by arrival: a stream with seconds of audio ahead "
      "is decoded before one about to run dry", "bicodec_shm/server/server.py",
      "self._planner.plan(ready.lengths, ready.due(),", "self._planner.plan(ready.lengths, ready.seen_ns,",
      "tests/test_due_order.py", "-k", "run_dry"),
    m("due-time-uncapped", "a client-written due time postpones its request without bound",
      "bicodec_shm/protocol/slot_io.py",
      'due_ns=seen + 1000 * np.minimum(rows["due_in_us"], MAX_DUE_IN_US).astype(np.int64),',
      'due_ns=seen + 1000 * rows["due_in_us"].astype(np.int64),',
      "tests/test_due_order.py", "-k", "caps"),
    m("due-time-not-converted-at-the-submit", "a request's due time is not turned into the time left "
      "at its submit: every one that names one goes out as due in 30 s", "bicodec_shm/protocol/attachment.py",
      'f["due_in_us"][slot] = min(max(0, due_at_ns - now) // 1000, MAX_DUE_IN_US)',
      'f["due_in_us"][slot] = MAX_DUE_IN_US if due_at_ns else 0',
      "tests/test_due_order.py", "-k", "written"),
    m("stream-windows-always-due-now", "a stream says every window is due now, whatever audio its "
      "listener holds", "bicodec_shm/client/streaming.py",
      'return {"due_in": max(0.0, self._first_audio + ahead - time.monotonic()) + PLAYING_LEAD_S}',
      'return {"due_in": 0.0}', "tests/test_due_order.py", "-k", "first_window_due_now"),
    m("shared-segment-may-shrink", "a segment shared with the group is sealed against growing only: a "
      "member may truncate it", "bicodec_shm/protocol/handoff.py",
      "SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL",
      "SEALS = fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL", "tests/test_group_access.py", "-k", "resize"),
    m("name-object-takes-the-shared-mode", "the name's own object (its OWNER and SERVING locks) is "
      "created with the group's mode", "bicodec_shm/protocol/layout.py",
      "    return mode & 0o700", "    return mode", "tests/test_group_access.py", "-k", "resize"),
    m("handoff-peer-uid-unchecked", "a client takes the segment from whoever listens on NAME.sock",
      "bicodec_shm/protocol/handoff.py", "        if uid != expected:", "        if False:",
      "tests/test_group_access.py", "-k", "another_user_listens"),
    m("handoff-hang-up-unseen", "a client attached over the socket never sees its server's end close",
      "bicodec_shm/protocol/handoff.py",
      "            return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b\"\"",
      "            return True", "tests/test_group_access.py", "-k", "crashed"),
    m("member-gives-up-while-the-socket-is-down", "a member of the group that finds no NAME.sock "
      "(its server restarting) fails at once instead of waiting", "bicodec_shm/protocol/objects.py",
      "    return (stat.S_ISREG(st.st_mode) and st.st_uid == expected",
      "    return False and (stat.S_ISREG(st.st_mode) and st.st_uid == expected",
      "tests/test_group_access.py", "-k", "crashed"),
    m("handoff-kept-by-a-forked-child", "a child forked from the server's process keeps its copies of "
      "the clients' connections", "bicodec_shm/protocol/handoff.py",
      "os.register_at_fork(after_in_child=_hang_up_in_child)",
      "pass  # os.register_at_fork(after_in_child=_hang_up_in_child)",
      "tests/test_group_access.py", "-k", "forked_from"),
    m("waiter-dies-on-a-close-before-its-sleep", "the asyncio waiter thread lets a close that came "
      "between its check and its sleep escape as ClientClosedError", "bicodec_shm/protocol/async_answers.py",
      "                if self.retired is not None:\n                    return\n                raise",
      "                raise", "tests/test_client.py", "-k", "waiter_threads_check"),
)


def make_copy(dest: Path) -> None:
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=IGNORED)
        elif src.exists():
            shutil.copy2(src, dest / name)


def apply(root: Path, mutant: Mutant) -> str | None:
    """Apply the edits in ``root``; None, or why they do not apply."""
    for file, old, new in mutant.edits:
        path = root / file
        text = path.read_text()
        if text.count(old) != 1:
            return f"{file}: the old text occurs {text.count(old)} times (expected once)"
        path.write_text(text.replace(old, new))
    return None


def run_tests(root: Path, tests: tuple[str, ...], timeout: float) -> tuple[str, float, str]:
    """(verdict for a mutant, seconds, the output's tail): see ``verdict_of``."""
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
    junit = root / ".mutation-gate-junit.xml"
    junit.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
           # xunit1: the family in which tests' record_property is no warning (warnings fail)
           f"--junitxml={junit}", "-o", "junit_family=xunit1", *tests]  # fmt: skip
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or ""
        if isinstance(out, bytes):
            out = out.decode(errors="replace")
        return "timeout", time.monotonic() - t0, out[-2000:]
    seconds = time.monotonic() - t0
    report = junit.read_text() if junit.exists() else None
    return verdict_of(done.returncode, report), seconds, (done.stdout + done.stderr)[-2000:]


def outcomes(junit_xml: str) -> dict[str, int]:
    """Counts of passed, failed, errors and skipped tests in pytest's JUnit XML report."""
    import xml.etree.ElementTree as ET

    root = ET.fromstring(junit_xml)
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    return {"passed": count["tests"] - count["failures"] - count["errors"] - count["skipped"],
            "failed": count["failures"], "errors": count["errors"], "skipped": count["skipped"]}  # fmt: skip


def verdict_of(returncode: int, junit_xml: str | None) -> str:
    """A selection's verdict from pytest's exit status and its JUnit XML report.

    ``killed``: a test failed (exit 1). ``survived``: it passed, and at least one test ran and
    passed. ``not tested``: nothing ran: no test collected (exit 5), or every selected test
    skipped (a missing permission, tool or device): no verdict at all, and not a pass either.
    ``error``: pytest itself could not run the selection (usage, internal error, interrupted)."""
    if returncode == 5:
        return "not tested"
    if returncode not in (0, 1):
        return "error"
    if returncode == 1:
        return "killed"
    if junit_xml is None:
        return "error"  # exit 0 without a report: cannot tell what ran
    return "survived" if outcomes(junit_xml)["passed"] > 0 else "not tested"


def check_one(mutant: Mutant) -> dict:
    with tempfile.TemporaryDirectory(prefix="bcshm-mutant-") as tmp:
        root = Path(tmp)
        make_copy(root)
        problem = apply(root, mutant)
        if problem:
            return {"mutant": mutant.name, "verdict": "error", "seconds": 0.0, "detail": problem}
        verdict, seconds, tail = run_tests(root, mutant.tests, mutant.timeout)
    row = {"mutant": mutant.name, "verdict": verdict, "seconds": round(seconds, 1), "why": mutant.why,
           "tests": " ".join(mutant.tests)}
    if verdict in ("survived", "not tested", "error"):
        row["detail"] = tail
    return row


def baseline(mutants: list[Mutant]) -> dict:
    """Every mutant's selection on the unmutated copy: each must pass."""
    with tempfile.TemporaryDirectory(prefix="bcshm-baseline-") as tmp:
        root = Path(tmp)
        make_copy(root)
        failures, seconds = [], 0.0
        for mutant in mutants:
            verdict, took, tail = run_tests(root, mutant.tests, mutant.timeout)
            seconds += took
            if verdict != "survived":  # "survived" = some test ran, and every one passed
                failures.append({"tests": " ".join(mutant.tests), "verdict": verdict, "detail": tail})
    return {"passed": not failures, "seconds": round(seconds, 1), "failures": failures}


def selections(mutants: list[Mutant]) -> list[Mutant]:
    """One mutant per distinct test selection (the baseline runs each selection once)."""
    seen: dict[tuple[str, ...], Mutant] = {}
    for mutant in mutants:
        seen.setdefault(mutant.tests, mutant)
    return list(seen.values())


def summary(bad: list[dict]) -> str:
    """What the closing line adds for the mutants not killed, by verdict: '; survived: a, b;
    not tested: c' (empty if every mutant was killed)."""
    by_verdict: dict[str, list[str]] = {}
    for row in bad:
        by_verdict.setdefault(row["verdict"], []).append(row["mutant"])
    return "".join(f"; {verdict}: {', '.join(names)}" for verdict, names in by_verdict.items())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-k", action="append", default=[], help="only mutants whose name contains this")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "out" / "mutation_gate.json"))
    args = parser.parse_args()
    chosen = [mt for mt in MUTANTS if not args.k or any(k in mt.name for k in args.k)]
    if args.list:
        for mt in chosen:
            print(f"{mt.name:45s} {' '.join(mt.tests)}")
        return 0
    report: dict = {"mutants": []}
    if not args.no_baseline:
        report["baseline"] = base = baseline(selections(chosen))
        print(f"baseline (unmutated, {len(selections(chosen))} selections): "
              f"{'passed' if base['passed'] else 'FAILED'} in {base['seconds']:.0f} s", flush=True)
        for failure in base["failures"]:
            print(f"  {failure['verdict']}: {failure['tests']}\n{failure['detail']}", flush=True)
    print(f"{'mutant':45s} {'verdict':9s} {'seconds':>7s}", flush=True)
    for mutant in chosen:
        row = check_one(mutant)
        report["mutants"].append(row)
        print(f"{row['mutant']:45s} {row['verdict']:9s} {row['seconds']:7.1f}", flush=True)
        if "detail" in row:
            print("    " + row["detail"].strip().replace("\n", "\n    ")[-1500:], flush=True)
    bad = [r for r in report["mutants"] if r["verdict"] not in ("killed", "timeout")]
    killed = len(report["mutants"]) - len(bad)
    print(f"{killed}/{len(report['mutants'])} killed" + summary(bad))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0 if not bad and report.get("baseline", {"passed": True})["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
