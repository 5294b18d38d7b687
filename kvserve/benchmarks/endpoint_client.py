"""One streaming request to an OpenAI-compatible server, timed chunk by chunk.

Works with /v1/completions and /v1/chat/completions of kvserve, vLLM and llama.cpp: the body
uses only OpenAI's fields plus vLLM's `ignore_eos` extension, and usage is asked for with
`stream_options.include_usage`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import aiohttp

_SSE_DATA = "data:"


@dataclass
class RequestSpec:
    """What to send.

    Args:
        url: the endpoint's full URL.
        chat: True for the chat endpoint (the prompt becomes one user message).
        model: the `model` field.
        prompt: the prompt text.
        prompt_len: its token count (reported back unchanged).
        max_tokens: tokens to generate at most.
        ignore_eos: send vLLM's `ignore_eos: true`, so exactly max_tokens come back.
        temperature: the sampling temperature.
        extra_body: more fields merged into the body.
        headers: this request's own headers (its latency targets), over the source's.
    """

    url: str
    chat: bool
    model: str
    prompt: str
    prompt_len: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    extra_body: dict = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> dict:
        body = {
            "model": self.model,
            "max_tokens": self.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": self.temperature,
        }
        if self.chat:
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        if self.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.extra_body)
        return body


@dataclass
class RequestRecord:
    """What came back, with times in seconds.

    Args:
        success: the stream ended with [DONE] after at least one token and no error.
        prompt_len: the spec's prompt_len.
        start_time: perf_counter() when the request was sent.
        ttft: time to the first chunk with text.
        itl: gaps between consecutive chunks with text.
        latency: time to the end of the stream.
        generated_text: the concatenated text.
        output_tokens: completion_tokens from the server's usage (None if it sent none).
        error: why it failed ("" on success).
    """

    success: bool = False
    prompt_len: int = 0
    start_time: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    generated_text: str = ""
    output_tokens: int | None = None
    error: str = ""


def _chunk_text(data: dict, chat: bool) -> str | None:
    """The text of a stream chunk's first choice; None for chunks without choices."""
    choices = data.get("choices")
    if not choices:
        return None
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def _events(response: aiohttp.ClientResponse):
    """The `data:` payloads of an SSE stream, one per event."""
    async for raw_line in response.content:
        line = raw_line.decode("utf-8").strip()
        if line.startswith(_SSE_DATA):
            yield line[len(_SSE_DATA) :].strip()


async def send_request(
    session: aiohttp.ClientSession, spec: RequestSpec, headers: dict[str, str]
) -> RequestRecord:
    """Send one streaming request and time its chunks; never raises for a failed request.

    Args:
        session: the benchmark's HTTP session.
        spec: what to send.
        headers: extra headers (Authorization).
    """
    record = RequestRecord(prompt_len=spec.prompt_len)
    record.start_time = start = last_time = time.perf_counter()
    texts: list[str] = []
    try:
        headers = headers | spec.headers if spec.headers else headers
        async with session.post(spec.url, json=spec.body(), headers=headers) as response:
            if response.status != 200:
                record.error = f"HTTP {response.status}: {(await response.text())[:500]}"
                return record
            done = False
            async for payload in _events(response):
                if payload == "[DONE]":
                    done = True
                    break
                data = json.loads(payload)
                if "error" in data:
                    record.error = f"stream error: {json.dumps(data['error'])[:500]}"
                    return record
                if data.get("usage"):
                    record.output_tokens = data["usage"].get("completion_tokens")
                text = _chunk_text(data, spec.chat)
                # Chunks without text (the chat role opener, a bare finish reason) carry no
                # token, so they are not timed.
                if text:
                    now = time.perf_counter()
                    if not texts:
                        record.ttft = now - start
                    else:
                        record.itl.append(now - last_time)
                    last_time = now
                    texts.append(text)
            record.latency = time.perf_counter() - start
            record.generated_text = "".join(texts)
            if not done:
                record.error = "the stream ended without [DONE]"
            elif not texts:
                record.error = "the stream carried no generated text"
            else:
                record.success = True
    # ValueError: bad JSON or UTF-8 in the stream, or an over-long line.
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    return record
