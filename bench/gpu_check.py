"""The GPU checks of bench/gpu_check.sh: greedy equality with HF, CUDA graphs against
--enforce-eager (same greedy tokens, decode step times of both), and decode attention timed
against the device's memory bandwidth. One JSON line per check on stdout.

    python bench/gpu_check.py greedy [--model DIR_OR_GGUF] [--max-tokens 32]
    python bench/gpu_check.py cuda_graphs [--model DIR_OR_GGUF] [--batch-sizes 1 16 64]
    python bench/gpu_check.py attention [--peak-gbps 4800]

All also run on a CPU (small sizes, to check the script itself: tests/unit/bench); there the
cuda_graphs check compares two eager runs, as a CPU captures no graphs.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import torch

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List three colours of the rainbow:",
    "Water boils at",
]

# (name, query heads, KV heads, head size): the default model and a Llama-3-8B-sized layer.
ATTENTION_SHAPES = [("smollm2-135m", 9, 3, 64), ("llama3-8b", 32, 8, 128)]


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def check_greedy(model: str | None, max_tokens: int, kv_cache_memory: int | None) -> dict:
    """kvserve's greedy float32 tokens against HF transformers' on the same weights."""
    from transformers import AutoModelForCausalLM

    from kvserve import LLM, SamplingParams

    extra = {} if kv_cache_memory is None else {"kv_cache_memory": kv_cache_memory}
    llm = LLM(model=model, dtype="float32", max_model_len=512, **extra)
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    device = _device()
    hf = AutoModelForCausalLM.from_pretrained(llm.model_dir, dtype=torch.float32).to(device)
    equal, divergences = 0, []
    for index, (prompt, mine) in enumerate(zip(PROMPTS, ours)):
        ids = torch.tensor([tokenizer.encode(prompt)], device=device)
        with torch.no_grad():
            out = hf.generate(
                ids,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        theirs = out.sequences[0, ids.shape[1] :].tolist()
        # min_new_tokens keeps HF going by masking its end-of-sequence tokens, while ours
        # (ignore_eos) may pick one and go on: where HF's own logits chose an end token, both
        # are compared up to it, with HF's unmasked choice.
        unmasked = [int(step[0].argmax()) for step in out.logits]
        for i, (emitted, chosen) in enumerate(zip(theirs, unmasked)):
            if emitted != chosen:
                mine, theirs = list(mine)[: i + 1], theirs[:i] + [chosen]
                break
        if list(mine) == theirs:
            equal += 1
            continue
        # Where the two first part: how far our token's logit sits below HF's top one, in
        # HF's own logits. A gap of float32 rounding (~1e-4) is a near tie that summation
        # order decides; a larger one is a wrong result.
        position = next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b)
        logits = out.logits[position][0].float()
        divergences.append(
            {
                "prompt": index,
                "position": position,
                "ours": int(mine[position]),
                "hf": int(theirs[position]),
                "logit_gap": round(float(logits[theirs[position]] - logits[mine[position]]), 6),
            }
        )
    return {
        "check": "greedy_equals_hf",
        "device": str(device),
        "prompts": len(PROMPTS),
        "equal": equal,
        "divergences": divergences,
        "ok": equal == len(PROMPTS),
    }


def _greedy_tokens(llm, prompts: list[str], max_tokens: int) -> list[list[int]]:
    from kvserve import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def decode_step_ms(llm, num_seqs: int, num_steps: int) -> float:
    """Milliseconds of one decode step of num_seqs requests: a run of num_steps + 1 tokens
    less a run of 1 token (the same prefill, from the prefix cache), over num_steps; the
    best of three."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(num_seqs)]
    _greedy_tokens(llm, prompts, num_steps + 1)  # warm-up, and fills the prefix cache
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        _greedy_tokens(llm, prompts, 1)
        middle = time.perf_counter()
        _greedy_tokens(llm, prompts, num_steps + 1)
        end = time.perf_counter()
        best = min(best, ((end - middle) - (middle - start)) / num_steps)
    return best * 1e3


def check_cuda_graphs(
    model: str | None,
    max_tokens: int,
    kv_cache_memory: int | None,
    batch_sizes: list[int],
    num_steps: int,
    dtype: str,
) -> dict:
    """Greedy tokens with CUDA graphs equal to --enforce-eager's, and the decode step time
    of each at batch_sizes requests. On a GPU the graphs must be captured and replayed."""
    from kvserve import LLM

    device = _device()
    if kv_cache_memory is None and device.type == "cuda":
        kv_cache_memory = 2 << 30  # both engines fit at once, no memory profile
    extra = {} if kv_cache_memory is None else {"kv_cache_memory": kv_cache_memory}
    tokens, step_ms, graph_info = {}, {}, {}
    for mode in ("eager", "graphs"):
        llm = LLM(
            model=model,
            dtype=dtype,
            max_model_len=512,
            max_num_seqs=max(batch_sizes),
            enforce_eager=mode == "eager",
            **extra,
        )
        tokens[mode] = _greedy_tokens(llm, PROMPTS, max_tokens)
        step_ms[mode] = {str(n): round(decode_step_ms(llm, n, num_steps), 3) for n in batch_sizes}
        graphs = llm.engine_core.executor.worker.runner.cuda_graphs
        if mode == "graphs":
            graph_info = {
                "captured": [] if graphs is None else graphs.sizes,
                "replays": 0 if graphs is None else graphs.num_replays,
            }
        del llm, graphs
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    equal = sum(a == b for a, b in zip(tokens["graphs"], tokens["eager"]))
    used = bool(graph_info["captured"]) and graph_info["replays"] > 0
    ok = equal == len(PROMPTS) and (used or device.type != "cuda")
    steps = ", ".join(
        f"{n} seqs {step_ms['eager'][n]} -> {step_ms['graphs'][n]} ms" for n in step_ms["eager"]
    )
    return {
        "check": "cuda_graphs",
        "device": str(device),
        "dtype": dtype,
        "prompts": len(PROMPTS),
        "equal": equal,
        **graph_info,
        "decode_step_ms": step_ms,
        "speedup": {
            n: round(step_ms["eager"][n] / step_ms["graphs"][n], 2)
            if step_ms["graphs"][n] > 0
            else None
            for n in step_ms["eager"]
        },
        "ok": ok,
        "summary": (
            f"{'ok' if ok else 'FAILED'}: greedy equal {equal}/{len(PROMPTS)}, "
            f"{len(graph_info['captured'])} sizes captured, {graph_info['replays']} replays; "
            f"decode step eager -> graphs ({dtype}): {steps}"
        ),
    }


def copy_bandwidth_gbps(device: torch.device, nbytes: int) -> float:
    """Measured device-to-device copy, counting bytes read and written (GB/s)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    _sync(device)
    times = []
    for _ in range(10):
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(times) / 1e9


def time_decode_attention(
    device: torch.device, num_seqs: int, context: int, hq: int, hkv: int, d: int
) -> tuple[float, int]:
    """(median seconds, K/V bytes read) of one decode step of kernels.paged_attention."""
    from kvserve import kernels

    block_size = 16
    blocks_per_seq = context // block_size
    num_blocks = num_seqs * blocks_per_seq
    dtype = torch.bfloat16
    key_cache = torch.randn(num_blocks, block_size, hkv, d, dtype=dtype, device=device)
    value_cache = torch.randn_like(key_cache)
    # Each sequence's blocks are a shuffled, disjoint set, as a paged cache leaves them.
    order = torch.randperm(num_blocks, device=device, dtype=torch.int64).to(torch.int32)
    block_table = order.view(num_seqs, blocks_per_seq)
    query = torch.randn(num_seqs, hq, d, dtype=dtype, device=device)
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32, device=device)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=device)

    def step() -> torch.Tensor:
        return kernels.paged_attention(
            query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
            d**-0.5, 1, context,
        )  # fmt: skip

    for _ in range(3):
        step()
    _sync(device)
    times = []
    for _ in range(10):
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    kv_bytes = 2 * num_seqs * context * hkv * d * key_cache.element_size()
    return statistics.median(times), kv_bytes


def check_attention(peak_gbps: float | None, target: float) -> list[dict]:
    device = _device()
    on_gpu = device.type == "cuda"
    num_seqs, context = (64, 4096) if on_gpu else (2, 256)
    copy_gbps = copy_bandwidth_gbps(device, (4 << 30) if on_gpu else (64 << 20))
    reference = peak_gbps or copy_gbps
    results = []
    for name, hq, hkv, d in ATTENTION_SHAPES:
        seconds, kv_bytes = time_decode_attention(device, num_seqs, context, hq, hkv, d)
        gbps = kv_bytes / seconds / 1e9
        results.append(
            {
                "check": "decode_attention_bandwidth",
                "shape": name,
                "device": torch.cuda.get_device_name() if on_gpu else "cpu",
                "num_seqs": num_seqs,
                "context": context,
                "ms": round(seconds * 1e3, 4),
                "kv_gbps": round(gbps, 3),
                "copy_gbps": round(copy_gbps, 1),
                "reference_gbps": round(reference, 1),
                "fraction": round(gbps / reference, 3),
                "ok": gbps / reference >= target,
            }
        )
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    sub = p.add_subparsers(dest="check", required=True)
    g = sub.add_parser("greedy")
    g.add_argument("--model", default=None)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--kv-cache-memory", type=int, default=None, help="bytes (default: kvserve's)")
    c = sub.add_parser("cuda_graphs")
    c.add_argument("--model", default=None)
    c.add_argument("--max-tokens", type=int, default=32)
    c.add_argument("--kv-cache-memory", type=int, default=None, help="bytes (GPU: 2 GiB)")
    c.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    c.add_argument("--num-steps", type=int, default=64, help="decode steps timed per run")
    c.add_argument("--dtype", default="float32", help="float32: greedy ties cannot flip")
    a = sub.add_parser("attention")
    a.add_argument(
        "--peak-gbps",
        type=float,
        default=None,
        help="HBM bandwidth to compare with (H200: 4800); default: the measured copy",
    )
    a.add_argument("--target", type=float, default=0.70)
    args = p.parse_args(argv)
    if args.check == "greedy":
        results = [check_greedy(args.model, args.max_tokens, args.kv_cache_memory)]
    elif args.check == "cuda_graphs":
        results = [
            check_cuda_graphs(
                args.model,
                args.max_tokens,
                args.kv_cache_memory,
                args.batch_sizes,
                args.num_steps,
                args.dtype,
            )
        ]
    else:
        results = check_attention(args.peak_gbps, args.target)
    for result in results:
        print(json.dumps(result), flush=True)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
