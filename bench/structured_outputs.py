"""What structured outputs cost and what they buy, against a real `kvserve serve`.

    .venv/bin/python bench/structured_outputs.py [--url http://127.0.0.1:8000]
        [--concurrency 32] [--num-requests 64] [--output-len 128] [--num-valid 100]

Without --url it starts `kvserve serve` (the default model) on a free port and stops it after.
Three measurements:

1. Throughput: --num-requests chat requests, --concurrency at a time, each generating exactly
   --output-len tokens, once with a JSON schema on every request and once without. The schema
   asks for a long list, so constrained outputs also run to the length cap: both runs decode
   the same number of tokens in the same batches, and the difference is the grammar's cost
   (bitmask fill, bitmask on the logits, matcher advance). Output tok/s and mean TPOT, the
   median of --rounds runs of each kind, taken in alternating order.
2. First-request latency of a schema never seen (its compile included) and of the same schema
   again (cached), one request at a time, one output token; plus the server's first
   structured request (which also builds xgrammar's tokenizer info) and its compile-time
   histogram.
3. Valid JSON: --num-valid requests that ask for JSON matching a schema (the prompt shows
   it), with the schema as a constraint and without; the share whose output parses and
   validates. Unconstrained outputs are also tried leniently (the first {...} in the text).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import httpx
import jsonschema

SUBJECTS = [
    "Paris", "Tokyo", "Lagos", "Lima", "Oslo", "Cairo", "Delhi", "Quito", "Perth", "Seoul",
    "Milan", "Dakar", "Hanoi", "Dublin", "Havana", "Nairobi", "Kyiv", "Lisbon", "Manila",
    "Santiago",
]  # fmt: skip
LIST_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "facts": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"topic": {"type": "string"}, "detail": {"type": "string"}},
                "required": ["topic", "detail"],
            },
            "minItems": 40,
        },
    },
    "required": ["city", "facts"],
}
# Strings are bounded: under greedy decoding the 135M model can repeat a word inside a free
# string until max_tokens ("Tokyo-Tokyo-..."), which no grammar can end for it.
CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
        "population": {"type": "integer", "minimum": 0},
        "landmarks": {
            "type": "array",
            "items": {"type": "string", "maxLength": 60},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "country", "population", "landmarks"],
    "additionalProperties": False,
}


def json_schema_format(schema: dict, name: str = "answer") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


# --------------------------------------------------------------------------- requests


async def stream_chat(client: httpx.AsyncClient, body: dict) -> dict:
    """One streamed chat request: its text, token count, TTFT, TPOT and latency (seconds)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = None
    text, num_tokens = "", 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                piece = choice["delta"].get("content")
                if piece:
                    first = first or time.perf_counter()
                    text += piece
    end = time.perf_counter()
    first = first or end
    tpot = (end - first) / (num_tokens - 1) if num_tokens > 1 else None
    return {"text": text, "tokens": num_tokens, "ttft": first - start, "tpot": tpot,
            "latency": end - start}  # fmt: skip


async def run_concurrently(client, bodies: list[dict], concurrency: int) -> tuple[list, float]:
    semaphore = asyncio.Semaphore(concurrency)

    async def one(body):
        async with semaphore:
            return await stream_chat(client, body)

    start = time.perf_counter()
    results = await asyncio.gather(*(one(b) for b in bodies))
    return results, time.perf_counter() - start


# --------------------------------------------------------------------------- measurements


async def bench_throughput(client, args) -> dict:
    def body(i: int, constrained: bool) -> dict:
        subject = SUBJECTS[i % len(SUBJECTS)]
        body = {
            "messages": [{"role": "user", "content": f"List many facts about {subject} ({i})."}],
            "max_tokens": args.output_len,
            "min_tokens": args.output_len,  # the unconstrained run may not stop early either
            "temperature": 0.0,
        }
        if constrained:
            body["response_format"] = json_schema_format(LIST_SCHEMA)
        return body

    # Warm-up: the grammar compiled and the engine's first steps done before timing.
    await run_concurrently(client, [body(10_000, True), body(10_001, False)], 2)
    rounds: dict[str, list[dict]] = {"unconstrained": [], "json_schema": []}
    for round_index in range(args.rounds):
        # Alternating order: a load change on the shared machine hits both alike.
        order = (False, True) if round_index % 2 == 0 else (True, False)
        for constrained in order:
            first = 1000 * round_index  # new prompts each round: no prefix-cache help
            bodies = [body(first + i, constrained) for i in range(args.num_requests)]
            results, seconds = await run_concurrently(client, bodies, args.concurrency)
            tokens = sum(r["tokens"] for r in results)
            assert tokens == args.num_requests * args.output_len, "a request ended early"
            rounds["json_schema" if constrained else "unconstrained"].append(
                {
                    "output_tok_s": tokens / seconds,
                    "mean_tpot_ms": 1000 * statistics.mean(r["tpot"] for r in results),
                }
            )
    return {
        kind: {
            "output_tok_s": statistics.median(r["output_tok_s"] for r in runs),
            "mean_tpot_ms": statistics.median(r["mean_tpot_ms"] for r in runs),
            "rounds": runs,
        }
        for kind, runs in rounds.items()
    }


async def bench_first_request(client, num_schemas: int = 5) -> dict:
    def unseen_schema_body() -> dict:
        schema = json.loads(json.dumps(CITY_SCHEMA))
        schema["properties"][f"field_{uuid.uuid4().hex[:8]}"] = {"type": "string"}
        # The same prompt each time: its prefix is cached, so the compile stands out.
        return {
            "messages": [{"role": "user", "content": "Describe a city as JSON."}],
            "max_tokens": 1,
            "response_format": json_schema_format(schema),
        }

    # The server's first structured request also builds the backend (tokenizer info).
    first_ever = (await stream_chat(client, unseen_schema_body()))["latency"]
    new, cached = [], []
    for _ in range(num_schemas):
        body = unseen_schema_body()
        new.append((await stream_chat(client, body))["latency"])
        cached.append((await stream_chat(client, body))["latency"])
    plain = {"messages": [{"role": "user", "content": "Describe a city as JSON."}], "max_tokens": 1}
    unconstrained = [(await stream_chat(client, plain))["latency"] for _ in range(num_schemas)]
    return {
        "first_structured_request_ms": 1000 * first_ever,
        "new_schema_ms": 1000 * statistics.mean(new),
        "cached_schema_ms": 1000 * statistics.mean(cached),
        "unconstrained_ms": 1000 * statistics.mean(unconstrained),
    }


def parses_and_validates(text: str, schema: dict, lenient: bool = False) -> bool:
    if lenient and "{" in text:
        text = text[text.index("{") : text.rindex("}") + 1] if "}" in text else text
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


async def bench_valid_json(client, args) -> dict:
    prompt = (
        "Reply with only a JSON object that matches this JSON schema, nothing else.\n"
        f"Schema: {json.dumps(CITY_SCHEMA)}\nThe city: CITY"
    )

    def body(i: int, constrained: bool) -> dict:
        subject = f"{SUBJECTS[i % len(SUBJECTS)]} (variant {i // len(SUBJECTS)})"
        body = {
            "messages": [{"role": "user", "content": prompt.replace("CITY", subject)}],
            "max_tokens": 256,
            "temperature": 0.0,
        }
        if constrained:
            body["response_format"] = json_schema_format(CITY_SCHEMA)
        return body

    out = {}
    for constrained in (False, True):
        bodies = [body(i, constrained) for i in range(args.num_valid)]
        results, _ = await run_concurrently(client, bodies, args.concurrency)
        texts = [r["text"] for r in results]
        key = "json_schema" if constrained else "unconstrained"
        out[key] = {
            "valid_pct": 100
            * sum(parses_and_validates(t, CITY_SCHEMA) for t in texts)
            / len(texts),
            "valid_lenient_pct": 100
            * sum(parses_and_validates(t, CITY_SCHEMA, lenient=True) for t in texts)
            / len(texts),
            "example": texts[0][:200],
        }
    return out


async def compile_metrics(client) -> dict:
    text = (await client.get("/metrics")).text
    values = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name.startswith("kvserve:structured_output") and not line.startswith("#"):
            key = name.removeprefix("kvserve:")
            values[key] = values.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    count = values.get("structured_output_compile_time_seconds_count", 0)
    total = values.get("structured_output_compile_time_seconds_sum", 0.0)
    return {
        "compiles": count,
        "mean_compile_ms": 1000 * total / count if count else None,
        "cache_queries": values.get("structured_output_cache_queries_total"),
        "cache_hits": values.get("structured_output_cache_hits_total"),
    }


# --------------------------------------------------------------------------- server


def start_server(args) -> tuple[subprocess.Popen, str, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = os.path.join(tempfile.mkdtemp(prefix="kvserve-bench-"), "serve.log")
    command = [sys.executable, "-m", "kvserve.cli", "serve", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--max-model-len", "2048", "--kv-cache-memory", "2G"]
    command += ["--max-num-seqs", str(max(args.concurrency, 32)), "--uvicorn-log-level", "warning"]
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"kvserve serve exited; see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return server, url, log_path
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise RuntimeError(f"kvserve serve not healthy in 600 s; see {log_path}")


async def main_async(url: str, args) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=1800) as client:
        results = {"first_request": await bench_first_request(client)}
        results["throughput"] = await bench_throughput(client, args)
        results["valid_json"] = await bench_valid_json(client, args)
        results["server_compiles"] = await compile_metrics(client)
        return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running kvserve (default: start one)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-valid", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3, help="throughput runs of each kind")
    parser.add_argument("--save-result", help="write the figures to this JSON file")
    args = parser.parse_args()
    server = None
    url = args.url
    if url is None:
        server, url, log_path = start_server(args)
        print(f"kvserve serve on {url} (log: {log_path})", file=sys.stderr)
    try:
        results = asyncio.run(main_async(url, args))
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=120)
    print(json.dumps(results, indent=2))
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(results, f, indent=2)
    tput = results["throughput"]
    change = tput["json_schema"]["output_tok_s"] / tput["unconstrained"]["output_tok_s"] - 1
    print(f"output tok/s with a JSON schema: {100 * change:+.1f} % (median)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
