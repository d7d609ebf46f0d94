"""Soak test: a server and N client processes for a given time, killing clients (and optionally
the server) at random, verifying every result against the request's own lone decode.

Same as ``bicodec-shm soak``; see ``bicodec_shm/tools/soak/__init__.py`` for what each counter means.

    python benchmarks/soak.py --duration 600 --clients 16 --kill-every 1 --kill-server-every 60
"""

import sys

from bicodec_shm.tools.soak import main

if __name__ == "__main__":
    sys.exit(main())
