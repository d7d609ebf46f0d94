"""A tiny-model server that starts serving only when told to, so that a test can start two at
the same moment.

Usage: python race_server.py NAME GO_FILE

Prints "armed" once torch is imported and the model is built, waits for GO_FILE to exist, then
constructs the server: prints "serving" and serves until SIGTERM, or prints "refused: ..." and
exits 3 if another server owns the name.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from bicodec_shm.errors import ServerAlreadyRunningError
from bicodec_shm.model import BiCodecDecoder
from bicodec_shm.server.server import DecoderServer

if __name__ == "__main__":
    name, go = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    model = BiCodecDecoder.from_config("tiny", seed=0)
    print("armed", flush=True)
    while not os.path.exists(go):
        time.sleep(0.001)
    try:
        server = DecoderServer(model, name, slots=4, lanes=1)
    except ServerAlreadyRunningError as exc:
        print(f"refused: {exc}", flush=True)
        sys.exit(3)
    print("serving", flush=True)
    server.serve_forever()
