"""The command line and the tools built on the whole package: they may import any layer.

    cli.py          ``bicodec-shm``: the parser, ``serve`` and ``cleanup``
    model_args.py   the model options of serve, demo and bench, and the decoder they build
    stats_cmd.py    ``bicodec-shm stats``
    decode_cmd.py   ``bicodec-shm decode``
    demo.py         ``bicodec-shm demo``: a server and client processes, checked
    soak/           ``bicodec-shm soak``: long runs with kills and faults, every answer checked
    bench/          ``bicodec-shm bench``: the shared server against the alternatives
"""
