"""CoalescingTransport: the writes of one event-loop step leave in one send.

uvicorn writes a response's status line and headers when the app sends
`http.response.start`, and its body on `http.response.body`: two send
syscalls for every small response, and with TCP_NODELAY two segments, each
waking the client. Buffered until the end of the loop step, they go out
together (`writelines`: one writev on uvloop). A streamed response still
leaves chunk by chunk, since each chunk is sent in a step of its own.
"""

from __future__ import annotations

import asyncio
from typing import Any


class CoalescingTransport:
    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(data)

    def _flush(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, []
            if not self._transport.is_closing():
                self._transport.writelines(pending)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending = []
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(len(p) for p in self._pending)

    def __getattr__(self, name: str) -> Any:
        # Everything else (is_closing, get_extra_info, pause_reading, ...) is the transport's own.
        return getattr(self._transport, name)
