"""Taking and giving semaphore posts without trusting them: bounded drains, tolerant posts.

Whoever may post a segment's semaphore may post it as fast as a core allows, so nothing here
waits for a semaphore to empty, and a post refused because the semaphore is full is no error.
These work on a named semaphore (``posix_ipc.Semaphore``) and on a segment's own
(``shared_sems.SharedSemaphore``) alike.
"""

from __future__ import annotations

import errno

import posix_ipc

# The most posts one ``drain`` takes. Whoever may open a semaphore may post it, as fast as a
# core allows (tens of millions a second, faster than they can be taken): a drain that ran
# until the semaphore was empty would never end under such a flood. A bounded drain is enough,
# because nothing trusts a post: the scan that follows a ``ready`` drain looks at every READY
# slot, and an answer is read only if its identity names the request (layout.py), so whatever
# posts a drain leaves behind cost a spurious wake-up at most. Well-behaved peers leave a few.
DRAIN_MOST = 64


def drain(sem: posix_ipc.Semaphore, most: int = DRAIN_MOST) -> int:
    """Take the pending posts of ``sem`` without blocking, at most ``most`` of them (a flood
    of posts must not keep the caller here); returns how many it took."""
    for n in range(most):
        try:
            sem.acquire(0)
        except posix_ipc.BusyError:
            return n
    return most


def take_post(sem: posix_ipc.Semaphore) -> bool:
    """Take one post of ``sem`` if there is one, without blocking."""
    try:
        sem.acquire(0)
        return True
    except posix_ipc.BusyError:
        return False


def post(sem: posix_ipc.Semaphore) -> None:
    """Post ``sem``; one already at its maximum value (a flood of posts) is left as it is: it
    holds posts enough to wake whoever waits, and our post says nothing more."""
    try:
        sem.release()
    except OSError as exc:
        if exc.errno != errno.EOVERFLOW:
            raise
