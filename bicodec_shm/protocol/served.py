"""Which names are being served right now, for the messages of a user who typed a wrong one.

``/dev/shm`` holds every POSIX shared-memory object of this IPC namespace. A name is served if
the object's first 8 bytes are a segment's or a server group's magic and a live process holds
its SERVING lock (``header.read_record``: one open per name, no pid trusted). Objects of
other users are not listed: a client would not attach to them.
"""

from __future__ import annotations

import os
import re

import numpy as np

from ..errors import BiCodecShmError
from .header import read_record
from .layout import GROUP_MAGIC, MAGIC
from .names import validate_name

SHM_DIR = "/dev/shm"
_MAGIC_DT = np.dtype([("magic", "<u8")])
_MEMBER_RE = re.compile(r"^(?P<group>.+)\.[0-9]{1,3}$")


def served_names() -> dict[str, str]:
    """``{name: "server" | "group"}`` for every name served now, sorted by name."""
    try:
        entries = sorted(os.listdir(SHM_DIR))
    except OSError:
        return {}
    served: dict[str, str] = {}
    for entry in entries:
        if entry.startswith("sem."):
            continue  # a semaphore, not a segment
        try:
            validate_name(entry)
            record = read_record(entry, _MAGIC_DT)
        except (ValueError, OSError, BiCodecShmError):
            continue  # not a name of ours, another user's object, or gone in between
        if record is None or not record[1]:
            continue
        magic = int(record[0]["magic"])
        if magic in (MAGIC, GROUP_MAGIC):
            served[entry] = "group" if magic == GROUP_MAGIC else "server"
    return served


def describe_served(*, exclude: str | None = None) -> str:
    """One clause naming what is served now: "served now: 'a', 'tts' (a group of 2)", or that
    nothing is. A served group's members are folded into it; ``exclude`` is left out."""
    served = served_names()
    groups = {name for name, kind in served.items() if kind == "group"}
    members: dict[str, int] = {}
    shown = []
    for name in served:
        m = _MEMBER_RE.match(name)
        if m and m["group"] in groups:
            members[m["group"]] = members.get(m["group"], 0) + 1
        elif name != exclude:
            shown.append(name)
    if not shown:
        return "no bicodec-shm server of this user is serving on this host now"
    parts = [f"{name!r}" + (f" (a group of {members.get(name, 0)} members up)" if name in groups else "")
             for name in shown]  # fmt: skip
    return "served now: " + ", ".join(parts)
