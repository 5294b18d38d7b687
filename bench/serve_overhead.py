"""What the process split costs: the same requests offline (`LLM`), and through
`kvserve serve` with the worker in the engine process (`--executor uni`) or in its own
process (`--executor mp`).

    .venv/bin/python bench/serve_overhead.py [--runs 5] [--concurrency 32]

Prints, per setup, the mean latency of one request alone (128 prompt + 128 output tokens,
greedy, ignore_eos) and the output tokens/s of `concurrency` such requests at once.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time

import httpx

PROMPT_LEN, OUTPUT_LEN = 128, 128


def _prompt(i: int) -> list[int]:
    # Distinct token ids per request, so the prefix cache does not help one over another.
    return [1000 + (i * 7 + j) % 30000 for j in range(PROMPT_LEN)]


def bench_offline(runs: int, concurrency: int) -> tuple[float, float]:
    from kvserve import LLM, SamplingParams

    llm = LLM()
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    llm.generate({"prompt_token_ids": _prompt(10_000)}, params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    for i in range(runs):
        llm.generate({"prompt_token_ids": _prompt(i)}, params, use_tqdm=False)
    latency = (time.perf_counter() - start) / runs
    start = time.perf_counter()
    llm.generate(
        [{"prompt_token_ids": _prompt(100 + i)} for i in range(concurrency)], params, use_tqdm=False
    )
    return latency, concurrency * OUTPUT_LEN / (time.perf_counter() - start)


async def _complete(client: httpx.AsyncClient, i: int) -> None:
    body = {
        "model": "SmolLM2-135M-Instruct",
        "prompt": _prompt(i),
        "max_tokens": OUTPUT_LEN,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    response = await client.post("/v1/completions", json=body)
    response.raise_for_status()
    assert response.json()["usage"]["completion_tokens"] == OUTPUT_LEN


async def _bench_http(port: int, runs: int, concurrency: int) -> tuple[float, float]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
        await _complete(client, 10_000)
        start = time.perf_counter()
        for i in range(runs):
            await _complete(client, i)
        latency = (time.perf_counter() - start) / runs
        start = time.perf_counter()
        await asyncio.gather(*(_complete(client, 100 + i) for i in range(concurrency)))
        return latency, concurrency * OUTPUT_LEN / (time.perf_counter() - start)


def bench_serve(executor: str, runs: int, concurrency: int) -> tuple[float, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvserve.cli",
            "serve",
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--executor",
            executor,
            "--uvicorn-log-level",
            "warning",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise RuntimeError(f"kvserve serve --executor {executor} did not become healthy")
        return asyncio.run(_bench_http(port, runs, concurrency))
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    os.environ.setdefault("KVSERVE_LOG_LEVEL", "WARNING")
    results = {"offline LLM": bench_offline(args.runs, args.concurrency)}
    for executor in ("uni", "mp"):
        results[f"serve --executor {executor}"] = bench_serve(executor, args.runs, args.concurrency)
    base_latency, base_tps = results["offline LLM"]
    print(
        f"{'setup':<24} {'1 request (s)':>14} {'vs offline':>10} "
        f"{f'{args.concurrency} at once (tok/s)':>22} {'vs offline':>10}"
    )
    for name, (latency, tps) in results.items():
        print(
            f"{name:<24} {latency:>14.3f} {latency / base_latency - 1:>+10.1%} "
            f"{tps:>22.1f} {tps / base_tps - 1:>+10.1%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
