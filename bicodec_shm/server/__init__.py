"""The decoder server: one process owns the model and the segment and batches every client's
requests.

    server.py       ``DecoderServer``: the lanes' dispatcher, publishing, reaping, lifecycle
    lanes.py        decode lanes: run a planned batch on the device, convert, copy back
    lane_tuner.py   how many lanes (and threads each), measured on the live traffic
    lane_control.py which lanes take batches now, and each one's threads (the tuner applied)
    batching.py     which ready requests go together: length classes and the token budget
    batch_costs.py  what a batch costs, fitted on the server's own batches; batch only where it pays
    dispatch_policy.py  plan the next batch now, or wait for the running batch's clients: measured
    counters.py     the live counters and histograms in the segment header
    reaping.py      reclaiming the slots of clients that are gone
    adapters.py     the codec seam: a batch of requests -> the decoder's (or encoder's) tensors and back
    encoding.py     the encode direction: the encoder checked, one kind per plan, codes published
    metrics.py      the Prometheus endpoint over the segment's live counters
    metrics_http.py its HTTP side: one event-loop thread, request deadlines, bounded connections
    signals.py      SIGINT and SIGTERM as a graceful stop

May import: ``model``, ``protocol``, ``codecs`` and ``errors`` (torch is imported by server.py
and lanes.py); never the client, deploy or tools layers.
"""
