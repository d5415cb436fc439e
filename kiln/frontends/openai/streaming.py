"""The SSE event sequence of a streamed completion or chat completion.

    opening chunks (chat: the role), then one chunk per engine output of any
    choice (the one carrying finish_reason is that choice's only terminal
    chunk), then the usage chunk if asked, then [DONE].

An error after the stream began is sent as an error event before [DONE]
(the HTTP status is already 200 by then). If the client goes away, the
response cancels this generator and the merge aborts every choice.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Protocol

from kiln.errors import KilnError
from kiln.frontends.errors import error_body
from kiln.frontends.openai.common import Usage
from kiln.frontends.openai.streams import close_all, merge
from kiln.frontends.sse import DONE, sse_event
from kiln.llm.engine.async_llm import RequestStream
from kiln.llm.outputs import RequestOutput

log = logging.getLogger(__name__)


class ChunkBuilder(Protocol):
    def opening(self, index: int) -> list[dict]: ...
    def chunk(self, index: int, out: RequestOutput) -> dict: ...


async def stream_events(
    streams: list[RequestStream], chunks: ChunkBuilder, usage: Usage, head: dict, include_usage: bool
) -> AsyncIterator[bytes]:
    try:
        for index in range(len(streams)):
            for opening in chunks.opening(index):
                yield sse_event(opening)
        async with contextlib.aclosing(merge(streams)) as merged:
            async for index, out in merged:
                usage.add_delta(out)
                yield sse_event(chunks.chunk(index, out))
        if include_usage:
            yield sse_event({**head, "choices": [], "usage": usage.body()})
    except KilnError as e:
        yield sse_event(error_body(e.message, e.error_type, e.param, e.http_status))
    except Exception:
        log.exception("stream %s failed", head.get("id"))
        yield sse_event(error_body("internal server error", "internal_error", None, 500))
    finally:
        close_all(streams)
    yield DONE
