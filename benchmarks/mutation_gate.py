"""Mutation gate: plant each of a curated list of plausible bugs, one at a time, and check that
the tests meant to catch it fail.

    python benchmarks/mutation_gate.py                  # every mutant (a few minutes)
    python benchmarks/mutation_gate.py -k int16 -k fork # only mutants whose name contains these
    python benchmarks/mutation_gate.py --list

For each mutant the repository's package, tests, benchmarks and examples are copied into a
temporary directory, the mutant's exact text edits are applied there (each old text must occur
exactly once), and its targeted tests run with ``PYTHONPATH`` and the working directory at the
copy, so that subprocesses the tests start (servers, workers) import the mutated package too.
Verdicts: ``killed`` (the tests failed), ``survived`` (they passed: a hole in the suite),
``timeout`` (counted as killed: the bug hangs them), ``error`` (the edit did not apply, or pytest
could not run the selection). First, unless ``--no-baseline``, the union of the selections runs
on an unmutated copy: a selection that fails without any bug would make every verdict "killed".

Prints a table (mutant, verdict, seconds) and writes the same as JSON (``--json``). Exits 0 only
if the baseline passed and every mutant was killed.

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
COPIED = ("bicodec_shm", "tests", "benchmarks", "examples", "pyproject.toml", "README.md")
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
      "bicodec_shm/client/decoder_client.py",
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
    m("default-preset-no-crossfade", "streaming default with crossfade 0", "bicodec_shm/client/streaming.py",
      "lookahead=20, crossfade=640", "lookahead=20, crossfade=0",
      "tests/test_streaming.py", "-k", "snr_floor_of_each_preset"),
    m("default-preset-lookahead16-left29", "less lookahead, more left context, same window",
      "bicodec_shm/client/streaming.py",
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
      "return seg.result_id[slot].tolist() == [self.handle_id, self.generation[slot], seq]",
      "return int(seg.result_id[slot][2]) == seq",
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
      "bicodec_shm/client/decoder_client.py",
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
      "            for slot in slots:\n                self._held.pop(slot, None)\n"
      "            ring(self.segment, slots, bells)",
      "            ring(self.segment, slots, bells)\n"
      "            for slot in slots:\n                self._held.pop(slot, None)",
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
      "the server", "bicodec_shm/protocol/attachment.py",
      "            _ask_for_a_slot(seg)\n            seg.wait(seg.free, timeout)",
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
      "bicodec_shm/protocol/attachment.py",
      "                with self.lock:\n                    waiter = None\n"
      "                    if not self.owned.difference(self.using) and self.retired is None:\n"
      "                        waiter = self.changed.add()\n"
      "                if waiter is not None:\n"
      "                    self._sleep(waiter, min(SLICE, max(0.0, deadline - time.monotonic())))\n",
      "                with self.lock:\n"
      "                    if not self.owned.difference(self.using) and self.retired is None:\n"
      "                        threading.Condition(self.lock).wait(min(SLICE, max(0.0, deadline - time.monotonic())))\n",  # noqa: E501
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
      "return BatchSample(planned_ns, start_ns, self._clock(), tokens, rows, padded_tokens, share)",
      "return BatchSample(planned_ns, start_ns, self._clock(), tokens, rows, padded_tokens, None)",
      "tests/test_lane_tuner.py", "-k", "narrow"),
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
      "in full against the attachment that sends it", "bicodec_shm/client/decoder_client.py",
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
    """(verdict for a mutant, seconds, the output's tail)."""
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *tests]
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or ""
        if isinstance(out, bytes):
            out = out.decode(errors="replace")
        return "timeout", time.monotonic() - t0, out[-2000:]
    seconds = time.monotonic() - t0
    verdict = {0: "survived", 1: "killed"}.get(done.returncode, "error")
    return verdict, seconds, (done.stdout + done.stderr)[-2000:]


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
    if verdict in ("survived", "error"):
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
            if verdict != "survived":  # "survived" = the tests passed
                failures.append({"tests": " ".join(mutant.tests), "verdict": verdict, "detail": tail})
    return {"passed": not failures, "seconds": round(seconds, 1), "failures": failures}


def selections(mutants: list[Mutant]) -> list[Mutant]:
    """One mutant per distinct test selection (the baseline runs each selection once)."""
    seen: dict[tuple[str, ...], Mutant] = {}
    for mutant in mutants:
        seen.setdefault(mutant.tests, mutant)
    return list(seen.values())


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
    bad = [r["mutant"] for r in report["mutants"] if r["verdict"] not in ("killed", "timeout")]
    killed = len(report["mutants"]) - len(bad)
    print(f"{killed}/{len(report['mutants'])} killed" + (f"; not killed: {', '.join(bad)}" if bad else ""))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0 if not bad and report.get("baseline", {"passed": True})["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
