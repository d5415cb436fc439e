"""uvicorn's httptools protocol with the limits a public server needs.

uvicorn bounds neither the size nor the number of request headers (with
httptools), nor how long a client may take to send a request: a 1 MB header
or 10,000 headers are read in full, and a half-sent request holds its
connection for as long as the client likes. Here, per connection:

- the request head (request line + headers) may hold `max_header_bytes`
  bytes and `max_header_count` headers: past either, 431 and the connection
  closes (the bytes of a head still incomplete are bounded the same way, so
  a never-ending header cannot grow memory either);
- the head must be complete `timeout_header_s` after its first byte (or
  after the connection opened): else 408 and close (slow-loris);
- a request still being sent that sends nothing for `timeout_idle_s`, or
  whose body is not complete `timeout_body_s` after its head, gets 408 and
  the connection closes (the application sees a disconnect): a byte every few
  seconds no longer holds a connection forever. Time the server itself stops
  reading (flow control) counts against neither;
- at most `max_connections` connections are open at once: one more gets 503
  and is closed at once, before anything is read, so the connections already
  admitted (and their requests) are untouched;
- at most `MAX_PIPELINED` pipelined requests wait behind the one being
  answered: past that, the bytes already read wait unparsed and the
  connection is not read until the queue drains. uvicorn resumes reading
  after every response, so a client that pipelines without reading its
  answers would otherwise queue requests (and their answers) without bound.
  Answers themselves wait for the transport's write buffer to drain
  (uvicorn's `FlowControl`, driven by `pause_writing`/`resume_writing`).

Idle keep-alive connections between requests are uvicorn's
(`timeout_keep_alive`). Writes go through `CoalescingTransport` (a response's
head and body in one send).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kiln.config import ServerConfig
from kiln.server.coalescing import CoalescingTransport

# Requests parsed ahead of the one being answered, per connection. Enough for
# any client that pipelines to keep the server busy; the bytes behind them wait.
MAX_PIPELINED = 16
# The parser is fed this much at a time, so it stops soon after the queue is
# full: one slice holds at most FEED_BYTES / 18 requests ("GET / HTTP/1.1" and
# two CRLFs is the shortest), so the queue never exceeds MAX_PIPELINED + that.
# The rest of a body of known length is fed whole (it holds no request; small
# slices would make uvicorn append a large body to itself 4 KiB at a time).
FEED_BYTES = 4096


@dataclass(frozen=True)
class HttpLimits:
    max_header_bytes: int
    max_header_count: int
    timeout_header_s: float
    timeout_idle_s: float
    timeout_body_s: float
    max_connections: int

    @classmethod
    def of(cls, config: ServerConfig) -> HttpLimits:
        return cls(config.max_header_bytes, config.max_header_count, config.timeout_header_s, config.timeout_idle_s,
                   config.timeout_body_s, config.max_connections)


class _HeadTooLarge(Exception):
    """Raised from a parser callback: httptools stops and uvicorn answers (431, see send_400_response)."""


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    limits: HttpLimits  # set on the subclass `protocol_class` makes

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        over_capacity = len(self.connections) >= self.limits.max_connections  # counted before this one joins
        super().connection_made(CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]
        self.flow = _HeldFlow(self.transport, may_read=self._may_read)
        self._head_timer: asyncio.TimerHandle | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._in_head = self._receiving = self._declares_body = False  # a refused connection never reaches _start_head
        self._body_left = 0
        self._body_deadline = 0.0
        self._rejection: bytes | None = None
        self._unparsed = memoryview(b"")  # read, not yet fed to the parser: waits while the pipeline is full
        if over_capacity:
            self.transport.write(_response(503, f"more than {self.limits.max_connections} open connections"))
            self.transport.close()
            return
        self._start_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._receiving:
            self._arm_idle()
        if not self._unparsed and len(data) <= FEED_BYTES and not self._pipeline_full():
            self._feed(data)  # the common case: a read no larger than one slice, nothing held back
            if self._pipeline_full():
                self.flow.pause_reading()
        else:
            self._unparsed = memoryview(bytes(self._unparsed) + data) if self._unparsed else memoryview(data)
            self._parse_unparsed()
        self._arm_body_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # starts the next pipelined request; its resume_reading waits for _may_read
        if self._unparsed and not self.transport.is_closing():  # nothing held back: uvicorn's resume did it all
            self._parse_unparsed()
            self.flow.resume_reading()  # as uvicorn does after each response, once nothing is held back

    # ---- pipelining ------------------------------------------------------------
    def _parse_unparsed(self) -> None:
        """Feed what was read to the parser until it is used up or the pipeline is full."""
        while self._unparsed and not self._pipeline_full() and not self.transport.is_closing():
            size = max(FEED_BYTES, self._body_left)
            piece, self._unparsed = self._unparsed[:size], self._unparsed[size:]
            self._feed(piece)
        if self._unparsed or self._pipeline_full():
            self.flow.pause_reading()  # resumed by on_response_complete once a queued request is answered

    def _pipeline_full(self) -> bool:
        return len(self.pipeline) >= MAX_PIPELINED

    def _may_read(self) -> bool:
        return not self._unparsed and not self._pipeline_full()

    def _feed(self, piece: bytes | memoryview) -> None:
        if self._in_head:
            self._head_bytes += len(piece)
        super().data_received(piece)  # type: ignore[arg-type]  # httptools reads any buffer
        if self._in_head and self._head_bytes > self.limits.max_header_bytes and not self.transport.is_closing():
            self._reject_head(f"request head exceeds {self.limits.max_header_bytes} bytes")

    # ---- parser callbacks ------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._in_head:
            self._start_head()

    def on_url(self, url: bytes) -> None:
        self._head_size += len(url)
        self._check_head()
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_size += len(name) + len(value) + 4
        self._head_count += 1
        self._check_head()
        lowered = name.lower()
        if lowered == b"content-length":
            self._declares_body = True
            if value.isdigit():  # llhttp refuses the request if it is not
                self._body_left = int(value)
        elif lowered == b"transfer-encoding":
            self._declares_body = True
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if self._declares_body:  # the timer itself only if the body is still coming when this read ends
            self._body_deadline = self.loop.time() + self.limits.timeout_body_s
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._body_left = max(0, self._body_left - len(body))
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._receiving, self._body_left = False, 0
        self._cancel_timers()
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        if self._rejection is None:
            super().send_400_response(msg)
            return
        self.transport.write(self._rejection)
        self.transport.close()

    # ---- limits ----------------------------------------------------------------
    def _start_head(self) -> None:
        self._in_head, self._receiving, self._declares_body = True, True, False
        self._body_left = 0  # bytes of this request's body still to come, where its Content-Length says
        self._head_bytes = self._head_size = self._head_count = 0
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.limits.timeout_header_s, self._head_timed_out)
        self._arm_idle()

    def _check_head(self) -> None:
        if self._head_count > self.limits.max_header_count:
            self._rejection = _response(431, f"more than {self.limits.max_header_count} request headers")
            raise _HeadTooLarge
        if self._head_size > self.limits.max_header_bytes:
            self._rejection = _response(431, f"request head exceeds {self.limits.max_header_bytes} bytes")
            raise _HeadTooLarge

    def _reject_head(self, message: str) -> None:
        self._cancel_timers()
        self.transport.write(_response(431, message))
        self.transport.close()

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._in_head and not self.transport.is_closing():
            self._time_out(f"request head not received within {self.limits.timeout_header_s}s")

    def _arm_idle(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self._idle_timer = self.loop.call_later(self.limits.timeout_idle_s, self._idle_timed_out)

    def _idle_timed_out(self) -> None:
        self._idle_timer = None
        if not self._receiving or self.transport.is_closing():
            return
        if self.flow is not None and self.flow.read_paused:
            self._arm_idle()  # the server is not reading: the client is not idle
            return
        self._time_out(f"request sent nothing for {self.limits.timeout_idle_s}s")

    def _arm_body_deadline(self) -> None:
        """A body still arriving after a read gets its deadline timer (most arrive whole with their head:
        a timer armed and cancelled for each of those cost ~5% of small requests' throughput)."""
        if (self._receiving and self._declares_body and not self._in_head and self._body_timer is None
                and not self.transport.is_closing()):
            delay = max(0.0, self._body_deadline - self.loop.time())
            self._body_timer = self.loop.call_later(delay, self._body_timed_out)

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if not self._receiving or self.transport.is_closing():
            return
        if self.flow.read_paused:  # the server is not reading: look again soon
            self._body_timer = self.loop.call_later(1.0, self._body_timed_out)
            return
        self._time_out(f"request body not received within {self.limits.timeout_body_s}s")

    def _time_out(self, message: str) -> None:
        """408 (where it cannot be taken for the answer to an earlier request) and close."""
        self._cancel_timers()
        if self._may_answer():
            self.transport.write(_response(408, message))
        self.transport.close()  # an unfinished request: its handler sees a disconnect

    def _may_answer(self) -> bool:
        """No response is under way or owed first: one written now answers the request being received."""
        if self.pipeline:
            return False
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            return True
        # Past its head, the request being received is the one running (nothing queued before it).
        return not self._in_head and not cycle.response_started

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._idle_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._idle_timer = self._body_timer = None


class _HeldFlow(FlowControl):
    """uvicorn's flow control, except that reading stays paused while the protocol holds bytes back.

    uvicorn resumes reading whenever a handler waits for its body (`receive`)
    or a response ends; each such read would add to the bytes held unparsed.
    """

    def __init__(self, transport: asyncio.Transport, may_read: Callable[[], bool]):
        super().__init__(transport)
        self._may_read = may_read

    def resume_reading(self) -> None:
        if self._may_read():
            super().resume_reading()


def _response(status: int, message: str) -> bytes:
    reason = {408: "Request Timeout", 431: "Request Header Fields Too Large", 503: "Service Unavailable"}[status]
    body = message.encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


def protocol_class(limits: HttpLimits) -> type[LimitedHttpToolsProtocol]:
    """The protocol uvicorn instantiates per connection, with these limits."""
    return type("KilnHttpProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})
