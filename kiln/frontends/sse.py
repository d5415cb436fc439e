"""Server-Sent Events: `data: <json>\\n\\n` frames, and a response that
notices a client going away even while it has nothing to send.

Starlette's StreamingResponse (ASGI spec >= 2.4) learns of a disconnect
only when a write fails; a request still queued writes nothing, so it would
keep its slot. SSEResponse always listens for `http.disconnect` and then
cancels the body iterator, whose cleanup aborts the engine request.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import anyio
import msgspec
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"
_encoder = msgspec.json.Encoder()


def sse_event(obj: Any) -> bytes:
    return b"data: " + _encoder.encode(obj) + b"\n\n"


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, content, on_close: Callable[[], None] | None = None, **kwargs):
        """`on_close` runs however the response ends, even if the body never started."""
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **kwargs.pop("headers", {})}
        super().__init__(content, media_type=self.media_type, headers=headers, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._stream_until_disconnect(receive, send)
        finally:
            if self.on_close is not None:
                self.on_close()

    async def _stream_until_disconnect(self, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg:

            async def stream_then_stop() -> None:
                with contextlib.suppress(OSError):  # the client went away mid-write
                    await self.stream_response(send)
                tg.cancel_scope.cancel()

            async def listen_then_stop() -> None:
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()

            tg.start_soon(stream_then_stop)
            tg.start_soon(listen_then_stop)
