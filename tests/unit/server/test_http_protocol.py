"""LimitedHttpToolsProtocol against real sockets: a uvicorn server in a thread, a tiny app."""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import replace

import uvicorn

from kiln.server.http_protocol import FEED_BYTES, MAX_PIPELINED, HttpLimits, protocol_class

LIMITS = HttpLimits(max_header_bytes=32768, max_header_count=100, timeout_header_s=10, timeout_idle_s=30,
                    timeout_body_s=60, max_connections=4096)
READ_BYTES = 256 * 1024  # the most one read of asyncio's or uvloop's transports returns
GET = b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n"
# More requests than the kernel's socket buffers hold (tcp_rmem's 32 MiB + tcp_wmem's 4 MiB at most here):
# 200,000 (5.6 MB) fitted in them, so the client could send them all with the server reading nothing.
LOTS = 2_000_000


async def echo_path(scope, receive, send):
    """Answers every request with its path (and the size of its body, if any) after reading its whole body."""
    if scope["type"] != "http":
        return
    more, size = True, 0
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = scope["path"].encode() + (b":%d" % size if size else b"")
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


class Watched:
    """The server's protocols, and the most it ever queued or buffered on one connection."""

    def __init__(self):
        self.max_pipeline = self.max_unsent = self.max_held = 0

    def protocol(self, limits: HttpLimits):
        watched = self

        class Watching(protocol_class(limits)):
            def data_received(self, data):
                super().data_received(data)
                watched.max_held = max(watched.max_held, len(self._unparsed))

            def on_headers_complete(self):
                super().on_headers_complete()
                watched.max_pipeline = max(watched.max_pipeline, len(self.pipeline))
                watched.max_unsent = max(watched.max_unsent, self.transport.get_write_buffer_size())
        return Watching


@contextlib.contextmanager
def serving(limits: HttpLimits = LIMITS, app=echo_path):
    watched = Watched()
    config = uvicorn.Config(app, host="127.0.0.1", port=0, http=watched.protocol(limits), log_level="error",
                            lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield server.servers[0].sockets[0].getsockname()[1], watched
    finally:
        server.should_exit = True
        thread.join(10)


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def test_a_client_that_pipelines_without_reading_makes_the_server_queue_a_bounded_amount():
    with serving() as (port, watched):
        client = connect(port)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.settimeout(0.5)
        sent = 0
        with contextlib.suppress(TimeoutError):  # the server stops reading: our send blocks
            while sent < LOTS:
                client.sendall(GET * 1000)
                sent += 1000
        client.close()
    assert sent < LOTS  # the server stopped reading, so the client could not go on
    assert watched.max_pipeline <= MAX_PIPELINED + FEED_BYTES // len(GET)
    assert watched.max_unsent < 1 << 20
    assert watched.max_held <= READ_BYTES  # what one read brings: no further read while bytes are held


def test_a_reading_client_gets_every_pipelined_answer_in_order():
    n = 5000
    with serving() as (port, _):
        client = connect(port)
        requests = b"".join(b"GET /%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(n))
        sender = threading.Thread(target=client.sendall, args=(requests,))
        sender.start()
        received = b""
        while received.count(b"HTTP/1.1 200") < n or not received.endswith(b"/%d" % (n - 1)):
            chunk = client.recv(1 << 16)
            assert chunk, "connection closed early"
            received += chunk
        sender.join()
        client.close()
    bodies = [part.rsplit(b"\r\n\r\n", 1)[-1] for part in received.split(b"HTTP/1.1 200 OK\r\n")[1:]]
    assert bodies == [b"/%d" % i for i in range(n)]


def read_all(client: socket.socket) -> bytes:
    received = b""
    while chunk := client.recv(65536):
        received += chunk
    return received


def test_a_body_sent_a_byte_at_a_time_gets_408_at_the_body_deadline():
    with serving(replace(LIMITS, timeout_body_s=1.0)) as (port, _):
        client = connect(port)
        client.sendall(b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
        started = time.monotonic()
        with contextlib.suppress(OSError):  # the server closes while we still send
            for _ in range(100):
                client.sendall(b"a")  # never idle for long: only the deadline stops it
                time.sleep(0.1)
                if time.monotonic() - started > 5:
                    break
        received = read_all(client)
        elapsed = time.monotonic() - started
    assert received.startswith(b"HTTP/1.1 408 "), received
    assert b"request body not received within 1.0s" in received
    assert 0.9 < elapsed < 3


def test_a_body_that_stops_arriving_gets_408_at_the_idle_timeout():
    with serving(replace(LIMITS, timeout_idle_s=0.5)) as (port, _):
        client = connect(port)
        client.sendall(b"POST /stops HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        received = read_all(client)
    assert received.startswith(b"HTTP/1.1 408 ") and b"sent nothing for 0.5s" in received, received


def test_connections_past_the_cap_get_503_and_those_admitted_keep_working():
    with serving(replace(LIMITS, max_connections=2)) as (port, _):
        admitted = [connect(port), connect(port)]
        time.sleep(0.2)  # both accepted before the third arrives
        refused = connect(port)
        assert read_all(refused).startswith(b"HTTP/1.1 503 ")
        for client in admitted:
            client.sendall(b"GET /still-served HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert read_all(client).endswith(b"/still-served")
        time.sleep(0.2)  # their connections are gone: a new one is admitted
        again = connect(port)
        again.sendall(b"GET /again HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert read_all(again).endswith(b"/again")


def test_bodies_among_pipelined_requests_arrive_whole_and_the_queue_stays_bounded():
    sizes = [0, 1, 5000, 300_000, 3, 2_000_000, 0, 70_000] * 3
    requests = b"".join(
        b"POST /%d HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (i, size) + b"b" * size + GET * 50
        for i, size in enumerate(sizes)
    )
    with serving() as (port, watched):
        client = connect(port)
        sender = threading.Thread(target=client.sendall, args=(requests,))
        sender.start()
        received = b""
        while received.count(b"HTTP/1.1 ") < len(sizes) * 51 or not received.endswith(b"/x"):
            chunk = client.recv(1 << 16)
            assert chunk, received[-300:]
            received += chunk
        sender.join()
        client.close()
    bodies = [part.rsplit(b"\r\n\r\n", 1)[-1] for part in received.split(b"HTTP/1.1 200 OK\r\n")[1:]]
    expected = []
    for i, size in enumerate(sizes):
        expected += [b"/%d:%d" % (i, size) if size else b"/%d" % i] + [b"/x"] * 50
    assert bodies == expected
    assert watched.max_pipeline <= MAX_PIPELINED + FEED_BYTES // len(GET)
