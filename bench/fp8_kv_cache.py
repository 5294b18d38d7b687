"""`--kv-cache-dtype fp8`: KV capacity, quality and serving throughput against the float KV.

Three measurements of the shipped code on the default model (SmolLM2-135M):
- capacity: the offline LLM started with each (model dtype, KV dtype) under one KV budget
  (--kv-cache-memory): the blocks and tokens its start-up sizing found
  (Worker.determine_num_blocks: the budget over ModelRunner.kv_cache_bytes_per_block).
- quality: teacher-forced next-token choices over a fixed English text (prefill chunks of 64,
  the rest one token a step, so each step reads K/V that earlier steps wrote), fp8_e4m3 and
  fp8_e5m2 K/V against the same model's float K/V, for float32 and bfloat16 models: top-1
  agreement and the mean |delta| of the true next token's logprob.
- serve: two `kvserve serve` of the default model (bfloat16) at once, float KV and fp8 KV
  (the same --kv-cache-memory), asked in turn A B A B ... by `kvserve bench serve` (random
  prompts, --input-len / --output-len, ignore_eos, --concurrency at once): output tokens/s of
  each round, the median fp8 / float ratio of the rounds and its range.

    .venv/bin/python bench/fp8_kv_cache.py capacity [--kv-cache-memory 1G]
    .venv/bin/python bench/fp8_kv_cache.py quality
    .venv/bin/python bench/fp8_kv_cache.py serve [--rounds 3] [--concurrency 32]
    .venv/bin/python bench/fp8_kv_cache.py kernel [--rounds 20]

- kernel: one decode step of 32 requests (SmolLM2's 9 q / 3 kv heads of 64, contexts of
  --context tokens) through kernels.paged_attention (the C decode kernel) over a bfloat16
  cache and over e4m3 / e5m2 caches of the same values, interleaved: best and median ms.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KVSERVE = [sys.executable, "-m", "kvserve.cli"]
TEXT = " ".join(
    [
        "The river starts high in the mountains, where snow melts in the spring and runs down",
        "through narrow valleys. Farmers along its banks have grown wheat and barley for",
        "centuries, and the old stone bridges still carry carts to the market towns. In the",
        "summer, children swim in the shallow pools while their parents sell fruit and bread",
        "in the square. The town council meets every Tuesday to discuss the roads, the school",
        "and the price of water. Last year they voted to build a new library next to the",
        "church, and the work began in the autumn. Most people agree that the library will be",
        "good for the town, although some worry about the cost. The builders expect to finish",
        "before the winter, when the first students from the village school will come to read",
        "and study there. Travellers who visit the region often say that the food is simple",
        "but very good, and that the people are kind and patient with strangers who do not",
        "speak the local language. In the evenings the old men play cards outside the cafe,",
        "arguing about football and the weather, while the swallows circle above the roofs.",
        "When the harvest is over, the whole valley gathers for a festival with music, dancing",
        "and long tables of food, and the celebrations often continue until the early morning.",
        "Scientists who study the region have found that the climate is slowly changing: the",
        "snow melts earlier each year, and the river runs lower in the late summer months.",
        "The farmers have started to plant crops that need less water, and the council has",
        "built small reservoirs to store the spring floods for the dry season ahead.",
    ]
)


def capacity(args) -> None:
    from kvserve import LLM

    print(f"KV budget {args.kv_cache_memory / 2**20:.0f} MiB, block size 16")
    print("| model dtype | KV dtype | blocks | tokens | x float KV |")
    print("|---|---|---|---|---|")
    for dtype in ("float32", "bfloat16"):
        base = None
        for kv in ("auto", "fp8", "fp8_e5m2"):
            llm = LLM(dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=args.kv_cache_memory)
            blocks = llm.engine_core.scheduler.kv_cache_manager.block_pool.num_blocks
            base = base or blocks
            print(f"| {dtype} | {kv} | {blocks} | {blocks * 16} | {blocks / base:.2f} |")
            llm.engine_core.shutdown()
            del llm


def _logprobs(model, token_ids: list[int], kv_dtype: torch.dtype, chunk: int = 64):
    from kvserve.services.worker.layers.attention import Attention
    from tests.support.model_steps import run_step

    block_size = 16
    num_blocks = -(-len(token_ids) // block_size)
    for module in model.modules():
        if isinstance(module, Attention):
            module.kv_cache = module.kv_cache_spec().allocate(
                num_blocks, block_size, kv_dtype, "cpu"
            )
    block_ids = list(range(num_blocks))
    logits, done = [], 0
    prefill = len(token_ids) * 3 // 4 // chunk * chunk
    steps = [chunk] * (prefill // chunk) + [1] * (len(token_ids) - prefill)
    for length in steps:
        (step,) = run_step(model, [(token_ids[done : done + length], done, block_ids)], block_size)
        logits.append(step)
        done += length
    return torch.cat(logits)[:-1].log_softmax(dim=-1)


def quality(args) -> None:
    from transformers import AutoTokenizer

    from kvserve.services.worker.model_loader import resolve_model
    from kvserve.services.worker.models import load_model

    model_dir = resolve_model(None)
    token_ids = AutoTokenizer.from_pretrained(model_dir).encode(TEXT)
    targets = torch.tensor(token_ids[1:])
    print(f"{len(token_ids)} tokens, prefill chunks of 64 then decodes")
    print("| model dtype | KV dtype | top-1 agreement | mean abs delta logprob | max |")
    print("|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        model, _ = load_model(model_dir, dtype, "cpu")
        reference = _logprobs(model, token_ids, dtype)
        for kv in (torch.float8_e4m3fn, torch.float8_e5m2):
            got = _logprobs(model, token_ids, kv)
            agree = (got.argmax(-1) == reference.argmax(-1)).float().mean().item()
            delta = (got - reference).gather(1, targets[:, None]).abs()
            name = str(dtype).removeprefix("torch.")
            kv_name = str(kv).removeprefix("torch.")
            print(
                f"| {name} | {kv_name} | {100 * agree:.1f}% | {delta.mean().item():.4f} "
                f"| {delta.max().item():.3f} |"
            )


def _bench_round(url: str, out_dir: str, label: str, args) -> float:
    command = [*KVSERVE, "bench", "serve", "--base-url", url, "--dataset-name", "random"]
    command += ["--random-input-len", str(args.input_len), "--random-output-len"]
    command += [str(args.output_len), "--num-prompts", str(args.num_prompts), "--ignore-eos"]
    command += ["--max-concurrency", str(args.concurrency), "--seed", "1", "--disable-tqdm"]
    command += ["--save-result", "--result-dir", out_dir, "--result-filename", f"{label}.json"]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    with open(os.path.join(out_dir, f"{label}.json")) as f:
        return json.load(f)["output_throughput"]


@contextlib.contextmanager
def _server(flags: list[str], log_path: str):
    """`kvserve serve` of the default model with flags, healthy (a loaded machine may need
    minutes to start); stopped on exit. The start-up measurements are skipped (the same
    defaults for both servers)."""
    from tests.support.ports import free_port
    from tests.support.server import start_kvserve, wait_healthy

    port = free_port()
    env = {**os.environ, "KVSERVE_NATIVE_DECODE_MEASURE": "0", "KVSERVE_PREFILL_ROUTE_MEASURE": "0"}
    args = ["serve", "--host", "127.0.0.1", "--port", str(port), *flags]
    process = start_kvserve(args, log_path, env=env)
    try:
        wait_healthy(process, port, log_path, timeout_s=1200)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=120)


def serve(args) -> None:
    out_dir = tempfile.mkdtemp(prefix="kvserve-fp8-kv-")
    common = ["--dtype", "bfloat16", "--kv-cache-memory", args.kv_cache_memory_flag]
    common += ["--max-num-seqs", str(args.concurrency), "--uvicorn-log-level", "warning"]
    setups = {"float": ["--kv-cache-dtype", "auto"], "fp8": ["--kv-cache-dtype", "fp8"]}
    rows: dict[str, list[float]] = {name: [] for name in setups}
    with contextlib.ExitStack() as stack:
        urls = {
            name: stack.enter_context(_server([*common, *flags], f"{out_dir}/{name}.log"))
            for name, flags in setups.items()
        }
        for name in setups:  # warm-up: the first requests of a server pay for allocations
            _bench_round(urls[name], out_dir, f"{name}-warmup", args)
        for round_index in range(args.rounds):
            order = list(setups) if round_index % 2 == 0 else list(setups)[::-1]
            for name in order:
                rows[name].append(_bench_round(urls[name], out_dir, f"{name}-r{round_index}", args))
                print(f"round {round_index} {name}: {rows[name][-1]:.1f} output tok/s", flush=True)
    for name in setups:
        with open(os.path.join(out_dir, f"{name}.log")) as f:
            print(name, next(line.strip() for line in f if "KV cache:" in line))
    ratios = [b / a for a, b in zip(rows["float"], rows["fp8"], strict=True)]
    print(
        f"fp8 / float output tok/s: median {statistics.median(ratios):.3f}, "
        f"range {min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} rounds; logs {out_dir}"
    )


def kernel(args) -> None:
    import time

    from kvserve import kernels
    from kvserve.kernels.cache import quantize_kv

    num_reqs, block_size = 32, 16
    blocks_per_req = -(-args.context // block_size)
    generator = torch.Generator().manual_seed(0)
    shape = (num_reqs * blocks_per_req + 1, block_size, 3, 64)
    caches = {"bfloat16": [torch.randn(shape, generator=generator).bfloat16() for _ in "kv"]}
    for kv in (torch.float8_e4m3fn, torch.float8_e5m2):
        caches[str(kv).removeprefix("torch.")] = [
            quantize_kv(c, 1.0, kv) for c in caches["bfloat16"]
        ]
    order = torch.randperm(num_reqs * blocks_per_req, generator=generator) + 1
    table = order.view(num_reqs, blocks_per_req).to(torch.int32)
    query = torch.randn(num_reqs, 9, 64, generator=generator).bfloat16()
    starts = torch.arange(num_reqs + 1, dtype=torch.int32)
    lens = torch.full((num_reqs,), args.context, dtype=torch.int32)
    times: dict[str, list[float]] = {name: [] for name in caches}
    for _ in range(args.rounds + 1):
        for name, (key_cache, value_cache) in caches.items():
            start = time.perf_counter()
            kernels.paged_attention(
                query, key_cache, value_cache, table, starts, lens, 0.125, 1, args.context
            )
            times[name].append(1e3 * (time.perf_counter() - start))
    print(f"decode step, {num_reqs} requests x {args.context} tokens, ms best / median:")
    for name, ms in times.items():
        print(f"  {name} cache: {min(ms[1:]):.2f} / {statistics.median(ms[1:]):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    cap = sub.add_parser("capacity")
    cap.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    sub.add_parser("quality")
    srv = sub.add_parser("serve")
    srv.add_argument("--rounds", type=int, default=3)
    srv.add_argument("--concurrency", type=int, default=32)
    srv.add_argument("--num-prompts", type=int, default=64)
    srv.add_argument("--input-len", type=int, default=128)
    srv.add_argument("--output-len", type=int, default=64)
    srv.add_argument("--kv-cache-memory-flag", default="512M")
    ker = sub.add_parser("kernel")
    ker.add_argument("--rounds", type=int, default=20)
    ker.add_argument("--context", type=int, default=1024)
    args = parser.parse_args()
    {"capacity": capacity, "quality": quality, "serve": serve, "kernel": kernel}[args.what](args)


if __name__ == "__main__":
    main()
