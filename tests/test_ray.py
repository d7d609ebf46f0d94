"""bicodec_shm.deploy.ray and examples/ray_serve on a real two-node Ray cluster on this machine.

Two raylets (``ray start --head`` and ``ray start --address``), each with its own resources and
node id, so each gets its own decoder (``--preset tiny``) under ``PREFIX-NODEID``; 2 Serve
replicas per node behind one HTTP proxy. Checked: every WAV against the lone decode, each
decoder's counters against the traffic its own node's replicas sent, a SIGKILLed decoder that
Ray restarts with nothing failed, and nothing left in /dev/shm once the cluster is killed.

Ray rewrites 127.0.0.1 to the machine's outward address, so the nodes use another loopback
address, 127.0.0.2: no Ray traffic leaves the host. Every process of the cluster is in one of
two process groups (each ``ray start`` runs in a new session); the teardown SIGKILLs them, as
``ray stop --force`` does, but only this test's cluster, never another Ray on the machine.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
from conftest import ROOT
from support import PortClash, assert_lone_int16, free_port, retry_on_port_clash

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
# Looked up, not imported: the cluster's processes import Ray, this one needs only its `ray` command.
if importlib.util.find_spec("ray") is None or not os.path.exists(RAY):
    pytest.skip('the Ray test needs the [ray] extra: pip install -e ".[ray]"', allow_module_level=True)
pytest.importorskip("httpx", reason='the Ray test needs the [examples] extra: pip install -e ".[examples]"')

import psutil  # noqa: E402

from bicodec_shm.client.streaming import DecodeStream  # noqa: E402
from bicodec_shm.deploy.processes import is_serving  # noqa: E402
from bicodec_shm.protocol.header import read_header, stats_from_header  # noqa: E402
from bicodec_shm.protocol.names import leftover_objects, random_name  # noqa: E402
from bicodec_shm.protocol.names import unlink_all as unlink_segment  # noqa: E402

if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from examples.decode_api import DECODER_HEADER, _stream_body  # noqa: E402
from examples.http_tts import load  # noqa: E402

NODE_IP = "127.0.0.2"  # loopback, and not an address Ray rewrites (127.0.0.1 and localhost are)
START_TIMEOUT = 120
REQUESTS = 64


# Neither Ray nor Serve can take a bound socket, so their ports are numbers chosen ahead
# (support.free_port): a start that finds one taken is retried on fresh ports (PortClash).
# (Checked on Ray 2.x with the GCS port held: `ray start` exits 1 quoting "Address already in
# use" in its hint, which it prints for any failed gRPC start: those are retried too.)
_PORT_TAKEN = re.compile(r"already (in use|occupied)|address in use|EADDRINUSE|failed to bind", re.IGNORECASE)


class LocalCluster:
    """A head and a second node, each a ``ray start`` in its own session (process group)."""

    def __init__(self, temp_dir: str) -> None:
        self.temp_dir = temp_dir
        self.port = free_port()
        self.address = f"{NODE_IP}:{self.port}"
        self.groups: list[int] = []  # one process group per node
        self.log_path = os.path.join(temp_dir, "ray-start.log")
        # Workers import this checkout's bicodec_shm and examples; the fixed metrics ports of
        # the autoscaler and the dashboard move to free ones so parallel clusters never clash.
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
                        AUTOSCALER_METRIC_PORT=str(free_port()), DASHBOARD_METRIC_PORT=str(free_port()),
                        RAY_USAGE_STATS_ENABLED="0")  # fmt: skip

    def start_node(self, resource: str, worker_ports: int) -> subprocess.Popen:
        command = [RAY, "start", "--node-ip-address", NODE_IP, "--num-cpus", "3",
                   "--resources", f'{{"{resource}": 1}}', "--disable-usage-stats",
                   "--object-store-memory", str(80 * 2**20),
                   "--node-manager-port", str(free_port()), "--object-manager-port", str(free_port()),
                   "--dashboard-agent-listen-port", str(free_port()),
                   "--dashboard-agent-grpc-port", str(free_port()),
                   "--runtime-env-agent-port", str(free_port()),
                   "--metrics-export-port", str(free_port()),
                   "--min-worker-port", str(worker_ports),
                   "--max-worker-port", str(worker_ports + 99)]  # fmt: skip
        if not self.groups:
            command += ["--head", "--port", str(self.port), "--temp-dir", self.temp_dir,
                        "--include-dashboard=false",
                        "--ray-client-server-port", str(free_port())]  # fmt: skip
        else:
            command += ["--address", self.address]
        self._log_start = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
        with open(self.log_path, "a") as log:
            proc = subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip
        self.groups.append(proc.pid)  # its session's process group: every process of the node
        return proc

    def check_started(self, proc: subprocess.Popen, what: str) -> None:
        """``ray start`` exited 0; else PortClash if its log says a port was taken, else skip."""
        if proc.wait(START_TIMEOUT) == 0:
            return
        said = self.log()[self._log_start:]
        if _PORT_TAKEN.search(said):
            raise PortClash(f"{what} failed ({proc.returncode}): {_PORT_TAKEN.search(said).group(0)!r}")
        pytest.skip(f"{what} failed ({proc.returncode}):\n{said[-3000:]}")

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def restart(self) -> None:
        """Kill both nodes and start them again on fresh ports (PortClash as ``_start_cluster``)."""
        self.kill()
        fresh = _start_cluster()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        self.__dict__.update(fresh.__dict__)

    def processes(self) -> list[psutil.Process]:
        """Every process of the cluster: the nodes' process groups, and their descendants (Ray
        workers, which put themselves in groups of their own, and the decoders they own)."""
        found = {p.pid: p for p in psutil.process_iter() if _pgid(p.pid) in self.groups}
        for root in list(found.values()):
            try:
                found.update((c.pid, c) for c in root.children(recursive=True))
            except psutil.NoSuchProcess:
                pass
        return list(found.values())

    def replicas_per_node(self) -> list[int]:
        """Serve replicas under each node's raylet."""
        counts = []
        for group in self.groups:
            found = {p.pid: p for p in psutil.process_iter() if _pgid(p.pid) == group}
            for root in list(found.values()):
                found.update((c.pid, c) for c in root.children(recursive=True))
            counts.append(sum(p.name().startswith("ray::ServeReplica") for p in found.values()))
        return counts

    def kill(self, *, spare_decoders: bool = False) -> list[psutil.Process]:
        """SIGKILL every process of both nodes (``ray stop --force``, for this cluster only);
        with ``spare_decoders``, not the decoder servers: they must stop on their own when
        their actor dies. Returns the processes killed."""
        victims = [p for p in self.processes() if not (spare_decoders and _is_decoder(p))]
        for group in self.groups:  # first the raylets, so that no new worker starts meanwhile
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in victims:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(victims, timeout=30)
        return victims


def _is_decoder(p: psutil.Process) -> bool:
    try:
        return p.cmdline()[1:4] == ["-m", "bicodec_shm", "serve"]  # not its keeper: Ray kills that
    except psutil.Error:
        return False


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def _start_cluster() -> LocalCluster:
    """Two started nodes, on ports chosen now (PortClash if one was taken meanwhile)."""
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    cluster = LocalCluster(temp_dir)
    try:
        cluster.check_started(cluster.start_node("node_a", 20000 + 200 * (os.getpid() % 100)),
                              "ray start --head")  # fmt: skip
        cluster.check_started(cluster.start_node("node_b", 20100 + 200 * (os.getpid() % 100)),
                              "ray start (second node)")  # fmt: skip
        return cluster
    except BaseException:
        cluster.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    """Two started nodes; killed afterwards, pass or fail, with their temp dir removed."""
    cluster = retry_on_port_clash(_start_cluster, what="the Ray cluster")
    try:
        yield cluster
    finally:
        cluster.kill()
        shutil.rmtree(cluster.temp_dir, ignore_errors=True)


def _deploy(cluster: LocalCluster, prefix: str, http_port: int) -> None:
    """``python -m examples.ray_serve.app``: the README's Python-API deployment."""
    command = [sys.executable, "-m", "examples.ray_serve.app", "--address", cluster.address,
               "--http-port", str(http_port), "--prefix", prefix, "--nodes", "2", "--replicas-per-node", "2",
               "--concurrency", "8", "--timeout", "120", "--replica-cpus", "1", "--decoder-cpus", "1",
               "--serve-args=--preset tiny --seed 0 --threads 1"]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=cluster.env, capture_output=True, text=True,
                          timeout=START_TIMEOUT)  # fmt: skip
    assert done.returncode == 0, f"deploy failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"


def _deploy_on_a_free_port(cluster: LocalCluster, prefix: str) -> int:
    """``_deploy`` with Serve's HTTP port chosen now; PortClash if another process holds it
    (Serve's proxy could not bind it: the deployment cannot be reached)."""
    port = free_port()
    _deploy(cluster, prefix, port)
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        listeners = {c.pid for c in psutil.net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port}  # fmt: skip
        if listeners:
            ours = {p.pid for p in cluster.processes()}
            if listeners <= ours:
                return port
            raise PortClash(f"Serve's HTTP port {port} is held by another process {sorted(listeners - ours)}")
        assert time.monotonic() < deadline, f"nothing listens on Serve's HTTP port {port}"
        time.sleep(0.1)


def _decoders(prefix: str) -> list[str]:
    return sorted(e for e in os.listdir("/dev/shm") if e.startswith(f"{prefix}-") and "." not in e)


def _requests_of(name: str) -> int:
    return stats_from_header(read_header(name))["requests"]


def _decoder_requests(case: load.Case) -> int:
    """How many decoder requests one case makes: 1 for a decode, a stream's windows (counted
    by running the app's own stream loop against a counting stand-in for the client)."""
    if case.kind != "stream":
        return 1

    class Counting:
        calls = 0

        def decode(self, semantic, global_ids, **kwargs):
            raise AssertionError("the app streams with decode_async")

        async def decode_async(self, semantic, global_ids, **kwargs):
            Counting.calls += 1
            return np.zeros(320 * len(semantic), np.float32)

    stream = DecodeStream(Counting(), case.global_ids, preset="exact")

    async def drain() -> None:
        async for _ in _stream_body(stream, np.asarray(case.semantic)):
            pass

    asyncio.run(drain())
    return Counting.calls


def _check_answers(results: list[load.Result], names: list[str]) -> Counter:
    """Every answer right (WAVs within 1 LSB of the lone decode); -> decoder requests per name."""
    problems = [f"{r.case.kind} {r.case.path}: {r.problems}" for r in results if r.problems]
    assert problems == [], "\n".join(problems)
    sent: Counter = Counter()
    for r in results:
        served_by = r.headers.get(DECODER_HEADER.lower())
        assert served_by in names, (served_by, names)
        if r.case.status == 200:
            semantic, global_ids = np.asarray(r.case.semantic), np.asarray(r.case.global_ids)
            assert_lone_int16(load.read_wav(r.body), semantic, global_ids)
            sent[served_by] += _decoder_requests(r.case)
    return sent


async def _load_and_kill(url: str, cases: list[load.Case], victim: str,
                         after_requests: int) -> tuple[list[load.Result], float]:  # fmt: skip
    """Send the load; once ``victim`` has answered ``after_requests`` requests, SIGKILL it.
    Returns the results and the seconds until a new server served ``victim`` again."""
    killed_at = 0.0

    async def kill_under_load() -> float:
        nonlocal killed_at
        while _requests_of(victim) < after_requests:
            await asyncio.sleep(0.01)
        pid = stats_from_header(read_header(victim))["server_pid"]
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        while not (is_serving(victim) and stats_from_header(read_header(victim))["server_pid"] != pid):
            await asyncio.sleep(0.05)
        return time.monotonic() - killed_at

    killer = asyncio.create_task(kill_under_load())
    results = await load.run_load(url, cases, concurrency=REQUESTS, timeout=180)
    assert 0 < killed_at < time.monotonic(), "the load ended before the decoder was killed"
    return results, await asyncio.wait_for(killer, START_TIMEOUT)


@pytest.mark.timeout(400)
def test_two_nodes_each_with_its_decoder_through_serve_then_a_killed_decoder_restarts(cluster):
    t0 = time.monotonic()
    prefix = random_name("bcshm-ray")
    try:
        # On a clash Serve is already started on the lost port: a fresh cluster tries a fresh one.
        attempts = []

        def deploy() -> int:
            if attempts:
                cluster.restart()
                for name in _decoders(prefix):
                    unlink_segment(name)
            attempts.append(1)
            return _deploy_on_a_free_port(cluster, prefix)

        http_port = retry_on_port_clash(deploy, what="Ray Serve's HTTP proxy")
        deployed = time.monotonic() - t0
        names = _decoders(prefix)
        assert len(names) == 2, names  # one decoder per node, named after its node id
        url = f"http://127.0.0.1:{http_port}"

        # 64 concurrent requests; each node's decoder counts exactly its own replicas' traffic.
        cases = load.make_cases(REQUESTS, seed=0, max_len=200)
        results = asyncio.run(load.run_load(url, cases, concurrency=REQUESTS, timeout=180))
        sent = _check_answers(results, names)
        counted = {name: _requests_of(name) for name in names}
        per_node = Counter(r.headers[DECODER_HEADER.lower()] for r in results)
        print(f"\nray: deployed in {deployed:.0f} s; {load.format_summary(load.summarize(results))}")
        print(f"ray: answers per node {dict(per_node)}; decoder requests sent {dict(sent)}, "
              f"counted {counted}")  # fmt: skip
        assert all(sent[name] > 0 for name in names), sent  # both nodes served
        assert cluster.replicas_per_node() == [2, 2]
        assert counted == dict(sent)

        # SIGKILL one node's decoder under load: nothing fails, and Ray restarts it.
        victim = names[0]
        old_pid = stats_from_header(read_header(victim))["server_pid"]
        old_actor = psutil.Process(old_pid).parent().parent()  # server <- keeper <- actor
        assert old_actor.name().startswith("ray::NodeDecoder"), old_actor.name()
        cases = load.make_cases(REQUESTS, seed=1, max_len=200)
        results, back_after = asyncio.run(_load_and_kill(url, cases, victim, counted[victim] + 4))
        new = stats_from_header(read_header(victim))
        new_actor = psutil.Process(new["server_pid"]).parent().parent()
        print(f"ray: killed decoder pid {old_pid} (actor pid {old_actor.pid}) under load; Ray restarted it "
              f"as pid {new['server_pid']} (actor pid {new_actor.pid}), serving {back_after:.1f} s after "
              f"the kill\n{load.format_summary(load.summarize(results))}")  # fmt: skip
        _check_answers(results, names)
        assert new["server_pid"] != old_pid and new_actor.pid != old_actor.pid
        assert new_actor.name().startswith("ray::NodeDecoder")
        assert new_actor in cluster.processes()  # a Ray worker of this cluster

        # Kill the cluster: every decoder gets SIGTERM from its dying actor and unlinks itself.
        servers = [psutil.Process(stats_from_header(read_header(n))["server_pid"]) for n in names]
        killed = cluster.kill(spare_decoders=True)
        _, alive = psutil.wait_procs(servers, timeout=30)
        left = {name: leftover_objects(name) for name in names}
        print(f"ray: killed {len(killed)} Ray processes after {time.monotonic() - t0:.0f} s; decoders "
              f"still running: {alive}; left in /dev/shm: {left}")  # fmt: skip
        assert left == {name: [] for name in names}
        assert alive == [] and [p for p in killed if p.is_running()] == []
        assert cluster.processes() == []
    finally:
        cluster.kill()
        for proc in psutil.process_iter(["cmdline"]):  # a failed test leaves no decoder either
            if any(arg.startswith(f"{prefix}-") for arg in proc.info["cmdline"] or ()):
                proc.kill()
        for name in _decoders(prefix):
            unlink_segment(name)
