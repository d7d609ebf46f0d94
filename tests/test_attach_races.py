"""Attaching while a server goes away: whatever the interleaving, a client sees a documented
error (``ServerUnavailableError``, which a handle retries), never a raw posix_ipc one."""

from __future__ import annotations

import posix_ipc
import pytest

from bicodec_shm.errors import ServerUnavailableError
from bicodec_shm.protocol.header import _read_layout
from bicodec_shm.protocol.locks import _open_lock_fd, close_lock_fd
from bicodec_shm.protocol.segment import Segment


def test_a_segment_removed_between_opening_its_lock_and_mapping_it_is_server_unavailable(shm_name):
    """A restart's old server unlinks the name while a client attaches: after the client opened
    its lock descriptor (the old inode) and read the layout, the mapping's own open finds no
    object. The client must see ServerUnavailableError (which it retries), never posix_ipc's
    ExistentialError. (Found by the soak: a churn thread's DecoderClient() raised it.)"""
    server = Segment.create(shm_name, n_slots=2, max_tokens=10)
    fd = _open_lock_fd(shm_name)
    try:
        layout = _read_layout(shm_name, fd)
        posix_ipc.unlink_shared_memory(f"/{shm_name}")  # the old server's clean stop, in between
        with pytest.raises(ServerUnavailableError, match="removed while attaching"):
            Segment(shm_name, fd, layout)
    finally:
        close_lock_fd(fd)
        server.unlink()
        server.close()
