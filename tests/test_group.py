"""Server groups: ``serve --device cpu,cpu`` runs one server per device under a supervisor.

Real processes and real shared memory throughout: the supervisor is ``bicodec-shm serve`` with
two devices, its members are ordinary servers of the tiny model, clients are separate processes
or threads and asyncio tasks. Ground truth is each request's lone decode (support.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
from conftest import ROOT, serve_command
from support import assert_lone_int16, check_in_forked_child, join_within, seeded_request, worker_command

from bicodec_shm.client.decoder_client import DecoderClient
from bicodec_shm.deploy import processes
from bicodec_shm.deploy.supervisor import Supervisor, member_command, member_device, parse_devices
from bicodec_shm.errors import ClientClosedError, ServerAlreadyRunningError, ServerUnavailableError
from bicodec_shm.protocol.group import GroupObject, member_names, read_group
from bicodec_shm.protocol.header import read_header, stats_from_header
from bicodec_shm.protocol.names import ServerState, leftover_objects, probe, random_name, unlink_all
from bicodec_shm.tools import cli, stats_cmd


@dataclass
class Group:
    name: str
    proc: subprocess.Popen
    log: str

    @property
    def members(self) -> tuple[str, ...]:
        return member_names(self.name, 2)

    def requests(self) -> list[int]:
        return [int(read_header(m)["requests"]) for m in self.members]

    def log_text(self) -> str:
        with open(self.log, encoding="utf-8", errors="replace") as f:
            return f.read()


def _start_group(name: str, log: str) -> Group:
    with open(log, "ab") as f:  # O_APPEND: the test reads the log while the group writes it
        proc = subprocess.Popen(serve_command(name, "--device", "cpu,cpu", "--slots", "16"),
                                cwd=ROOT, stderr=f)  # fmt: skip
    group = Group(name, proc, log)
    try:
        # The group object serves once every member has served.
        processes.wait_until_serving(name, proc, timeout=120)
    except BaseException:
        _stop_group(group)
        raise
    assert all(probe(m) is ServerState.SERVING for m in group.members)
    return group


def _stop_group(group: Group) -> None:
    if group.proc.poll() is None:
        group.proc.send_signal(signal.SIGCONT)  # a test may have left it stopped
    processes.stop_server(group.proc, timeout=60)
    # Members stop with their supervisor, even one that was killed (PR_SET_PDEATHSIG).
    _wait_for(lambda: all(probe(m) is not ServerState.SERVING for m in group.members), 60)


def _clean(name: str) -> None:
    for n in (name, *member_names(name, 2)):
        unlink_all(n)
        assert leftover_objects(n) == []


def _wait_for(condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def group(tmp_path_factory) -> Iterator[Group]:
    """One group for the tests that leave it as they found it (a member restarted is fine)."""
    name = random_name("bcshm-test-grp")
    log = str(tmp_path_factory.mktemp("group") / "supervisor.log")
    try:
        g = _start_group(name, log)
        yield g
        _stop_group(g)
        assert g.proc.returncode == 0
    finally:
        _clean(name)


@pytest.fixture
def group_name() -> Iterator[str]:
    """A fresh group name whose objects (and its members') are unlinked afterwards."""
    name = random_name("bcshm-test-grp")
    yield name
    _clean(name)


def _run_calls(client: DecoderClient, reqs, n_threads: int) -> tuple[dict, list[threading.Thread]]:
    """The first half of ``reqs`` through ``n_threads`` sync threads, the rest as asyncio tasks
    (all at once). Returns ({index: pcm or exception}, threads)."""
    outcomes: dict = {}
    half = len(reqs) // 2

    def sync(indexes):
        for i in indexes:
            try:
                outcomes[i] = client.decode(*reqs[i])
            except BaseException as exc:
                outcomes[i] = exc

    async def run_async():
        async def one(i):
            try:
                outcomes[i] = await client.decode_async(*reqs[i])
            except BaseException as exc:
                outcomes[i] = exc

        await asyncio.gather(*(one(i) for i in range(half, len(reqs))))

    threads = [threading.Thread(target=sync, args=(range(k, half, n_threads),)) for k in range(n_threads)]
    threads.append(threading.Thread(target=lambda: asyncio.run(run_async())))
    for t in threads:
        t.start()
    return outcomes, threads


# -- with the shared group --------------------------------------------------------------------


def test_requests_from_two_processes_spread_over_both_members_and_stay_exact(group, tmp_path):
    before = group.requests()
    outs = [str(tmp_path / f"c{i}.npz") for i in range(2)]
    # 2 processes x 20 requests, 10 in flight each: 20 at a time over the group.
    procs = [subprocess.Popen(worker_command(group.name, str(40 + i), "20", outs[i], "--concurrent", "10",
                                             "--slots", "10", "--max-len", "80"))  # fmt: skip
             for i in range(2)]
    for p in procs:
        assert p.wait(timeout=120) == 0
    served = [after - b for after, b in zip(group.requests(), before)]
    assert sum(served) == 40
    assert all(n > 0 for n in served), f"requests per member: {served}"
    for out in outs:
        data = np.load(out)
        for i in range(20):
            assert_lone_int16(data[f"pcm_{i}"], data[f"sem_{i}"], data[f"glb_{i}"])


def test_stats_shows_the_members_side_by_side(group, capsys):
    assert cli.main(["stats", group.name]) == 0
    text = capsys.readouterr().out
    lines = {line.split("  ")[0]: line for line in text.splitlines()}
    assert text.startswith(f"group {group.name}: 2 members")
    assert lines["member"].split()[1:] == list(group.members)
    assert lines["device"].split()[1:] == ["cpu", "cpu"]
    assert lines["requests"].split()[1:] == [str(n) for n in group.requests()]

    assert cli.main(["stats", group.name, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert list(stats["members"]) == list(group.members)
    for member in group.members:
        entry = stats["members"][member]
        assert entry["server_alive"] and entry["device"] == "cpu"
        assert entry["requests"] == stats_from_header(read_header(member))["requests"]
    assert stats["requests"] == sum(stats["members"][m]["requests"] for m in group.members)

    assert cli.main(["stats", group.members[0]]) == 0  # one member alone, as before
    assert capsys.readouterr().out.splitlines()[0].split() == ["segment", group.members[0]]


def test_stats_watch_of_a_group_prints_one_line_per_member_and_interval(group, monkeypatch, capsys):
    intervals = iter([6])

    def between_samples(seconds):
        n = next(intervals, None)
        if n is None:
            raise KeyboardInterrupt
        with DecoderClient(group.name) as client:
            outcomes, threads = _run_calls(client, [seeded_request(i, n=20) for i in range(n)], n_threads=3)
            join_within(threads, within=60)
            assert all(isinstance(r, np.ndarray) for r in outcomes.values())

    monkeypatch.setattr(stats_cmd, "_sleep", between_samples)
    assert cli.main(["stats", group.name, "--watch", "0.5", "--json"]) == 130
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["member"] for line in lines] == list(group.members)
    assert sum(line["interval"]["requests"] for line in lines) == 6

    intervals = iter([2])
    assert cli.main(["stats", group.name, "--watch", "0.5"]) == 130
    out = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(out) if line.startswith("time"))
    assert out[header].split()[-1] == "member"
    assert [row.split()[-1] for row in out[header + 1 :]] == list(group.members)


def test_killing_a_member_loses_nothing_and_the_supervisor_restarts_it(group):
    """Requests in flight on the killed member go to the other one at once: they all finish
    while the supervisor is held stopped, so the killed member cannot have come back."""
    reqs = [seeded_request(1000 + i, n=120) for i in range(48)]
    victim_name = group.members[0]
    epoch = int(read_header(victim_name)["server_epoch"])
    base = group.requests()[0]
    with DecoderClient(group.name, timeout=120) as client:
        outcomes, threads = _run_calls(client, reqs, n_threads=8)
        try:
            # Kill member 0 once it is busy with this flow.
            _wait_for(lambda: group.requests()[0] >= base + 6 or not any(t.is_alive() for t in threads), 60)
            victim = int(read_header(victim_name)["server_pid"])
            os.kill(group.proc.pid, signal.SIGSTOP)  # no restart until the flow has finished
            os.kill(victim, signal.SIGKILL)
            join_within(threads, within=120)
            assert probe(victim_name) is not ServerState.SERVING
        finally:
            os.kill(group.proc.pid, signal.SIGCONT)
        assert len(outcomes) == len(reqs)
        for i, result in outcomes.items():
            assert_lone_int16(result, *reqs[i])

        # The supervisor brings it back, under a new epoch, and the handle uses it again.
        _wait_for(lambda: probe(victim_name) is ServerState.SERVING, 60)
        assert int(read_header(victim_name)["server_epoch"]) != epoch
        _wait_for(lambda: read_group(group.name).restarts == (1, 0), 5)
        log = group.log_text()
        assert f"member {victim_name} (device cpu, pid {victim}) was killed by SIGKILL" in log
        assert "restarting it in" in log
        more = [seeded_request(2000 + i, n=40) for i in range(16)]
        outcomes, threads = _run_calls(client, more, n_threads=4)
        join_within(threads, within=60)
        for i, result in outcomes.items():
            assert_lone_int16(result, *more[i])
    assert read_header(victim_name)["requests"] > 0


def test_a_second_supervisor_or_server_under_the_same_name_is_refused(group, capsys):
    code = cli.main(["serve", "--device", "cpu,cpu", "--name", group.name, "--preset", "tiny"])
    assert code == 1
    err = capsys.readouterr().err
    assert f"{group.name!r} is already being served (a server group, supervisor pid" in err
    assert "stop that server first" in err
    with pytest.raises(ServerAlreadyRunningError, match="server group already serves"):
        GroupObject.create(group.name, ["cpu"])
    # A single server under the group's name, or a member's, is refused as well.
    assert cli.main(["serve", "--name", group.name, "--preset", "tiny", "--threads", "1"]) == 1
    assert cli.main(["serve", "--name", group.members[1], "--preset", "tiny", "--threads", "1"]) == 1
    assert all(probe(n) is ServerState.SERVING for n in (group.name, *group.members))


def test_close_ends_calls_in_flight_on_a_group(group):
    client = DecoderClient(group.name, timeout=None)
    reqs = [seeded_request(3000 + i, n=1500) for i in range(8)]
    outcomes, threads = _run_calls(client, reqs, n_threads=4)
    _wait_for(lambda: any(client.get_stats()["members"][m]["handle_slots"] for m in group.members), 30)
    client.close()
    join_within(threads, within=5)
    for result in outcomes.values():
        assert isinstance(result, (np.ndarray, ClientClosedError)), repr(result)
    assert any(isinstance(r, ClientClosedError) for r in outcomes.values())
    with pytest.raises(ClientClosedError):
        client.decode([1, 2, 3], np.zeros(32, np.int64))


def test_a_group_handle_carried_across_fork_uses_its_own_slots(group):
    client = DecoderClient(group.name, slots=2, timeout=60)
    sem, glb = seeded_request(5, n=20)
    try:
        for _ in range(4):
            client.decode(sem, glb)
        member = client._group.pick()
        held = member.take_slot(time.monotonic() + 10)  # a request about to be written, at fork
        parent = _owned(client)
        assert parent

        def child_attaches_afresh_with_slots_of_its_own():
            pcm = client.decode(sem, glb)
            return np.array_equal(pcm, client.decode(sem, glb)) and not (_owned(client) & parent)

        check_in_forked_child(child_attaches_afresh_with_slots_of_its_own)
        assert_lone_int16(client.decode(sem, glb), sem, glb)  # the parent is unaffected
        assert parent <= _owned(client)  # still its own slots
        member.give(*held)
    finally:
        client.close()


def _owned(client: DecoderClient) -> set[tuple[str, int]]:
    return {(att.name, slot) for att in client._group._atts if att is not None for slot in att.owned}


# -- groups of their own ----------------------------------------------------------------------


def test_sigterm_leaves_nothing_and_a_killed_supervisor_is_taken_over(group_name, tmp_path):
    log = str(tmp_path / "supervisor.log")
    first = _start_group(group_name, log)
    try:
        first.proc.kill()  # SIGKILL: its members get SIGTERM from the kernel and stop
        first.proc.wait()
        _wait_for(lambda: all(probe(m) is ServerState.ABSENT for m in first.members), 60)
        assert probe(group_name) is ServerState.DEAD  # only the group object is left
    except BaseException:
        _stop_group(first)
        raise
    second = _start_group(group_name, log)  # takes the dead supervisor's object over
    try:
        with DecoderClient(group_name, timeout=60) as client:
            sem, glb = seeded_request(7, n=30)
            assert_lone_int16(client.decode(sem, glb), sem, glb)
    finally:
        _stop_group(second)
    assert second.proc.returncode == 0
    for name in (group_name, *second.members):
        assert leftover_objects(name) == [], name
    assert "stopped group" in second.log_text()


def test_a_member_that_cannot_start_stops_the_group(group_name, tmp_path):
    log = tmp_path / "supervisor.log"
    with open(log, "ab") as f:
        proc = subprocess.Popen(serve_command(group_name, "--device", "cpu,nosuchdevice:0"),
                                cwd=ROOT, stderr=f)  # fmt: skip
    assert proc.wait(timeout=120) == 1
    assert f"member {group_name}.1 (device nosuchdevice:0" in log.read_text()
    assert "before it ever served" in log.read_text()
    for name in (group_name, *member_names(group_name, 2)):
        assert leftover_objects(name) == [], name


def test_a_group_object_is_owned_like_a_segment(group_name):
    """In-process: O_CREX and the OWNER lock, SERVING only when started, takeover when dead."""
    group = GroupObject.create(group_name, ["cuda:0", "cuda:1"])
    try:
        info = read_group(group_name)
        assert info is not None and not info.alive and info.devices == ("cuda:0", "cuda:1")
        assert probe(group_name) is ServerState.BUSY
        with pytest.raises(ServerUnavailableError, match="is not up"):
            DecoderClient(group_name)  # a starting group is not yet a group to clients
        group.start_serving()
        assert read_group(group_name).alive
        with pytest.raises(ServerUnavailableError, match="none of its members"):
            DecoderClient(group_name)
        group.set_restarts(1, 3)
        assert read_group(group_name).restarts == (0, 3)
        with pytest.raises(ServerAlreadyRunningError):
            GroupObject.create(group_name, ["cpu"])
    finally:
        group.close()  # as if the supervisor died: no unlink
    assert probe(group_name) is ServerState.DEAD
    again = GroupObject.create(group_name, ["cpu"])  # takes the leftovers over
    try:
        assert read_group(group_name).devices == ("cpu",)
    finally:
        again.stop_serving()
        again.unlink()
        again.close()
    assert leftover_objects(group_name) == []


def test_device_lists_and_member_commands():
    assert parse_devices("cuda:0, cuda:1") == ["cuda:0", "cuda:1"]
    assert parse_devices("cpu,cpu") == ["cpu", "cpu"]
    with pytest.raises(ValueError, match="empty entry"):
        parse_devices("cuda:0,")
    argv = ["serve", "--device", "cuda:0,cuda:1", "--name", "tts", "--slots", "32"]
    command = member_command(argv, "tts.1", "cuda:0", metrics_port=9101)
    args = cli._parser().parse_args(command[3:])
    assert (args.device, args.name, args.slots, args.metrics_port) == ("cuda:0", "tts.1", 32, 9101)
    with pytest.raises(ValueError, match="member suffix"):
        GroupObject.create("tts.1", ["cpu"])


def test_a_cuda_member_sees_only_its_own_gpu_as_cuda_0():
    """cuda:K runs as cuda:0 with CUDA_VISIBLE_DEVICES naming GPU K (of the supervisor's own
    list when it has one): the member's current device is its model's, and it opens no context
    on another GPU."""
    assert member_device("cuda:1", None) == ("cuda:0", {"CUDA_VISIBLE_DEVICES": "1"})
    assert member_device("cuda", None) == ("cuda:0", {"CUDA_VISIBLE_DEVICES": "0"})
    assert member_device("cuda:1", "3, 5") == ("cuda:0", {"CUDA_VISIBLE_DEVICES": "5"})
    assert member_device("cuda:0", "GPU-1a2b") == ("cuda:0", {"CUDA_VISIBLE_DEVICES": "GPU-1a2b"})
    assert member_device("cpu", "0") == ("cpu", {})
    with pytest.raises(ValueError, match="only 2 GPU"):
        member_device("cuda:2", "0,1")


def test_the_supervisor_starts_each_member_with_its_environment(tmp_path):
    """The environment reaches the member process (a stand-in command that prints it)."""
    out = tmp_path / "env.txt"
    code = f"import os; open({str(out)!r}, 'w').write(os.environ.get('CUDA_VISIBLE_DEVICES', '-'))"
    sup = Supervisor(random_name("sup"), ["cuda:1"], [[sys.executable, "-c", code]],
                     envs=[{"CUDA_VISIBLE_DEVICES": "1"}])  # fmt: skip
    member = sup.members[0]
    sup._start(member)
    assert member.proc.wait(60) == 0
    assert out.read_text() == "1"
    with pytest.raises(ValueError, match="one environment per device"):
        Supervisor(random_name("sup"), ["cpu"], [["true"]], envs=[])
