"""With ``--mode 0o660`` a member of the server's group harms only its own requests.

The server runs as root here and its members as uid 1000 with root's group (``setpriv``, the
``unprivileged_python`` fixture: skipped without root, failed under CI). A member receives the
segment over NAME.sock (handoff.py) and may write any byte of it and post any semaphore in it,
like the server's own user; what it may no longer do is what only a named object allowed:

- truncate or grow the segment (the server and every worker died with SIGBUS): it is a memfd
  sealed against both, and its semaphores are inside it;
- take the name's OWNER or SERVING lock after a crash (a restarted server then refused to
  start, and ``stats`` said a dead server served): the name's own object is mode 0o600;
- keep a stopped server's memory allocated by hard-linking its segment: a memfd has no name
  to link, and the name's own object holds a header's copy only, which it may not link either.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from conftest import serve_command
from support import (
    assert_lone_int16,
    check_in_forked_child,
    seed_int16,
    seeded_request,
    single_decode,
    wait_for,
)

from bicodec_shm import DecoderClient
from bicodec_shm.deploy import processes
from bicodec_shm.deploy.processes import is_serving
from bicodec_shm.errors import SegmentError
from bicodec_shm.protocol.group import member_names
from bicodec_shm.protocol.handoff import connect, socket_path
from bicodec_shm.protocol.layout import Transport
from bicodec_shm.protocol.names import leftover_objects, random_name, unlink_all
from bicodec_shm.protocol.segment import Segment

ROOT = Path(__file__).resolve().parents[1]

# Everything a member tries against what it was handed and what the name holds; prints, per
# attempt, "done" or the errno's name.
_ATTACKS = r"""
import errno, fcntl, json, os, sys
from bicodec_shm.protocol.handoff import connect
name, owner = sys.argv[1], int(sys.argv[2])
conn, fd = connect(name, owner)
size = os.fstat(fd).st_size
out = {}
def attempt(what, fn):
    try:
        fn()
        out[what] = "done"
    except OSError as e:
        out[what] = errno.errorcode.get(e.errno, str(e.errno))
attempt("truncate the segment", lambda: os.ftruncate(fd, 0))
attempt("grow the segment", lambda: os.ftruncate(fd, size + 4096))
attempt("seal it against new writers", lambda: fcntl.fcntl(fd, fcntl.F_ADD_SEALS, 0x10))
attempt("link the segment", lambda: os.link(f"/proc/self/fd/{fd}", f"/dev/shm/{name}-kept"))
attempt("open the name", lambda: os.open(f"/dev/shm/{name}", os.O_RDWR))
attempt("read the name", lambda: os.open(f"/dev/shm/{name}", os.O_RDONLY))
attempt("link the name", lambda: os.link(f"/dev/shm/{name}", f"/dev/shm/{name}-kept"))
assert os.fstat(fd).st_size == size
print(json.dumps(out))
"""

# A member's own requests, decoded through a handle that trusts the server's uid.
_DECODE = r"""
import sys
import numpy as np
from bicodec_shm import DecoderClient
name, owner, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rng = np.random.default_rng(7)
reqs = [(rng.integers(0, 8192, 20 + 7 * i), rng.integers(0, 4096, 32)) for i in range(3)]
with DecoderClient(name, owner_uid=owner, timeout=60) as client:
    got = [client.decode(s, g, dtype="float32") for s, g in reqs]
np.savez(out, **{f"sem_{i}": s for i, (s, _) in enumerate(reqs)},
         **{f"glb_{i}": g for i, (_, g) in enumerate(reqs)}, **{f"pcm_{i}": p for i, p in enumerate(got)})
"""

# A member's handle across its server's crash and restart: decodes once, then again when told
# (while no server serves), and must get its answer from the successor.
_DECODE_ACROSS = r"""
import sys
import numpy as np
from bicodec_shm import DecoderClient
name, owner = sys.argv[1], int(sys.argv[2])
with DecoderClient(name, owner_uid=owner, timeout=60) as client:
    first = client.decode([5] * 30, list(range(32)), dtype="float32")
    print("attached", flush=True)
    sys.stdin.readline()
    again = client.decode([5] * 30, list(range(32)), dtype="float32")
print("same" if np.array_equal(first, again) else "different", flush=True)
"""

# Holds what a member can of a server's liveness: its own locks on every lock byte of the
# segment it was handed, and its connection, until killed.
_HOLD_LOCKS = r"""
import os, sys, time
from bicodec_shm.protocol.handoff import connect
from bicodec_shm.protocol.layout import OWNER_BYTE, SERVING_BYTE
from bicodec_shm.protocol.locks import try_lock
conn, fd = connect(sys.argv[1], int(sys.argv[2]))
mine = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
assert try_lock(mine, OWNER_BYTE) and try_lock(mine, SERVING_BYTE)
print("holding", flush=True)
time.sleep(600)
"""


def _member(user) -> list[str]:
    """The unprivileged uid, as a member of the server's (root's) group."""
    return [a if a != "--clear-groups" else f"--groups={os.getgid()}" for a in user.prefix]


def _run_member(user, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*_member(user), *args], env=user.env, cwd=user.home, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def _member_decodes(user, name: str) -> None:
    """A member's requests come back exactly as the single-item decode."""
    out = os.path.join(user.home, f"{name}.npz")
    done = _run_member(user, "-c", _DECODE, name, str(os.geteuid()), out)
    assert done.returncode == 0, done.stderr
    with np.load(out) as got:
        for i in range(3):
            np.testing.assert_allclose(got[f"pcm_{i}"], single_decode(got[f"sem_{i}"], got[f"glb_{i}"]),
                                       atol=1e-5, rtol=0)  # fmt: skip
    os.unlink(out)


def _own_client_decodes(name: str) -> None:
    sem, glb = seeded_request(11, 40)
    with DecoderClient(name, timeout=60) as client:
        np.testing.assert_allclose(client.decode(sem, glb, dtype="float32"), single_decode(sem, glb),
                                   atol=1e-5, rtol=0)  # fmt: skip


def test_a_member_can_neither_resize_the_segment_nor_open_or_link_the_name(start_server, shm_name,
                                                                           unprivileged_python):  # fmt: skip
    server = start_server("--mode", "0o660", "--slots", "4")
    try:
        attacks = _run_member(unprivileged_python, "-c", _ATTACKS, shm_name, str(os.geteuid()))
        assert attacks.returncode == 0, attacks.stderr
        assert json.loads(attacks.stdout) == {
            "truncate the segment": "EPERM", "grow the segment": "EPERM",
            "seal it against new writers": "EPERM", "link the segment": "EXDEV",
            "open the name": "EACCES", "read the name": "EACCES", "link the name": "EPERM"}  # fmt: skip
        assert server.poll() is None, "the server died"
        _own_client_decodes(shm_name)  # the server and the other members serve on
        _member_decodes(unprivileged_python, shm_name)
    finally:
        for entry in (f"{shm_name}-kept",):
            if os.path.lexists(f"/dev/shm/{entry}"):
                os.unlink(f"/dev/shm/{entry}")


def test_a_member_holding_every_lock_it_can_does_not_keep_a_crashed_server_down(
        start_server, shm_name, unprivileged_python):  # fmt: skip
    first = start_server("--mode", "0o660", "--slots", "4")
    holder = subprocess.Popen([*_member(unprivileged_python), "-c", _HOLD_LOCKS, shm_name, str(os.geteuid())],
                              env=unprivileged_python.env, cwd=unprivileged_python.home,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    before = DecoderClient(shm_name, timeout=30)  # attached before the crash, used after it
    argv = [*_member(unprivileged_python), "-c", _DECODE_ACROSS, shm_name, str(os.geteuid())]
    member = subprocess.Popen(argv, env=unprivileged_python.env, cwd=unprivileged_python.home, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert member.stdout.readline() == "attached\n"
        sem, glb = seeded_request(12, 30)
        assert_lone_int16(before.decode(sem, glb), sem, glb)
        assert holder.stdout.readline() == "holding\n"
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        wait_for(lambda: not is_serving(shm_name), 10, "the crashed server to be seen as gone")
        member.stdin.write("go\n")  # its next request goes out while nothing serves
        member.stdin.close()
        second = start_server("--mode", "0o660", "--slots", "4")  # waits until it serves
        stats = subprocess.run([sys.executable, "-m", "bicodec_shm", "stats", shm_name, "--json"], cwd=ROOT,
                               capture_output=True, text=True, timeout=60)  # fmt: skip
        assert stats.returncode == 0, stats.stderr
        assert json.loads(stats.stdout)["server_pid"] == second.pid
        _own_client_decodes(shm_name)
        assert_lone_int16(before.decode(sem, glb), sem, glb)  # it saw its server's end close
        assert member.stdout.readline() == "same\n" and member.wait(60) == 0  # served by the successor
        _member_decodes(unprivileged_python, shm_name)
    finally:
        before.close()
        member.kill()
        member.wait()
        member.stdout.close()
        holder.kill()
        holder.wait()
        holder.stdout.close()


def test_a_stopped_server_leaves_nothing_whatever_a_member_held(start_server, shm_name, unprivileged_python):
    """A member that tried every link it could and then stopped: nothing of the server stays in
    /dev/shm, and the segment's memory went with the server (no name keeps it)."""
    server = start_server("--mode", "0o660", "--slots", "16", "--max-tokens", "1500")
    attacks = _run_member(unprivileged_python, "-c", _ATTACKS, shm_name, str(os.geteuid()))
    assert attacks.returncode == 0, attacks.stderr
    server.send_signal(signal.SIGTERM)
    assert server.wait(30) == 0
    assert leftover_objects(shm_name) == []
    assert not [e for e in os.listdir("/dev/shm") if e.startswith(shm_name)]


_LISTEN_AS_ANOTHER_USER = r"""
import os, socket, sys, time
from bicodec_shm.protocol.handoff import GREETING, create_sealed
path = f"/dev/shm/{sys.argv[1]}.sock"
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(path)
os.chmod(path, 0o666)
listener.listen(8)
fd = create_sealed("squatter", 1 << 20)
print("listening", flush=True)
while True:
    conn, _ = listener.accept()
    try:
        socket.send_fds(conn, [GREETING], [fd])
    except OSError:
        pass  # the client hung up first
"""


def test_a_socket_another_user_listens_on_is_refused(unprivileged_python):
    """Another user binds NAME.sock while the name is free: a client refuses what it hands over
    (the peer's uid is the kernel's word), and a server refuses to start under the name."""
    name = random_name("bcshm-test")
    squatter = subprocess.Popen(unprivileged_python.argv("-c", _LISTEN_AS_ANOTHER_USER, name),
                                env=unprivileged_python.env, cwd=unprivileged_python.home,
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert squatter.stdout.readline() == "listening\n"
        with pytest.raises(SegmentError, match=f"served by uid {unprivileged_python.uid}, not by uid"):
            connect(name)
        with pytest.raises(SegmentError, match="refusing another user's server"):
            DecoderClient(name, timeout=2)
        assert not is_serving(name)
        argv = [sys.executable, "-m", "bicodec_shm", "serve", "--preset", "tiny", "--name", name,
                "--mode", "0o660"]  # fmt: skip
        serve = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert serve.returncode == 1
        last = serve.stderr.splitlines()[-1]
        assert last.startswith("bicodec-shm: error: ") and socket_path(name) in last, serve.stderr
        assert "Traceback" not in serve.stderr
    finally:
        squatter.kill()
        squatter.wait()
        squatter.stdout.close()
        unlink_all(name)  # as root: the other user's socket and anything of ours
    assert leftover_objects(name) == []


def test_a_member_uses_a_server_group_shared_with_it(shm_name, unprivileged_python, tmp_path):
    """A group of servers (one per device) started with ``--mode 0o660``: the group object and
    every member segment are handed over sockets, and a member's handle uses them all."""
    members = member_names(shm_name, 2)
    with open(tmp_path / "supervisor.log", "wb") as log:
        argv = serve_command(shm_name, "--device", "cpu,cpu", "--slots", "4", "--mode", "0o660")
        proc = subprocess.Popen(argv, cwd=ROOT, stderr=log)
    try:
        processes.wait_until_serving(shm_name, proc, timeout=120)
        for name in (shm_name, *members):
            assert {e: os.stat(f"/dev/shm/{e}").st_mode & 0o777 for e in leftover_objects(name)} == {
                name: 0o600, f"{name}.sock": 0o660}  # fmt: skip
        _member_decodes(unprivileged_python, shm_name)
    finally:
        processes.stop_server(proc, timeout=60)
        for name in (shm_name, *members):
            wait_for(lambda name=name: leftover_objects(name) == [], 30, f"{name} to be removed")


def test_a_shared_segment_serves_threads_asyncio_and_a_forked_child_like_a_named_one(thread_server, shm_name):
    """The same user's handle on a segment handed over the socket: more threads than slots, asyncio
    requests (the bell is a semaphore in the segment too) and a child forked while calls run, each
    answer its lone decode's."""
    thread_server(mode=0o660, slots=4)
    reqs = [seeded_request(100 + i, 10 + 3 * i) for i in range(12)]
    client = DecoderClient(shm_name, slots=2, timeout=60)
    expected_first = seed_int16(single_decode(*reqs[0])).astype(np.int32)  # before any thread runs
    try:
        assert client._att.segment.transport == Transport.SOCKET
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(client.decode, s, g) for s, g in reqs]

            def child_decodes_on_its_own_attachment():
                pcm = client.decode(*reqs[0])  # compared with numpy only (see check_in_forked_child)
                exact = np.abs(pcm.astype(np.int32) - expected_first).max() <= 1
                return exact and client._att is not None and client._att.segment.transport == Transport.SOCKET

            check_in_forked_child(child_decodes_on_its_own_attachment)
            for (s, g), f in zip(reqs, futures):
                assert_lone_int16(f.result(), s, g)

        async def all_at_once():
            return await asyncio.gather(*(client.decode_async(s, g) for s, g in reqs))

        for (s, g), pcm in zip(reqs, asyncio.run(all_at_once())):
            assert_lone_int16(pcm, s, g)
    finally:
        client.close()


_SERVE_AND_FORK = r"""
import os, sys, time
sys.path.insert(0, sys.argv[2])
from support import reference_model
from bicodec_shm.server.server import DecoderServer
server = DecoderServer(reference_model(), sys.argv[1], slots=2, max_tokens=50, mode=0o660)
server.start_thread()  # the constructor already serves the name
print("serving", flush=True)
sys.stdin.readline()  # a client is attached: its connection is one of ours now
if os.fork() == 0:  # a child of the server's process that outlives it
    time.sleep(60)
    os._exit(0)
print("forked", flush=True)
time.sleep(600)
"""


def test_a_child_forked_from_the_servers_process_does_not_keep_it_looking_alive(shm_name):
    """The server's process forks (an embedding application's worker) and then dies: its clients
    see it gone at once, not when the child exits, as the named path's locks already do."""
    proc = subprocess.Popen([sys.executable, "-c", _SERVE_AND_FORK, shm_name, str(ROOT / "tests")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    seg = None
    try:
        assert proc.stdout.readline() == "serving\n"
        seg = Segment.attach(shm_name)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "forked\n" and seg.serving()
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        wait_for(lambda: not seg.serving(), 5, "the client to see its server's end close")
    finally:
        if seg is not None:
            seg.close()
        os.killpg(proc.pid, signal.SIGKILL)  # the child too
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()
        unlink_all(shm_name)


_UNPRIVILEGED_SHARED_SERVER = r"""
import sys
from bicodec_shm.protocol.segment import Segment
name = sys.argv[1]
seg = Segment.create(name, n_slots=2, max_tokens=10, mode=0o660)
seg.start_serving()
client = Segment.attach(name)  # over the socket, as another process of the user would
print(int(client.transport), client.serving(), client.layout.n_slots)
client.close()
seg.stop_serving()
seg.unlink()
seg.close()
"""


def test_an_unprivileged_user_serves_a_shared_segment(unprivileged_python):
    """Not root: the memfd, its seals and the socket in the sticky /dev/shm need no privilege, and
    a client of the same user attaches over the socket."""
    name = random_name("bcshm-test")
    try:
        done = unprivileged_python.run("-c", _UNPRIVILEGED_SHARED_SERVER, name)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == [str(int(Transport.SOCKET)), "True", "2"]
    finally:
        unlink_all(name)
    assert leftover_objects(name) == []
