"""The HTTP listener of the API server, the workers and the router, set up for a hostile
network: a deadline for each request's headers and body, a cap on open connections, bodies
of a bounded size, and little unsent data kept per connection."""

import asyncio
import ipaddress
import socket
import sys
from dataclasses import dataclass

import h11
import uvicorn
from fastapi import FastAPI, Request
from uvicorn.config import STARTUP_FAILURE
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvfence.options import option
from kvfence.server.errors import APIError

# Unsent bytes the kernel keeps per connection: a client that stops reading then blocks its
# stream after tens of KB, instead of the megabytes a send buffer grows to on its own.
UNSENT_BYTES_LIMIT = 16 * 1024


@dataclass(kw_only=True)
class Listener:
    host: str = option(
        "127.0.0.1",
        "address to listen on; a non-loopback host without --api-keys prints a warning",
        metavar="HOST",
    )
    port: int = option(8000, "port to listen on", metavar="PORT")
    max_body_bytes: int = option(4 * 1024 * 1024, "largest request body accepted")
    header_timeout: float = option(
        10.0,
        "seconds a client may take to send a request's headers before its connection is "
        "closed (from the connection's first byte, or the request's)",
        metavar="SECONDS",
    )
    body_timeout: float = option(
        30.0, "seconds a client may take to send a request's body before a 408", metavar="SECONDS"
    )
    max_connections: int = option(
        512, "open connections at once; past it a request gets 503 at once"
    )

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "header_timeout", "body_timeout", "max_connections"):
            if getattr(self, name) <= 0:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be over 0, not {getattr(self, name)}")

    @property
    def public(self) -> bool:
        """Whether it listens beyond this machine."""
        try:
            return not ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return self.host != "localhost"


def protocol(header_timeout: float, body_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, with a deadline for each request's headers: a client that
    sends them a byte at a time (slowloris), or nothing at all, loses its connection. A
    request answered before its body was read (401, 413) may send the rest of it within
    --body-timeout; the connection then closes (the body is never read)."""

    class HeaderDeadline(H11Protocol):
        deadline: asyncio.TimerHandle | None = None
        draining: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.deadline = self.loop.call_later(header_timeout, self.headers_too_slow)

        def data_received(self, data: bytes) -> None:
            if self.deadline is None and self.conn.their_state is h11.IDLE:  # a new request
                self.deadline = self.loop.call_later(header_timeout, self.headers_too_slow)
            super().data_received(data)
            if self.deadline is not None and self.conn.their_state is not h11.IDLE:
                self.deadline.cancel()  # its headers are in
                self.deadline = None
            if self.draining is not None and self.conn.their_state is not h11.SEND_BODY:
                self.draining.cancel()  # the unread body is all in: nothing is left to reset
                self.draining = None
                self.transport.close()

        def connection_lost(self, exc) -> None:
            for timer in (self.deadline, self.draining):
                if timer is not None:
                    timer.cancel()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.conn.their_state is h11.SEND_BODY and self.draining is None:
                self.draining = self.loop.call_later(body_timeout, self.transport.close)

        def headers_too_slow(self) -> None:
            self.deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline


async def read_body(request: Request, listener: Listener) -> bytes:
    """The whole body, within --max-body-bytes (413) and --body-timeout (408)."""
    limit = listener.max_body_bytes
    too_large = APIError(413, f"request body over the {limit}-byte limit", code="body_too_large")
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks = []

    async def read() -> None:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), listener.body_timeout)
    except asyncio.TimeoutError:
        raise APIError(
            408,
            f"the request body took over {listener.body_timeout:g} s to arrive",
            type="timeout_error",
            code="body_timeout",
        ) from None
    return b"".join(chunks)


def serve(app: FastAPI, listener: Listener, **uvicorn_options) -> None:
    """Runs the app with uvicorn within the listener's limits, on a socket that holds little
    unsent data, so that a stream whose client stops reading is soon not pulled (and aborted,
    --stream-stall-timeout)."""
    config = uvicorn.Config(
        app,
        host=listener.host,
        port=listener.port,
        http=protocol(listener.header_timeout, listener.body_timeout),
        limit_concurrency=listener.max_connections,
        log_level="warning",
        access_log=False,
        **uvicorn_options,
    )
    sock = config.bind_socket()
    if hasattr(socket, "TCP_NOTSENT_LOWAT"):  # Linux and macOS
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, UNSENT_BYTES_LIMIT)
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    if not server.started:
        sys.exit(STARTUP_FAILURE)
