"""The soak's load: real `openai` clients sending a constant mix, and the greedy sample.

Each client thread sends one request after another (a short pause between) as one of two
tenants, picking a shape at random from its seeded generator: a short completion, a long
prompt streamed, a chat streamed, a chat with a tool it must call (tool_choice "required"),
a chat held to a JSON schema, or a stream the client cancels after a few chunks. A few other
clients read their streams slowly. Every request ends as an `Outcome`: completed,
cancelled (by the client, on purpose) or failed, with what the client saw. The SDK retries
nothing (max_retries=0): a failure the SDK would have hidden is still counted.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

import openai

from bench.soak_deploy import SERVED_MODEL, TENANT_KEYS

# Longer than any freeze (40 s) plus a restart: a request that waits this long is hung. On a
# starved machine (the default model under nice -n 10 beside two benchmark sittings, load
# average ~40) a 32-token greedy completion took over 240 s: --request-timeout-s raises it.
REQUEST_TIMEOUT_S = 240.0
SHAPES = ("short", "long_stream", "chat_stream", "tools", "json_schema", "cancel")
WORDS = (
    "sea wind boat harbour light stone river north cloud bread market lantern road "
    "winter copper garden silver field bridge forest candle mountain island letter"
).split()
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
    "required": ["name", "count"],
}


@dataclass
class Outcome:
    """One request as its client saw it.

    Args:
        shape: which of SHAPES (or "slow", "greedy").
        start, end: time.monotonic() at send and at the end.
        status: completed | cancelled | failed.
        error: what the client got, for a failure: the HTTP status and error body, or the
            exception (a broken connection, a timeout).
        error_type: the exception's class name.
    """

    shape: str
    tenant: str
    start: float
    end: float = 0.0
    status: str = "completed"
    error: str = ""
    error_type: str = ""


@dataclass
class LoadConfig:
    """Args: num_clients: mixed clients; num_slow: slow readers; max_tokens: per request
    (long streams twice that); long_words: words in a long prompt; seed: the mix's;
    timeout_s: how long a client waits for an answer (longer: the request hung)."""

    num_clients: int = 4
    num_slow: int = 1
    max_tokens: int = 32
    long_words: int = 60
    pause_s: float = 0.3
    seed: int = 0
    timeout_s: float = REQUEST_TIMEOUT_S


def client_for(url: str, tenant: str, timeout_s: float = REQUEST_TIMEOUT_S) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=url + "/v1",
        api_key=TENANT_KEYS[tenant],
        max_retries=0,
        timeout=timeout_s,
    )


def prompt_of(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def describe_error(exc: Exception) -> str:
    """The status and body the client got, else the exception itself."""
    if isinstance(exc, openai.APIStatusError):
        return f"{exc.status_code} {exc.response.text[:400]}"
    if isinstance(exc, openai.APIError) and exc.body is not None:
        return f"error event {str(exc.body)[:400]}"
    return f"{type(exc).__name__}: {str(exc)[:400]}"


@dataclass
class Load:
    """The client threads. Args: url: the api's base URL; config: the mix."""

    url: str
    config: LoadConfig
    outcomes: list[Outcome] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for index in range(self.config.num_clients + self.config.num_slow):
            slow = index >= self.config.num_clients
            thread = threading.Thread(target=self._client, args=(index, slow), daemon=True)
            thread.start()
            self.threads.append(thread)

    def prime(self, copies: int = 4) -> None:
        """Each shape that loads something once per process (a grammar library, a tool
        parser), `copies` at once so every engine of a DP=2 deployment gets one, before
        the warm-up's memory samples: a first JSON-schema request late in a loaded run
        would count its library's load as growth. Their outcomes count like any other."""
        client = client_for(self.url, "alice", self.config.timeout_s)
        rng = random.Random(self.config.seed)
        threads = []
        for shape in ("short", "chat_stream", "tools", "json_schema"):
            for _ in range(copies):
                seed = rng.randrange(1 << 30)
                thread = threading.Thread(target=self._once, args=(client, shape, seed))
                thread.start()
                threads.append(thread)
        for thread in threads:
            thread.join(self.config.timeout_s + 10)

    def _once(self, client: openai.OpenAI, shape: str, seed: int) -> None:
        self._request(client, shape, "alice", random.Random(seed))

    def _request(
        self, client: openai.OpenAI, shape: str, tenant: str, rng: random.Random
    ) -> Outcome:
        """One request of `shape`, its outcome recorded."""
        outcome = Outcome(shape, tenant, time.monotonic())
        try:
            outcome.status = getattr(self, f"_{shape}")(client, rng)
        except Exception as exc:  # noqa: BLE001 - every failure is an outcome
            outcome.status, outcome.error = "failed", describe_error(exc)
            outcome.error_type = type(exc).__name__
        outcome.end = time.monotonic()
        self.outcomes.append(outcome)
        return outcome

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(self.config.timeout_s + 10)

    def _client(self, index: int, slow: bool) -> None:
        rng = random.Random(self.config.seed * 1000 + index)
        tenant = ("alice", "bob")[index % 2]
        client = client_for(self.url, tenant, self.config.timeout_s)
        while not self.stop.is_set():
            shape = "slow" if slow else rng.choice(SHAPES)
            outcome = self._request(client, shape, tenant, rng)
            # A refused client waits longer, as a real one would before trying again.
            pause = 2 * self.config.pause_s if outcome.status != "failed" else 2.0
            self.stop.wait(rng.uniform(0, pause))

    # ------------------------------------------------------------------ request shapes

    def _short(self, client: openai.OpenAI, rng: random.Random) -> str:
        response = client.completions.create(
            model=SERVED_MODEL,
            prompt=prompt_of(rng, 8),
            max_tokens=self.config.max_tokens,
            temperature=0.8,
            seed=rng.randrange(1 << 30),
        )
        return _finished(response.choices[0].finish_reason)

    def _long_stream(self, client: openai.OpenAI, rng: random.Random) -> str:
        stream = client.completions.create(
            model=SERVED_MODEL,
            prompt=prompt_of(rng, self.config.long_words),
            max_tokens=2 * self.config.max_tokens,
            stream=True,
        )
        return _finished([c.choices[0].finish_reason for c in stream if c.choices][-1])

    def _chat_stream(self, client: openai.OpenAI, rng: random.Random) -> str:
        stream = client.chat.completions.create(
            model=SERVED_MODEL,
            messages=[{"role": "user", "content": prompt_of(rng, 12)}],
            max_tokens=self.config.max_tokens,
            stream=True,
        )
        return _finished([c.choices[0].finish_reason for c in stream if c.choices][-1])

    def _tools(self, client: openai.OpenAI, rng: random.Random) -> str:
        response = client.chat.completions.create(
            model=SERVED_MODEL,
            messages=[{"role": "user", "content": f"The weather in {rng.choice(WORDS)}?"}],
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice="required",
            max_tokens=self.config.max_tokens,
        )
        return _finished(response.choices[0].finish_reason)

    def _json_schema(self, client: openai.OpenAI, rng: random.Random) -> str:
        response = client.chat.completions.create(
            model=SERVED_MODEL,
            messages=[{"role": "user", "content": f"Describe a {rng.choice(WORDS)} as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}},
            max_tokens=self.config.max_tokens,
        )
        return _finished(response.choices[0].finish_reason)

    def _cancel(self, client: openai.OpenAI, rng: random.Random) -> str:
        stream = client.completions.create(
            model=SERVED_MODEL,
            prompt=prompt_of(rng, 10),
            max_tokens=4 * self.config.max_tokens,
            extra_body={"ignore_eos": True},
            stream=True,
        )
        cut_after = rng.randint(1, 4)
        for num_chunks, _ in enumerate(stream, start=1):
            if num_chunks >= cut_after:
                break
        stream.close()  # the connection closes: the api aborts the request in the core
        return "cancelled"

    def _slow(self, client: openai.OpenAI, rng: random.Random) -> str:
        stream = client.completions.create(
            model=SERVED_MODEL,
            prompt=prompt_of(rng, 10),
            max_tokens=self.config.max_tokens,
            extra_body={"ignore_eos": True},
            stream=True,
        )
        reasons = []
        for chunk in stream:
            reasons += [c.finish_reason for c in chunk.choices]
            # A reader slower than the engine writes, until the load stops: then it reads the
            # rest at once, since the soak's end waits for every stream to finish.
            self.stop.wait(rng.uniform(0.2, 0.8))
        return _finished(reasons[-1])


def _finished(finish_reason: str | None) -> str:
    if finish_reason not in ("stop", "length", "tool_calls"):
        raise RuntimeError(f"the response ended without a finish reason ({finish_reason!r})")
    return "completed"


# ---------------------------------------------------------------------- the greedy sample


@dataclass
class GreedySample:
    """Fixed greedy completions, answered once undisturbed (`reference`), then again and
    again under chaos (`run_under_chaos`), each compared token for token.

    Args:
        url: the api's base URL.
        num_prompts: the sample's size.
        max_tokens: tokens per completion (EOS ignored, so each runs its full length).
        timeout_s: how long each may take.
    """

    url: str
    num_prompts: int
    max_tokens: int
    timeout_s: float = REQUEST_TIMEOUT_S
    reference: list[list[str]] = field(default_factory=list)
    compared: list[dict] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)

    def prompts(self) -> list[str]:
        rng = random.Random(1234)
        return [prompt_of(rng, 6 + 5 * i) for i in range(self.num_prompts)]

    def tokens(self, client: openai.OpenAI, prompt: str) -> list[str]:
        response = client.completions.create(
            model=SERVED_MODEL,
            prompt=prompt,
            max_tokens=self.max_tokens,
            temperature=0,
            logprobs=1,
            extra_body={"ignore_eos": True},
        )
        logprobs = response.choices[0].logprobs
        assert logprobs is not None and logprobs.tokens is not None
        return list(logprobs.tokens)

    def run_reference(self) -> None:
        client = client_for(self.url, "alice", self.timeout_s)
        self.reference = [self.tokens(client, prompt) for prompt in self.prompts()]

    def run_under_chaos(self, stop: threading.Event) -> None:
        """Cycle through the sample until `stop`, recording each comparison."""
        client = client_for(self.url, "bob", self.timeout_s)
        prompts = self.prompts()
        index = 0
        while not stop.is_set():
            i = index % len(prompts)
            outcome = Outcome("greedy", "bob", time.monotonic())
            try:
                tokens = self.tokens(client, prompts[i])
                equal = tokens == self.reference[i]
                self.compared.append({"prompt": i, "equal": equal, "at": outcome.start})
                if not equal:
                    self.compared[-1].update(expected=self.reference[i], got=tokens)
            except Exception as exc:  # noqa: BLE001 - a failure is an outcome
                outcome.status, outcome.error = "failed", describe_error(exc)
                outcome.error_type = type(exc).__name__
            outcome.end = time.monotonic()
            self.outcomes.append(outcome)
            index += 1
            stop.wait(0.5)
