"""`kvserve bench serve --dataset-name agent`: agent conversations whose long tools + system
prefix is marked for caching, beside a churn of unique prompts that overflows the KV cache.

- `--agent-num-conversations` agents, each with its own `--agent-prefix-len`-token prefix
  (random text standing for its tools and system prompt), run `--agent-turns` turns with a
  think time drawn from `--agent-think-s MIN,MAX` between them; every turn sends the prefix,
  the conversation so far and a new short user message, streamed.
- `--agent-api messages`: POST /v1/messages with the prefix as a system block carrying
  `cache_control` {"type": "ephemeral", "ttl": --agent-ttl}; a turn's cacheable tokens are
  cache_read + cache_creation input tokens, its read tokens cache_read.
  `--agent-api chat`: POST /v1/chat/completions with the prefix as the system message,
  `prompt_cache_key` the conversation and `prompt_cache_retention` "24h"; cacheable: the
  prefix's tokens, read: cached_tokens up to that (the server must report cached_tokens:
  kvserve's --enable-prompt-tokens-details).
- The churn: unique `--random-input-len`-token prompts on /v1/completions at
  `--request-rate` per second (max_tokens --random-output-len), while the agents run.

Reported: the agent turns' prefix hit rate (read / cacheable tokens; over the turns after
each conversation's first, which alone can hit, and over all), their TTFT P50 / P90, and
the churn's requests and output tokens per second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp
import numpy as np

from kvserve.benchmarks import datasets


@dataclass
class AgentStats:
    """What the run measured."""

    ttfts: list[float] = field(default_factory=list)  # agent turns, seconds
    read: list[int] = field(default_factory=list)  # per turn after each conversation's first
    cacheable: list[int] = field(default_factory=list)
    first_read: list[int] = field(default_factory=list)  # each conversation's first turn
    first_cacheable: list[int] = field(default_factory=list)
    churn_done: int = 0
    churn_output_tokens: int = 0
    errors: list[str] = field(default_factory=list)


async def _sse(response: aiohttp.ClientResponse):
    """The JSON bodies of an SSE stream's data lines."""
    async for raw in response.content:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


class AgentRun:
    """One agent workload against `base_url` (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, base_url: str, model: str, tokenizer):
        self.args, self.base_url, self.model = args, base_url, model
        self.rng = np.random.default_rng(args.seed)
        self.tokenizer = tokenizer
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        low, _, high = args.agent_think_s.partition(",")
        self.think_s = (float(low), float(high or low))
        self.stats = AgentStats()
        self.agents_done = False

    def _text(self, num_tokens: int) -> str:
        return datasets.random_text(self.tokenizer, num_tokens, self.rng)

    async def run(self) -> AgentStats:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
            churn = asyncio.create_task(self._churn(session))
            await asyncio.gather(
                *(self._conversation(session, i) for i in range(self.args.agent_num_conversations))
            )
            self.agents_done = True
            await churn
        return self.stats

    async def _conversation(self, session: aiohttp.ClientSession, index: int) -> None:
        prefix = self._text(self.args.agent_prefix_len)
        num_prefix_tokens = len(self.tokenizer.encode(prefix, add_special_tokens=False))
        history: list[dict] = []
        for turn in range(self.args.agent_turns):
            if turn:
                await asyncio.sleep(float(self.rng.uniform(*self.think_s)))
            history.append({"role": "user", "content": self._text(self.args.agent_turn_len)})
            try:
                reply, read, cacheable = await self._turn(session, index, prefix, history)
            except (aiohttp.ClientError, ValueError, KeyError) as exc:
                self.stats.errors.append(f"agent {index} turn {turn}: {exc!r}")
                history.pop()
                continue
            if self.args.agent_api == "chat":
                read, cacheable = min(read, num_prefix_tokens), num_prefix_tokens
            reads = (
                (self.stats.read, self.stats.cacheable)
                if turn
                else (
                    self.stats.first_read,
                    self.stats.first_cacheable,
                )
            )
            reads[0].append(read)
            reads[1].append(cacheable)
            history.append({"role": "assistant", "content": reply or "ok"})

    async def _turn(self, session, index: int, prefix: str, history: list[dict]):
        """One streamed turn: (reply text, read tokens, cacheable tokens); records TTFT."""
        if self.args.agent_api == "messages":
            path = "/v1/messages"
            body: dict = {
                "system": [
                    {
                        "type": "text",
                        "text": prefix,
                        "cache_control": {"type": "ephemeral", "ttl": self.args.agent_ttl},
                    }
                ],
                "messages": history,
            }
        else:
            path = "/v1/chat/completions"
            body = {
                "messages": [{"role": "system", "content": prefix}, *history],
                "prompt_cache_key": f"agent-{index}",
                "prompt_cache_retention": "24h",
                "stream_options": {"include_usage": True},
            }
        body |= {"model": self.model, "max_tokens": self.args.agent_output_len, "stream": True}
        body["temperature"] = self.args.temperature
        start = time.perf_counter()
        ttft, text, read, cacheable = None, [], 0, 0
        async with session.post(self.base_url + path, json=body, headers=self.headers) as response:
            if response.status != 200:
                raise ValueError(f"HTTP {response.status}: {(await response.text())[:200]}")
            async for event in _sse(response):
                piece, usage = _piece_and_usage(event)
                if piece and ttft is None:
                    ttft = time.perf_counter() - start
                text.append(piece)
                if usage is not None:
                    read, cacheable = usage
        self.stats.ttfts.append(ttft if ttft is not None else time.perf_counter() - start)
        return "".join(text), read, cacheable

    async def _churn(self, session: aiohttp.ClientSession) -> None:
        """Unique prompts at --request-rate until the agents are done."""
        pending: set[asyncio.Task] = set()
        rate = self.args.request_rate
        while not self.agents_done:
            pending.add(asyncio.create_task(self._churn_request(session)))
            pending = {task for task in pending if not task.done()}
            await asyncio.sleep(1.0 / rate if rate != float("inf") and rate > 0 else 1.0)
        if pending:
            await asyncio.gather(*pending)

    async def _churn_request(self, session: aiohttp.ClientSession) -> None:
        body = {
            "model": self.model,
            "prompt": self._text(self.args.random_input_len),
            "max_tokens": self.args.random_output_len,
            "temperature": self.args.temperature,
            "ignore_eos": True,
        }
        try:
            url = self.base_url + "/v1/completions"
            async with session.post(url, json=body, headers=self.headers) as response:
                reply = await response.json()
            self.stats.churn_output_tokens += reply["usage"]["completion_tokens"]
            self.stats.churn_done += 1
        except (aiohttp.ClientError, ValueError, KeyError) as exc:
            self.stats.errors.append(f"churn: {exc!r}")


def _piece_and_usage(event: dict) -> tuple[str, tuple[int, int] | None]:
    """A stream event's text and, in its last event, (read, cacheable) prompt tokens."""
    kind = event.get("type")
    if kind == "content_block_delta":
        return event["delta"].get("text", ""), None
    if kind == "message_delta":
        usage = event["usage"]
        read = usage.get("cache_read_input_tokens", 0)
        return "", (read, read + usage.get("cache_creation_input_tokens", 0))
    if "choices" in event:  # a chat chunk
        choices = event["choices"]
        text = (choices[0]["delta"].get("content") or "") if choices else ""
        usage = event.get("usage")
        if usage:
            details = usage.get("prompt_tokens_details") or {}
            return text, (details.get("cached_tokens", 0), 0)
        return text, None
    return "", None


def report(stats: AgentStats, seconds: float) -> dict:
    """The run's figures (printed by run_agent_benchmark)."""

    def rate(read: list[int], cacheable: list[int]) -> float | None:
        return sum(read) / sum(cacheable) if sum(cacheable) else None

    ttfts = np.array(stats.ttfts) if stats.ttfts else np.array([np.nan])
    return {
        "agent_turns": len(stats.ttfts),
        "agent_prefix_hit_rate": rate(stats.read, stats.cacheable),
        "agent_prefix_hit_rate_all_turns": rate(
            stats.read + stats.first_read, stats.cacheable + stats.first_cacheable
        ),
        "agent_ttft_p50_ms": float(np.percentile(ttfts, 50) * 1000),
        "agent_ttft_p90_ms": float(np.percentile(ttfts, 90) * 1000),
        "churn_requests": stats.churn_done,
        "churn_output_tok_per_s": stats.churn_output_tokens / seconds if seconds else 0.0,
        "duration_s": seconds,
        "errors": stats.errors[:5],
        "num_errors": len(stats.errors),
    }


async def run_agent_benchmark(args: argparse.Namespace, base_url: str, tokenizer) -> dict:
    """Run the agent workload and print its figures; the result dict."""
    model = args.model
    if model is None:
        async with aiohttp.ClientSession() as session:
            async with session.get(base_url + "/v1/models") as response:
                model = (await response.json())["data"][0]["id"]
    start = time.perf_counter()
    stats = await AgentRun(args, base_url, model, tokenizer).run()
    result = report(stats, time.perf_counter() - start)
    print("=" * 20 + " Agent workload " + "=" * 20)
    for key, value in result.items():
        print(f"{key:<36} {value}")
    return result
