"""A tiny-model server whose every batch takes DELAY seconds, so a test can kill it mid-batch.

Usage: python slow_server.py NAME DELAY
"""

from __future__ import annotations

import sys
import time

import torch

from bicodec_shm.model import BiCodecDecoder
from bicodec_shm.server.server import DecoderServer


class SlowDecoder:
    def __init__(self, delay: float) -> None:
        self.model = BiCodecDecoder.from_config("tiny", seed=0)
        self.device, self.config, self.delay = self.model.device, self.model.config, delay

    def detokenize(self, *args):
        time.sleep(self.delay)
        return self.model.detokenize(*args)


if __name__ == "__main__":
    torch.set_num_threads(1)
    DecoderServer(SlowDecoder(float(sys.argv[2])), sys.argv[1], reap_interval=0.1).serve_forever()
