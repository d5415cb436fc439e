"""One streamed request against an OpenAI-compatible server, timed.

Timing starts just before the request is sent. TTFT is the first chunk that
carries text; each later chunk with text adds an inter-token latency (a chunk
may hold several tokens; ITL is per chunk, as other serving benchmarks do).
Output tokens come from the usage chunk, or are counted as chunks without it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from kiln.bench.dataset import WorkItem


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Target:
    base_url: str
    model: str
    endpoint: str = "completions"  # or "chat"
    api_key: str | None = None
    exact_output_len: bool = True  # send min_tokens + ignore_eos (Kiln, vLLM)

    def url(self) -> str:
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        return self.base_url.rstrip("/") + path

    def body(self, item: WorkItem) -> dict:
        body = {
            "model": self.model,
            "max_tokens": item.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0.0,
        }
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": item.prompt}]
        else:
            body["prompt"] = item.prompt
        if self.exact_output_len:
            body.update(min_tokens=item.max_tokens, ignore_eos=True)
        return body

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def _chunk_text(chunk: dict) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


async def send(client: httpx.AsyncClient, target: Target, item: WorkItem) -> RequestResult:
    result = RequestResult(ok=False)
    started = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", target.url(), json=target.body(item), headers=target.headers()) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {body[:200]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])[:200]
                    return result
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
                    result.output_tokens = chunk["usage"].get("completion_tokens", 0)
                if _chunk_text(chunk) or _has_finish(chunk):
                    if chunks == 0:
                        result.ttft = now - started
                    else:
                        result.itls.append(now - last)
                    chunks += 1
                    last = now
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e = last - started
    result.output_tokens = result.output_tokens or chunks
    result.ok = chunks > 0
    if not result.ok:
        result.error = "no output"
    return result


def _has_finish(chunk: dict) -> bool:
    return any(c.get("finish_reason") for c in chunk.get("choices") or [])
