"""The decoder server: one process owns the model and the segment and batches every client's
requests.

    server.py       ``DecoderServer``: the lanes' dispatcher, publishing, reaping, lifecycle
    lanes.py        decode lanes: run a planned batch on the device, convert, copy back
    lane_tuner.py   how many lanes (and threads each), measured on the live traffic
    batching.py     which ready requests go together: length classes and the token budget
    adapters.py     the codec seam: a batch of requests -> the decoder's tensors and back
    metrics.py      the Prometheus endpoint over the segment's live counters
    signals.py      SIGINT and SIGTERM as a graceful stop

May import: ``model``, ``protocol``, ``codecs`` and ``errors`` (torch is imported by server.py
and lanes.py); never the client, deploy or tools layers.
"""
