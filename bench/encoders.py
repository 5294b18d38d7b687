"""Encoder serving throughput: embedded tokens per second and rerank queries per second.

Two BERT-base-shaped folders with random weights (12 layers, hidden 768, 12 heads, FFN
3072, vocab 30,522, 512 positions; the WordPiece tokenizer of tests/support/encoders.py):
an embedding model in sentence-transformers layout (mean pooling, Normalize) and a
cross-encoder (BertForSequenceClassification, one label). Each is served by
`kvserve serve DIR --runner pooling` (or by whatever server --embed-url / --rerank-url name,
e.g. vLLM on the same folders), then:

- embeddings: the openai client at --concurrency (32) requests in flight, each one input of
  --input-tokens (256) token ids; embedded tokens per second over --requests requests;
- rerank: /v1/rerank of one query and --documents (100) documents, --rerank-concurrency in
  flight; queries (and documents) per second over --queries queries.

    .venv/bin/python bench/encoders.py --workdir /tmp/encoders-bench
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time

import httpx
import openai

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BERT_BASE = dict(
    vocab_size=30522,
    hidden_size=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    intermediate_size=3072,
    max_position_embeddings=512,
    type_vocab_size=2,
)


def build_folders(workdir: str) -> tuple[str, str]:
    """(embedding folder, cross-encoder folder), written once."""
    import json

    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    from tests.support.encoders import _save_tokenizer

    embed_dir, rerank_dir = os.path.join(workdir, "embed"), os.path.join(workdir, "rerank")
    torch.manual_seed(0)
    if not os.path.exists(os.path.join(embed_dir, "config.json")):
        BertModel(BertConfig(**BERT_BASE)).save_pretrained(embed_dir)
        _save_tokenizer(embed_dir)
        kinds = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
        modules = [
            {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{t}"}
            for i, (path, t) in enumerate(kinds)
        ]
        with open(os.path.join(embed_dir, "modules.json"), "w") as f:
            json.dump(modules, f)
        os.makedirs(os.path.join(embed_dir, "1_Pooling"), exist_ok=True)
        pooling = {"word_embedding_dimension": 768, "pooling_mode_mean_tokens": True}
        with open(os.path.join(embed_dir, "1_Pooling", "config.json"), "w") as f:
            json.dump(pooling, f)
    if not os.path.exists(os.path.join(rerank_dir, "config.json")):
        config = BertConfig(**BERT_BASE, num_labels=1)
        BertForSequenceClassification(config).save_pretrained(rerank_dir)
        _save_tokenizer(rerank_dir)
    return embed_dir, rerank_dir


def serve(
    model_dir: str, port: int, log_path: str, extra_args: list[str] | None = None
) -> subprocess.Popen:
    kvserve = os.path.join(os.path.dirname(sys.executable), "kvserve")
    args = [kvserve, "serve", model_dir, "--runner", "pooling", "--port", str(port)]
    args += ["--served-model-name", "bench", "--uvicorn-log-level", "warning"]
    args += extra_args or []
    with open(log_path, "w") as log:
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)


def wait_healthy(url: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} never became healthy")


async def bench_embeddings(url: str, args) -> None:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    rng = random.Random(0)
    inputs = [
        [rng.randrange(5, 80) for _ in range(args.input_tokens)] for _ in range(args.requests)
    ]
    # Warm-up: one round of the concurrency, not timed.
    await asyncio.gather(*(client.embeddings.create(model="bench", input=[x]) for x in inputs[:4]))
    queue: asyncio.Queue = asyncio.Queue()
    for item in inputs:
        queue.put_nowait(item)
    num_tokens = 0

    async def worker() -> None:
        nonlocal num_tokens
        while not queue.empty():
            item = queue.get_nowait()
            reply = await client.embeddings.create(model="bench", input=[item])
            num_tokens += reply.usage.prompt_tokens

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    elapsed = time.perf_counter() - start
    print(
        f"embeddings: {args.requests} requests x {args.input_tokens} tokens at concurrency "
        f"{args.concurrency}: {elapsed:.1f} s, {num_tokens / elapsed:.0f} embedded tokens/s, "
        f"{args.requests / elapsed:.1f} requests/s"
    )


def _text(rng: random.Random, num_words: int) -> str:
    words = ["".join(rng.choice("abcdefghij") for _ in range(4)) for _ in range(num_words)]
    return " ".join(words)


async def bench_rerank(url: str, args) -> None:
    rng = random.Random(1)
    queries = [
        (_text(rng, 8), [_text(rng, args.document_words) for _ in range(args.documents)])
        for _ in range(args.queries)
    ]
    async with httpx.AsyncClient(timeout=600) as client:

        async def rerank(query: str, documents: list[str]) -> None:
            body = {"model": "bench", "query": query, "documents": documents}
            response = await client.post(url + "/v1/rerank", json=body)
            response.raise_for_status()

        await rerank(*queries[0])  # warm-up
        queue: asyncio.Queue = asyncio.Queue()
        for item in queries:
            queue.put_nowait(item)

        async def worker() -> None:
            while not queue.empty():
                await rerank(*queue.get_nowait())

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.rerank_concurrency)))
        elapsed = time.perf_counter() - start
    print(
        f"rerank: {args.queries} queries x {args.documents} documents at concurrency "
        f"{args.rerank_concurrency}: {elapsed:.1f} s, {args.queries / elapsed:.2f} queries/s, "
        f"{args.queries * args.documents / elapsed:.0f} documents/s"
    )


def run_phase(
    url: str | None, model_dir: str, port: int, workdir: str, bench, extra_args: list[str]
) -> None:
    """Bench `url`, or a kvserve started on model_dir (with extra_args) for the phase."""
    process = None
    if url is None:
        url = f"http://127.0.0.1:{port}"
        log_path = os.path.join(workdir, f"serve-{port}.log")
        process = serve(model_dir, port, log_path, extra_args)
    try:
        wait_healthy(url)
        asyncio.run(bench(url))
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default="/tmp/kvserve-encoders-bench")
    parser.add_argument("--embed-url", help="bench this server instead of starting kvserve")
    parser.add_argument("--rerank-url", help="bench this server instead of starting kvserve")
    parser.add_argument("--port", type=int, default=18611)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--input-tokens", type=int, default=256)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--documents", type=int, default=100)
    parser.add_argument("--document-words", type=int, default=20)
    parser.add_argument("--queries", type=int, default=8)
    parser.add_argument("--rerank-concurrency", type=int, default=2)
    parser.add_argument("--skip", choices=["embed", "rerank"])
    parser.add_argument(
        "--serve-args", default="", help="more `kvserve serve` flags, e.g. '--cpu-gemm onednn'"
    )
    args = parser.parse_args()
    extra_args = args.serve_args.split()
    os.makedirs(args.workdir, exist_ok=True)
    embed_dir, rerank_dir = build_folders(args.workdir)
    if args.skip != "embed":
        run_phase(
            args.embed_url, embed_dir, args.port, args.workdir,
            lambda url: bench_embeddings(url, args), extra_args,
        )  # fmt: skip
    if args.skip != "rerank":
        run_phase(
            args.rerank_url, rerank_dir, args.port + 1, args.workdir,
            lambda url: bench_rerank(url, args), extra_args,
        )  # fmt: skip


if __name__ == "__main__":
    main()
