"""Benchmark workloads for `kvserve bench serve`: random, shared-prefix and ShareGPT prompts.

Prompts are text, so that any OpenAI-compatible server (kvserve, vLLM, llama.cpp) and both
endpoints (/v1/completions, /v1/chat/completions) accept them. Random prompts are built from
random token ids and re-tokenized until the text tokenizes to the asked length.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvserve.shared.logging import init_logger

logger = init_logger("kvserve.benchmarks")

# Decode -> encode round trips before giving up on an exact prompt length.
_MAX_LENGTH_FIXES = 10
# ShareGPT turns shorter than this many tokens say nothing about a server (vLLM's filter).
_MIN_SHAREGPT_TOKENS = 4

# Short chat questions for the accuracy comparisons against float32 (bench/bf16_accuracy.py
# asks all of them; bench/quantized.py and the e2e tests against HF transformers and the
# float32 expansion, tests/support/prompts.py, ask the first 16).
CHAT_QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "What is 12 times 7?",
    "Who wrote Romeo and Juliet?",
    "Give me a tip for learning Python.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Name a famous painting by Van Gogh.",
    "What does a CPU do?",
    "Describe a cat in five words.",
    "How many legs does a spider have?",
    "What is the boiling point of water in Celsius?",
    "Suggest a name for a pet goldfish.",
    "What is the largest planet in our solar system?",
    "Summarize the plot of Cinderella.",
    "What is a black hole?",
    "Give two synonyms for happy.",
    "How do vaccines work?",
    "Write a limerick about a programmer.",
    "What causes rain?",
    "Explain recursion to a child.",
    "What is the square root of 144?",
)


@dataclass
class SampleRequest:
    """One benchmark request before it is sent.

    Args:
        prompt: the prompt text (the user message on the chat endpoint).
        prompt_len: its number of tokens under the benchmark's tokenizer.
        expected_output_len: max_tokens of the request.
    """

    prompt: str
    prompt_len: int
    expected_output_len: int


def load_tokenizer(name_or_path: str | None):
    """A HF tokenizer from a local folder; None means kvserve's default model."""
    if name_or_path is None:
        from kvserve.services.worker.model_loader import resolve_model

        name_or_path = resolve_model(None)
    # The fast class reads tokenizer.json without importing torch (AutoTokenizer imports it).
    tokenizer_cls: Any  # either class; both load with from_pretrained
    if os.path.exists(os.path.join(name_or_path, "tokenizer.json")):
        from transformers import PreTrainedTokenizerFast as tokenizer_cls
    else:
        from transformers import AutoTokenizer as tokenizer_cls
    return tokenizer_cls.from_pretrained(name_or_path)


def _allowed_token_ids(tokenizer) -> np.ndarray:
    special_ids = set(tokenizer.all_special_ids)
    return np.array([i for i in range(len(tokenizer)) if i not in special_ids])


def _text_of_len(
    tokenizer,
    token_ids: list[int],
    target_len: int,
    allowed_ids: np.ndarray,
    rng: np.random.Generator,
) -> tuple[str, int]:
    """Text that tokenizes to target_len tokens (or close), starting from token_ids.

    Decoding random ids and encoding the text again can merge or split tokens, so the ids
    are trimmed or topped up and the round trip repeated.
    """
    text, num_tokens = "", 0
    for _ in range(_MAX_LENGTH_FIXES):
        text = tokenizer.decode(token_ids)
        encoded = tokenizer.encode(text, add_special_tokens=False)
        num_tokens = len(encoded)
        if num_tokens == target_len:
            break
        if num_tokens > target_len:
            token_ids = encoded[:target_len]
        else:
            token_ids = encoded + rng.choice(allowed_ids, target_len - num_tokens).tolist()
    return text, num_tokens


def random_text(tokenizer, num_tokens: int, rng: np.random.Generator) -> str:
    """Random text of about `num_tokens` tokens (the agent workload's prefixes and turns)."""
    allowed_ids = _allowed_token_ids(tokenizer)
    token_ids = rng.choice(allowed_ids, num_tokens).tolist()
    return _text_of_len(tokenizer, token_ids, num_tokens, allowed_ids, rng)[0]


def _random_lens(
    rng: np.random.Generator, num: int, mean_len: int, range_ratio: float, minimum: int
) -> np.ndarray:
    low = max(minimum, math.floor(mean_len * (1 - range_ratio)))
    high = max(low, math.ceil(mean_len * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=num)


def random_requests(
    tokenizer,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[SampleRequest]:
    """Prompts of random tokens (vLLM's `random` dataset).

    Args:
        tokenizer: the benchmark's tokenizer.
        num_prompts: number of requests.
        input_len: prompt tokens (the mean when range_ratio > 0).
        output_len: max_tokens (the mean when range_ratio > 0).
        range_ratio: lengths are drawn uniformly from [len * (1 - r), len * (1 + r)].
        seed: seed of the token ids and lengths.
    """
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise ValueError(
            f"--random-input-len and --random-output-len must be >= 1, "
            f"got {input_len} and {output_len}"
        )
    rng = np.random.default_rng(seed)
    allowed_ids = _allowed_token_ids(tokenizer)
    input_lens = _random_lens(rng, num_prompts, input_len, range_ratio, minimum=1)
    output_lens = _random_lens(rng, num_prompts, output_len, range_ratio, minimum=1)
    requests = []
    for prompt_len, max_tokens in zip(input_lens.tolist(), output_lens.tolist()):
        token_ids = rng.choice(allowed_ids, prompt_len).tolist()
        text, num_tokens = _text_of_len(tokenizer, token_ids, prompt_len, allowed_ids, rng)
        requests.append(SampleRequest(text, num_tokens, max_tokens))
    return requests


def prefix_requests(
    tokenizer,
    num_prompts: int,
    num_groups: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    seed: int = 0,
) -> list[SampleRequest]:
    """Prompts that share one of num_groups long prefixes (the RAG case).

    Request i belongs to group i % num_groups; the order is then shuffled, so a group's
    later requests can hit the prefix cache that its first one filled.

    Args:
        tokenizer: the benchmark's tokenizer.
        num_prompts: number of requests.
        num_groups: number of distinct shared prefixes.
        prefix_len: tokens of each shared prefix.
        suffix_len: tokens of each request's own suffix.
        output_len: max_tokens of every request.
        seed: seed of the token ids and the order.
    """
    if num_groups < 1 or prefix_len < 1 or suffix_len < 1 or output_len < 1:
        raise ValueError(
            "--prefix-num-groups, --prefix-len, --prefix-suffix-len and "
            "--prefix-output-len must all be >= 1"
        )
    rng = np.random.default_rng(seed)
    allowed_ids = _allowed_token_ids(tokenizer)
    prefixes = [
        _text_of_len(
            tokenizer, rng.choice(allowed_ids, prefix_len).tolist(), prefix_len, allowed_ids, rng
        )[0]
        for _ in range(num_groups)
    ]
    requests = []
    for i in range(num_prompts):
        # A newline between prefix and suffix keeps the tokenizer from merging across them,
        # so every request of a group starts with the same prefix tokens.
        suffix, _ = _text_of_len(
            tokenizer, rng.choice(allowed_ids, suffix_len).tolist(), suffix_len, allowed_ids, rng
        )
        prompt = prefixes[i % num_groups] + "\n" + suffix
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        requests.append(SampleRequest(prompt, prompt_len, output_len))
    order = rng.permutation(num_prompts)
    return [requests[i] for i in order]


def _load_conversations(path: str) -> list[list[dict]]:
    """The `conversations` lists of a ShareGPT file, JSON (a list) or JSONL (one per line)."""
    with open(path) as f:
        text = f.read()
    try:
        entries = json.loads(text)
    except json.JSONDecodeError:
        entries = [json.loads(line) for line in text.splitlines() if line.strip()]
    if isinstance(entries, dict):
        entries = [entries]
    return [
        entry["conversations"]
        for entry in entries
        if isinstance(entry, dict) and isinstance(entry.get("conversations"), list)
    ]


def _first_exchange(turns: list[dict]) -> tuple[str, str] | None:
    """(first human turn, the gpt answer after it), or None if the layout differs."""

    def speaker(turn: dict) -> str:
        return turn.get("from", turn.get("role", ""))

    def value(turn: dict) -> str:
        return turn.get("value", turn.get("content", "")) or ""

    if len(turns) < 2 or speaker(turns[0]) not in ("human", "user"):
        return None
    if speaker(turns[1]) not in ("gpt", "assistant"):
        return None
    return value(turns[0]), value(turns[1])


def sharegpt_requests(
    tokenizer, path: str, num_prompts: int, output_len: int | None = None, seed: int = 0
) -> list[SampleRequest]:
    """Prompts from a ShareGPT file: the first human turn of each conversation.

    Args:
        tokenizer: the benchmark's tokenizer.
        path: a JSON or JSONL file of {"conversations": [{"from", "value"}, ...]} entries.
        num_prompts: number of requests (conversations are reused when there are fewer).
        output_len: max_tokens of every request; None: the token count of the gpt answer.
        seed: seed of the sampling order.
    """
    if not path or not os.path.exists(path):
        raise ValueError(
            f"--dataset-path {path!r} does not exist: the sharegpt dataset needs "
            "a JSON or JSONL file of ShareGPT conversations"
        )
    samples = []
    for turns in _load_conversations(path):
        exchange = _first_exchange(turns)
        if exchange is None:
            continue
        prompt, answer = exchange
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        answer_len = output_len or len(tokenizer.encode(answer, add_special_tokens=False))
        if prompt_len < _MIN_SHAREGPT_TOKENS or answer_len < _MIN_SHAREGPT_TOKENS:
            continue
        samples.append(SampleRequest(prompt, prompt_len, answer_len))
    if not samples:
        raise ValueError(
            f"{path} holds no usable conversation (a human turn followed by a "
            f"gpt turn, each of at least {_MIN_SHAREGPT_TOKENS} tokens)"
        )
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(samples)).tolist()
    if len(samples) < num_prompts:
        logger.warning(
            "%s has %d usable conversations: reusing them for %d prompts",
            path,
            len(samples),
            num_prompts,
        )
    return [samples[order[i % len(samples)]] for i in range(num_prompts)]
