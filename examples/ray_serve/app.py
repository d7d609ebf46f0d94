"""Ray Serve in front of one shared decoder per node: the HTTP API of ``examples/http_tts``.

Each replica, when it starts, gets its own node's decoder (``bicodec_shm.deploy.ray.local_decoder``: the
first replica on a node starts it) and attaches one ``DecoderClient`` to it; every replica on a
node batches into that node's forward passes. Routes, errors and WAV output are
``examples/decode_api.py``; every answer names its decoder (so its node) in the header
``X-Bicodec-Shm-Decoder``.

On a running cluster (``ray start``), from the repository root::

    serve run examples.ray_serve.app:build replicas_per_node=2 nodes=2 serve_args="--preset tiny --threads 1"
    python -m examples.ray_serve.app --replicas-per-node 2 --nodes 2 --serve-args="--preset tiny --threads 1"

Sizing: a node runs ``replicas_per_node`` replicas (Serve's ``max_replicas_per_node``), each
taking up to ``concurrency`` requests at once (``max_ongoing_requests``) and holding as many
decoder slots, plus one for its asyncio doorbell; so each node's decoder gets
``--slots replicas_per_node × (concurrency + 1)`` unless ``serve_args`` sets ``--slots``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from ray import serve
from ray.serve import Application

from bicodec_shm.deploy.ray import DecoderSpec, local_decoder
from examples.decode_api import Settings, create_app


@serve.deployment
@serve.ingress()  # the app is built per replica, once its node's decoder is known
class DecodeService:
    """One replica: the decode API attached to this node's decoder."""

    def __init__(self, spec: DecoderSpec, timeout: float = 30.0, client_slots: int = 8) -> None:
        self.settings = Settings(name=local_decoder(spec), timeout=timeout, client_slots=client_slots,
                                 wait_for_decoder=True)  # fmt: skip

    def __serve_build_asgi_app__(self) -> Any:
        return create_app(self.settings)


def build(args: dict[str, str]) -> Application:
    """The application; ``serve run examples.ray_serve.app:build key=value ...`` passes ``args``.

    Keys: ``nodes`` (2), ``replicas_per_node`` (2), ``concurrency`` (8), ``timeout`` (30 s),
    ``serve_args`` (``bicodec-shm serve`` options for every node's decoder, default
    ``--preset tiny``), ``prefix`` (``bicodec-shm``), ``decoder_cpus`` (1), ``decoder_gpus`` (0),
    ``replica_cpus`` (0.5). Unknown keys are an error.
    """
    known = {"nodes", "replicas_per_node", "concurrency", "timeout", "serve_args", "prefix",
             "decoder_cpus", "decoder_gpus", "replica_cpus"}  # fmt: skip
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"unknown argument(s) {unknown}; the arguments are {sorted(known)}")
    nodes = int(args.get("nodes", 2))
    per_node = int(args.get("replicas_per_node", 2))
    concurrency = int(args.get("concurrency", 8))
    serve_args = shlex.split(args.get("serve_args", "--preset tiny"))
    if "--slots" not in serve_args:
        serve_args += ["--slots", str(per_node * (concurrency + 1))]
    spec = DecoderSpec(
        serve_args=tuple(serve_args),
        prefix=args.get("prefix", "bicodec-shm"),
        num_cpus=float(args.get("decoder_cpus", 1)),
        num_gpus=float(args.get("decoder_gpus", 0)),
    )
    return DecodeService.options(
        num_replicas=nodes * per_node,
        max_replicas_per_node=per_node,
        max_ongoing_requests=concurrency,
        ray_actor_options={"num_cpus": float(args.get("replica_cpus", 0.5))},
    ).bind(spec, timeout=float(args.get("timeout", 30)), client_slots=concurrency)


def main(argv: list[str] | None = None) -> int:
    """The same application through the Python API: connect, start Serve, deploy, return."""
    import ray

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", default="auto", help="the Ray cluster (default: the running one)")
    p.add_argument("--http-host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--nodes", default="2")
    p.add_argument("--replicas-per-node", default="2")
    p.add_argument("--concurrency", default="8")
    p.add_argument("--timeout", default="30")
    p.add_argument("--serve-args", default="--preset tiny")
    p.add_argument("--prefix", default="bicodec-shm")
    p.add_argument("--replica-cpus", default="0.5")
    p.add_argument("--decoder-cpus", default="1")
    args = vars(p.parse_args(argv))
    address, host, port = args.pop("address"), args.pop("http_host"), args.pop("http_port")
    ray.init(address=address, log_to_driver=False)
    # One HTTP proxy, on the head node: several Ray nodes on one test machine would all bind
    # the same port; on a real cluster "EveryNode" spreads the HTTP load instead.
    serve.start(http_options={"host": host, "port": port}, proxy_location="HeadOnly")
    serve.run(build(args), name="bicodec-shm", route_prefix="/")
    print(f"serving on http://{host}:{port}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
