"""``bicodec-shm bench``: decode throughput of bicodec-shm against what users do today.

One module per concern (the command line's help, ``cli.py``, says what is measured):

- ``workload``: each client's endless stream of requests, lengths drawn from a mix (in frames)
  and codes drawn with the codec's layout (``--codec``);
- ``standin``: the device-shaped stand-in decoder and the ideal batcher it is measured against;
- ``config``: system names, defaults, the targets, ``Policy`` and ``Setup``;
- ``decoding``: how the systems without a server decode: the codec's adapter, the server's call;
- ``workers``: the child processes of every system (servers, clients, the no-IPC limit);
- ``sampling``: RSS and CPU sampling of those processes, and the machine record;
- ``systems``: the parent's side of each system, run for one window;
- ``results``: ``RunResult``, what one run measured, from the records inside the window;
- ``orchestrate``: the order of the runs, ``bench_all`` and ``bench_sweep``;
- ``calibrate``: before the runs, one process's start and one request's decode, timed: the
  estimated run time and requests per window;
- ``report``: medians over repeats, ratios per repeat, the targets, the noise flags, the text
  tables;
- ``plot``: the PNG (needs matplotlib, the ``[plot]`` extra);
- ``options``: the options that name server keywords, bicodec-shm variants (``--lanes``,
  ``--dispatch``, ``--batching``) and stand-in costs, parsed and checked;
- ``cli``: the options, ``run_and_report`` and ``main``.
"""

from __future__ import annotations

from .cli import add_arguments, main, run_and_report

__all__ = ["add_arguments", "main", "run_and_report"]
