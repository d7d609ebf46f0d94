"""The HTTP side of the metrics endpoint: ``GET /metrics`` answered from one event-loop thread.

A scraper sends one short request and reads one response, so a connection costs a coroutine
and a socket, never a thread: the request is read without blocking and must arrive whole within
``REQUEST_TIMEOUT_S`` (total, so a client sending a byte now and then cannot stretch it);
at most ``MAX_CONNECTIONS`` are open at once (a new one closes the oldest, so a scrape still gets
in during a flood of idle connections), and the body is rendered by a pool of ``MAX_RENDERS``
threads. Each response closes its connection (HTTP/1.0 semantics; Prometheus reconnects per
scrape anyway).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("bicodec_shm.metrics")

# Seconds a client has to send its whole request, and then to take the response.
REQUEST_TIMEOUT_S = 5.0
# Connections open at once; a scraper needs one.
MAX_CONNECTIONS = 64
# Threads that render a scrape's body (prometheus_client's collectors run in them).
MAX_RENDERS = 2
# The request line and headers a scraper sends are a few hundred bytes.
MAX_REQUEST_BYTES = 16 * 1024

# A client that sent too little, too much or too slowly, or went away.
_DROPPED = (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError)

# (Accept header) -> (body, content type)
Render = Callable[[str], tuple[bytes, str]]


class MetricsEndpoint:
    """Serve ``render`` on ``host:port`` from a daemon thread until :meth:`close`.

    Raises OSError if the address cannot be bound (in use, or not one of this host's).
    """

    def __init__(self, host: str, port: int, render: Render, *, paths: tuple[str, ...] = ("/metrics", "/"),
                 request_timeout: float | None = None) -> None:  # fmt: skip
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        self._sock = socket.socket(family, kind, proto)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind(address)
            self._sock.listen(128)
        except BaseException:
            self._sock.close()
            raise
        self._sock.setblocking(False)
        self.port: int = self._sock.getsockname()[1]
        self._render, self._paths = render, paths
        self._timeout = REQUEST_TIMEOUT_S if request_timeout is None else request_timeout
        self._renders = ThreadPoolExecutor(MAX_RENDERS, thread_name_prefix="bicodec-shm-metrics-render")
        # The open connections, oldest first, and the tasks answering them (evicted ones included).
        self._open: collections.OrderedDict[asyncio.StreamWriter, None] = collections.OrderedDict()
        self._tasks: set[asyncio.Task] = set()
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._serve(),),
                                        name="bicodec-shm-metrics", daemon=True)  # fmt: skip
        self._thread.start()

    def close(self) -> None:
        """Stop serving and release the port; a scrape being rendered finishes first."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join()
        self._loop.close()
        self._renders.shutdown(wait=True)
        self._sock.close()

    async def _serve(self) -> None:
        server = await asyncio.start_server(self._connection, sock=self._sock, limit=MAX_REQUEST_BYTES)
        async with server:
            await self._stop.wait()
            for writer in list(self._open):
                writer.transport.abort()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)  # type: ignore[arg-type]
        self._open[writer] = None
        if len(self._open) > MAX_CONNECTIONS:  # the oldest is the likeliest to be stuck
            oldest, _ = self._open.popitem(last=False)
            oldest.transport.abort()
        answered = False
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self._timeout)
            status, body, content_type = await self._answer(head)
            writer.write(b"HTTP/1.0 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n"
                         b"Connection: close\r\n\r\n%s" % (status.encode(), content_type.encode(), len(body),
                                                             body))  # fmt: skip
            await asyncio.wait_for(writer.drain(), self._timeout)
            answered = True
        except _DROPPED:
            pass  # a client that sent too little, too much or too slowly, or went away: close
        finally:
            self._open.pop(writer, None)
            self._tasks.discard(task)  # type: ignore[arg-type]
            if answered:
                writer.close()  # flushes what the kernel has not taken yet
            else:
                writer.transport.abort()  # nothing is owed: drop it now, unsent bytes included

    async def _answer(self, head: bytes) -> tuple[str, bytes, str]:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return "400 Bad Request", b"bad request\n", "text/plain"
        if parts[0] != "GET":
            return "405 Method Not Allowed", b"only GET\n", "text/plain"
        if parts[1].split("?", 1)[0] not in self._paths:
            return "404 Not Found", b"try /metrics\n", "text/plain"
        accept = next((line.split(":", 1)[1].strip() for line in lines[1:]
                       if line.lower().startswith("accept:")), "")  # fmt: skip
        try:
            body, content_type = await asyncio.get_running_loop().run_in_executor(self._renders, self._render,
                                                                                  accept)  # fmt: skip
        except Exception:
            log.exception("a metrics scrape failed")
            return "500 Internal Server Error", b"scrape failed; see the server's log\n", "text/plain"
        return "200 OK", body, content_type
