"""Ray: one shared decoder per Ray node, and TTS replicas that attach to their own node's.

Shared memory ends at the host, so a Ray cluster gets one decoder per node, beside that node's
TTS replicas::

    node A (node id a1b2…)                     node B (node id c3d4…)
    ┌──────────────────────────────────┐       ┌──────────────────────────────────┐
    │ actor bicodec-shm-decoder-a1b2…  │       │ actor bicodec-shm-decoder-c3d4…  │
    │  └ bicodec-shm serve             │       │  └ bicodec-shm serve             │
    │      --name bicodec-shm-a1b2…    │       │      --name bicodec-shm-c3d4…    │
    │ replica 1 ─┐ one DecoderClient   │       │ replica 3 ─┐                     │
    │ replica 2 ─┘ each, /dev/shm      │       │ replica 4 ─┘                     │
    └──────────────────────────────────┘       └──────────────────────────────────┘

- **One decoder per node.** ``NodeDecoder`` is a detached actor pinned to its node
  (``NodeAffinitySchedulingStrategy(soft=False)``) that owns a ``bicodec-shm serve`` process.
  Its segment name is ``PREFIX-NODEID``, so nodes never collide, not even two Ray nodes that
  share one ``/dev/shm``. It holds ``DecoderSpec.num_gpus`` GPUs: Ray sets the actor's
  ``CUDA_VISIBLE_DEVICES`` and the server inherits it, so ``--device cuda:0`` is the GPU Ray
  gave it.
- **Replicas attach locally.** ``local_decoder()``, called once in a replica's constructor, gets
  (or starts) this node's decoder and returns its name for ``DecoderClient``. Every replica on
  the node batches into the same forward passes; no audio crosses the network.
- **Restarts.** If the server dies the actor exits, and Ray restarts it (``max_restarts=-1``) on
  the same node with a new server under the same name; the replicas' clients resubmit what was
  in flight, as after any restart. If the actor dies (SIGKILL, ``ray stop``), the server gets
  SIGTERM (PR_SET_PDEATHSIG, through a keeper process that takes the SIGKILL Ray sends a dead
  worker's children): it finishes its batches and unlinks its segment. When a node leaves, its
  decoder and its replicas go with it.

Ray itself is the ``[ray]`` extra: ``pip install "bicodec-shm[ray]"``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import BiCodecShmError, MissingExtraError
from ..protocol.header import read_header
from ..protocol.names import unlink_all, validate_name
from .processes import die_with_parent, keeper_command, serve_command, wait_until_serving

try:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError:  # pragma: no cover - the extra is installed wherever the tests run
    raise MissingExtraError(
        'bicodec_shm.deploy.ray needs Ray, the [ray] extra: pip install "bicodec-shm[ray]"'
    ) from None

DEFAULT_PREFIX = "bicodec-shm"
NAMESPACE = "bicodec_shm"  # the Ray namespace of the decoder actors, whoever creates them
MAX_PREFIX = 60  # + "-" + a 56-character node id stays within the protocol's 120-character names


@dataclass(frozen=True)
class DecoderSpec:
    """What each node's decoder runs and what it reserves from Ray.

    Args:
        serve_args: ``bicodec-shm serve`` options after ``--name`` (which this module sets), e.g.
            ``("--model-dir", "/models/Spark-TTS-0.5B", "--device", "cuda:0", "--slots", "32")``.
        prefix: segment names are ``PREFIX-NODEID``; actors ``PREFIX-decoder-NODEID``.
        num_cpus, num_gpus, resources: the decoder actor's Ray resources (its server's).
        start_timeout: seconds a server may take to load its model and serve.

    The first replica on a node starts that node's decoder with its spec; later callers on the
    node get the running one, so give every deployment that shares a prefix the same spec.
    """

    serve_args: Sequence[str] = ()
    prefix: str = DEFAULT_PREFIX
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: Mapping[str, float] = field(default_factory=dict)
    start_timeout: float = 300.0

    def __post_init__(self) -> None:
        validate_name(self.prefix)
        if len(self.prefix) > MAX_PREFIX:
            raise ValueError(f"prefix must be at most {MAX_PREFIX} characters, got {len(self.prefix)}")
        if "--name" in self.serve_args:
            raise ValueError("serve_args must not set --name: it is PREFIX-NODEID on every node")


def decoder_name(node_id: str, prefix: str = DEFAULT_PREFIX) -> str:
    """The segment name of the decoder on the Ray node ``node_id`` (56 hex digits)."""
    return validate_name(f"{prefix}-{node_id}")


def actor_name(node_id: str, prefix: str = DEFAULT_PREFIX) -> str:
    """The name of the detached actor that owns the decoder of ``node_id``."""
    return f"{prefix}-decoder-{node_id}"


class NodeDecoder:
    """The actor that owns one node's ``bicodec-shm serve`` process (see the module docstring).

    The server's keeper runs as a child of a thread that lives as long as the actor, so that its
    PR_SET_PDEATHSIG (which fires when the forking *thread* exits) fires only when the actor
    process dies. The constructor returns once the server serves, or raises if it exits first
    (a bad model folder, a bad option): Ray then reports the actor dead with that error instead
    of restarting it forever.
    """

    def __init__(self, name: str, serve_args: Sequence[str], start_timeout: float) -> None:
        self.name = validate_name(name)
        self._stopping = threading.Event()
        self._served = threading.Event()
        self._spawned = threading.Event()
        self._keeper: subprocess.Popen | None = None
        self._spawn_error: BaseException | None = None
        # The actor's child is a keeper, the server its child: when a Ray worker exits, Ray
        # SIGKILLs its children, which would leave the segment behind; the keeper takes that
        # SIGKILL and the server gets SIGTERM (PR_SET_PDEATHSIG), so it unlinks its segment.
        command = keeper_command(serve_command(name, *serve_args))
        threading.Thread(target=self._own_server, args=(command,), name="bicodec-shm-server",
                         daemon=True).start()  # fmt: skip
        self._spawned.wait()
        if self._keeper is None:
            raise BiCodecShmError(f"could not start {command}: {self._spawn_error}")
        wait_until_serving(name, self._keeper, timeout=start_timeout)
        self._served.set()
        if self._keeper.poll() is not None:  # died just after serving, before _served was set
            os._exit(1)

    def _own_server(self, command: list[str]) -> None:
        """The thread that starts the keeper, and ends the actor when the server dies."""
        try:
            # Its own session: a signal to Ray's process groups (a terminal's Ctrl-C, a
            # worker's group kill) reaches the server only as SIGTERM through the keeper.
            self._keeper = subprocess.Popen(command, preexec_fn=die_with_parent(), start_new_session=True)
        except BaseException as exc:  # reported by the constructor
            self._spawn_error = exc
            return
        finally:
            self._spawned.set()
        code = self._keeper.wait()
        if self._stopping.is_set() or not self._served.is_set():
            return  # stop() asked for it, or the constructor reports the failed start
        # The server died on its own (a crash, an OOM kill, SIGKILL): end this actor process, so
        # that Ray restarts the actor, and with it a server under the same name.
        print(f"bicodec-shm: the decoder {self.name!r} exited with code {code}; "
              "exiting so that Ray restarts this actor", file=sys.stderr, flush=True)  # fmt: skip
        os._exit(1)

    def info(self) -> dict[str, Any]:
        """Where this decoder runs: its name, node, server pid and actor pid."""
        context = ray.get_runtime_context()
        return {
            "name": self.name,
            "node_id": context.get_node_id(),
            "server_pid": _server_pid(self.name),
            "actor_pid": os.getpid(),
        }

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM the server (it finishes its batches and unlinks its segment); SIGKILL it and
        unlink here if it takes longer than ``timeout``. Returns its exit status.

        The SIGKILL goes to the keeper's process group, which holds the keeper and the server
        it started and nothing else: never to the pid a header names, which any client of the
        segment could have written."""
        self._stopping.set()
        keeper = self._keeper
        if keeper is None:
            return None
        if keeper.poll() is None:
            keeper.send_signal(signal.SIGTERM)  # passed on to the server
            try:
                keeper.wait(timeout)
            except subprocess.TimeoutExpired:
                # The keeper leads its own session (``start_new_session``) and is not reaped
                # yet, so its pid, and the group's, cannot have been reused.
                try:
                    os.killpg(keeper.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # every process of the group has exited meanwhile
                keeper.wait()
                unlink_all(self.name)
        return keeper.returncode


def _server_pid(name: str) -> int | None:
    header = read_header(name)
    return int(header["server_pid"]) if header is not None else None


_NodeDecoderActor = ray.remote(NodeDecoder)


def node_decoder(spec: DecoderSpec | None = None, node_id: str | None = None) -> Any:  # -> ActorHandle
    """The decoder actor of ``node_id`` (default: this process's node), started if there is none.

    Concurrent callers on one node (replicas starting together) get the same actor: Ray creates a
    named actor once (``get_if_exists``). The handle returns at once; ``info.remote()`` answers
    once the server serves.
    """
    spec = spec or DecoderSpec()
    node_id = node_id or ray.get_runtime_context().get_node_id()
    return _NodeDecoderActor.options(
        name=actor_name(node_id, spec.prefix),
        namespace=NAMESPACE,
        get_if_exists=True,
        lifetime="detached",  # outlives the replica that happened to start it
        max_restarts=-1,  # a dead server comes back on the same node, under the same name
        num_cpus=spec.num_cpus,
        num_gpus=spec.num_gpus,
        resources=dict(spec.resources),
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(decoder_name(node_id, spec.prefix), tuple(spec.serve_args), spec.start_timeout)


def local_decoder(spec: DecoderSpec | None = None) -> str:
    """In a replica (any Ray worker): this node's decoder name, once its server serves.

    Call it once per replica process, then attach ``DecoderClient(name)`` there.
    """
    spec = spec or DecoderSpec()
    info = ray.get(node_decoder(spec).info.remote(), timeout=spec.start_timeout + 60)
    return info["name"]


def start_node_decoders(spec: DecoderSpec | None = None, node_ids: Sequence[str] | None = None
                        ) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Start a decoder on every alive node (or on ``node_ids``) and wait until all serve.

    Replicas start their node's decoder on their own (``local_decoder``); this starts them ahead
    (so that the first replicas do not wait for a model to load). Returns ``info()`` per node id.
    """
    spec = spec or DecoderSpec()
    if node_ids is None:
        node_ids = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    handles = {node_id: node_decoder(spec, node_id) for node_id in node_ids}
    infos = ray.get([h.info.remote() for h in handles.values()], timeout=spec.start_timeout + 60)
    return dict(zip(handles, infos))


def stop_node_decoders(spec: DecoderSpec | None = None, *, timeout: float = 60.0) -> list[str]:
    """Stop every decoder actor of ``spec.prefix``: each server finishes its batches and unlinks
    its segment, then the actor is removed for good. Returns the names stopped.

    Stop the replicas first (``serve.shutdown()``): a request that arrives later finds no
    decoder and fails.
    """
    spec = spec or DecoderSpec()
    stopped = []
    for node in ray.nodes():
        try:
            actor = ray.get_actor(actor_name(node["NodeID"], spec.prefix), namespace=NAMESPACE)
        except ValueError:  # no decoder on that node
            continue
        try:
            ray.get(actor.stop.remote(timeout), timeout=timeout + 30)
        finally:
            ray.kill(actor, no_restart=True)
        stopped.append(decoder_name(node["NodeID"], spec.prefix))
    return stopped
