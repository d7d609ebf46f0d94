"""``python -m bicodec_shm.tools.soak``: the same as ``bicodec-shm soak``, and how the soak
starts its client and probe processes (``client ...``, ``probe ...``)."""

from __future__ import annotations

import sys

from . import main

sys.exit(main())
