"""``python -m bicodec_shm.tools.bench``: the same as ``bicodec-shm bench``."""

from __future__ import annotations

import sys

from .cli import main

sys.exit(main())
