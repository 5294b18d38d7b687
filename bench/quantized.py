"""Weights held quantized against the float32 expansion, on the default model.

Variants: the float32 expansion of the shipped Q4_1 GGUF (the reference), and the weights
held quantized (`quantization="gguf"`) as the shipped Q4_1 file and as Q8_0, Q4_0 and Q4_K
re-quantizations of the float32 expansion (services/worker/gguf.py `requantize_gguf`; the
token embedding stays the shipped Q8_0; Q4_K needs rows of 256, so tensors with 576 inputs
fall back to Q4_1 as llama.cpp falls back to a 32-block type). Per variant:

- weight MiB: the model's parameters and held blocks, each storage counted once;
- offline tok/s: NUM_PROMPTS chat prompts decoded together, OUTPUT_LEN tokens each (ignore_eos);
- TPOT ms: batch 1, (time of 1 + N tokens - time of 1 token) / N, the prompt cached;
- accuracy: float32 greedy-decodes each prompt; every variant scores that continuation
  (teacher forcing, prompt_logprobs, steps of at most C_ROWS_MAX tokens so the decode
  kernel computes every position): mean / max |delta logprob| against float32, top-1
  agreement (share of those tokens that are the variant's own argmax), the share of
  free-running greedy tokens equal to float32's before the first divergence, and the share
  of prompts whose whole greedy output equals float32's.

Q4_1/f32 is the shipped Q4_1 with KVSERVE_QUANT_ACTIVATIONS=float32. The timings use
engines with the default token budget, interleave the variants round by round (all engines
live in this process) and report medians, so drift on a shared machine hits each alike.

    .venv/bin/python bench/quantized.py [--rounds 5] [--save-result FILE]
    .venv/bin/python bench/quantized.py --kernels     # per-shape kernel timings only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections.abc import Iterator

import numpy as np

from kvserve.benchmarks.datasets import CHAT_QUESTIONS

QUESTIONS = CHAT_QUESTIONS[:16]  # the prompts of tests/e2e/test_quantized.py
# NAME/f32: the same blocks with KVSERVE_QUANT_ACTIVATIONS=float32 (no activation rounding).
# int8: the float32 expansion's linear layers quantized per output channel at load (the
# embedding and tied LM head stay float32).
VARIANTS = ("float32", "Q8_0", "Q4_1", "Q4_1/f32", "Q4_0", "Q4_K", "int8")


@contextlib.contextmanager
def activations_for(variant: str) -> Iterator[None]:
    """KVSERVE_QUANT_ACTIVATIONS for the variant, while its engine runs (read per call)."""
    old = os.environ.get("KVSERVE_QUANT_ACTIVATIONS")
    os.environ["KVSERVE_QUANT_ACTIVATIONS"] = "float32" if variant.endswith("/f32") else "int8"
    try:
        yield
    finally:
        if old is None:
            del os.environ["KVSERVE_QUANT_ACTIVATIONS"]
        else:
            os.environ["KVSERVE_QUANT_ACTIVATIONS"] = old


def variant_files(cache_dir: str) -> dict[str, str]:
    """GGUF file per quantized variant, re-quantized into cache_dir once."""
    from kvserve.services.worker.gguf import requantize_gguf
    from kvserve.services.worker.model_loader import default_gguf_path

    src = default_gguf_path()
    files = {"Q4_1": src}
    os.makedirs(cache_dir, exist_ok=True)
    for qtype in ("Q8_0", "Q4_0", "Q4_K"):
        path = os.path.join(cache_dir, f"SmolLM2-135M-Instruct.requant-{qtype}.gguf")
        if not os.path.exists(path):
            tmp = f"{path}.tmp-{os.getpid()}.gguf"
            requantize_gguf(src, tmp, qtype, fallback="Q4_1", keep=("token_embd.weight",))
            os.replace(tmp, path)
        files[qtype] = path
    return files


def _score(llm, sequences, prompt_lens):
    """Per sequence: (logprob, rank) of each continuation token (teacher forcing)."""
    from kvserve import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    return [
        [(e[t].logprob, e[t].rank) for e, t in zip(out.prompt_logprobs[n:], seq[n:])]
        for out, seq, n in zip(outputs, sequences, prompt_lens)
    ]


def _tpot(llm, prompt, tokens: int) -> float:
    from kvserve import SamplingParams

    def run(n: int) -> float:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return time.perf_counter() - start

    run(1)  # the prompt's KV blocks are cached from here on
    return (run(1 + tokens) - run(1)) / tokens * 1e3


def _throughput(llm, prompts, tokens: int) -> float:
    from kvserve import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def _kernel_paths(x, qt, y, scratch, packed) -> list:
    import torch.nn.functional as F

    from kvserve.kernels import gemm, quant

    return [
        lambda: quant.gemm_c(x, qt, y),
        lambda: quant.gemm_f32_c(x, qt, y),
        lambda: F.linear(x, quant.dequantize_rows(qt, None, scratch)),
        lambda: gemm.onednn_linear(x, packed, None),
    ]


def kernel_table(rounds: int) -> None:
    """Per layer shape and row count: the C integer kernel, the C float32-tile kernel,
    dequantize + F.linear (the prefill path) and oneDNN on the float32 weight, each the
    median of its calls, A B C D interleaved (what C_ROWS_MAX was chosen from)."""
    import torch

    from kvserve.kernels import gemm
    from kvserve.services.worker.gguf import iterate_gguf_tensors
    from kvserve.services.worker.model_loader import default_gguf_path

    wanted = {
        "model.layers.0.mlp.gate_proj.weight": "gate (of gate_up)",
        "model.layers.0.mlp.down_proj.weight": "down",
        "model.layers.0.self_attn.q_proj.weight": "q / o",
        "model.embed_tokens.weight": "lm_head (Q8_0)",
    }
    weights = {
        wanted[n]: t
        for n, t in iterate_gguf_tensors(default_gguf_path(), keep_quantized=True)
        if n in wanted
    }
    print("| layer | type | N x K | rows | int8 C ms | float32-tile C ms | dequant + F.linear ms |"
          " oneDNN float32 ms |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for label, qt in weights.items():
        n, k = qt.shape
        dense = qt.dequantize()
        packed = gemm.pack_onednn(dense)
        scratch = torch.empty(n * k)
        for rows in (1, 4, 16, 64, 256, 1024):
            x = torch.randn(rows, k)
            y = torch.empty(rows, n)
            fns = _kernel_paths(x, qt, y, scratch.view(n, k), packed)
            times: list[list[float]] = [[] for _ in fns]
            for fn in fns:
                fn()
            for _ in range(rounds):
                for fn, samples in zip(fns, times):
                    start = time.perf_counter()
                    fn()
                    samples.append((time.perf_counter() - start) * 1e3)
            cells = " | ".join(f"{statistics.median(t):.3f}" for t in times)
            print(f"| {label} | {qt.qtype} | {n}x{k} | {rows} | {cells} |")


def main() -> int:
    from kvserve import LLM, SamplingParams
    from kvserve.kernels.quant import C_ROWS_MAX
    from kvserve.services.worker.quantization import weight_bytes
    from kvserve.shared.env import CACHE_DIR

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64, help="greedy tokens scored")
    parser.add_argument("--num-prompts", type=int, default=32, help="offline batch size")
    parser.add_argument("--output-len", type=int, default=64, help="offline tokens per prompt")
    parser.add_argument("--tpot-tokens", type=int, default=32)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--save-result", default=None)
    parser.add_argument(
        "--kernels", action="store_true", help="only the per-shape kernel table (20 calls each)"
    )
    args = parser.parse_args()
    if args.kernels:
        kernel_table(rounds=20)
        return 0

    files = variant_files(os.path.join(CACHE_DIR.get(), "requantized"))

    def make(name: str, **extra) -> LLM:
        kw = dict(dtype="float32", kv_cache_memory_bytes=256 << 20, **extra)
        if name == "float32":
            return LLM(**kw)
        if name == "int8":
            return LLM(quantization="int8", **kw)
        return LLM(model=files[name.split("/")[0]], quantization="gguf", **kw)

    def model_of(llm):
        return llm.engine_core.executor.worker.runner.model

    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    # Accuracy: a token budget of C_ROWS_MAX so every matmul, prefill too, takes the C kernel
    # that decode runs (larger prefill steps multiply float32 expansions of the blocks).
    summary: dict[str, dict] = {}
    reference = ref_lp = sequences = prompts = None
    for name in args.variants:
        with activations_for(name):
            llm = make(name, max_num_batched_tokens=C_ROWS_MAX, enable_prefix_caching=False)
            outs = llm.chat(conversations, greedy, use_tqdm=False)
            own = [list(o.outputs[0].token_ids) for o in outs]
            if reference is None:  # float32 comes first
                assert name == "float32", "the variants must start with float32"
                prompts = [list(o.prompt_token_ids) for o in outs]
                reference = own
                sequences = [p + c for p, c in zip(prompts, reference)]
            scored = _score(llm, sequences, [len(p) for p in prompts])
            weights = weight_bytes(model_of(llm))
            del llm
        lps = np.concatenate([[lp for lp, _ in s] for s in scored])
        ranks = np.concatenate([[r for _, r in s] for s in scored])
        if ref_lp is None:
            ref_lp = lps
        prefix = [
            next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), min(len(o), len(r)))
            for o, r in zip(own, reference)
        ]
        summary[name] = {
            "weight_mib": weights / 2**20,
            "mean_abs_delta_logprob": float(np.mean(np.abs(lps - ref_lp))),
            "max_abs_delta_logprob": float(np.max(np.abs(lps - ref_lp))),
            "top1_agreement": float(np.mean(ranks == 1)),
            "greedy_prefix_share": float(sum(prefix) / sum(len(r) for r in reference)),
            "greedy_equal_prompts": float(np.mean([o == r for o, r in zip(own, reference)])),
            "tok_s": [],
            "tpot_ms": [],
        }

    # Speed: engines with the default token budget, all alive, interleaved round by round.
    engines = {}
    for name in args.variants:
        with activations_for(name):
            engines[name] = make(name)
    batch = (prompts * (args.num_prompts // len(prompts) + 1))[: args.num_prompts]
    for _ in range(args.rounds):
        for name, llm in engines.items():
            with activations_for(name):
                summary[name]["tpot_ms"].append(_tpot(llm, prompts[0], args.tpot_tokens))
                summary[name]["tok_s"].append(_throughput(llm, batch, args.output_len))

    base = summary["float32"] if "float32" in summary else None
    print(
        "| weights | weight MiB | vs float32 | offline tok/s | batch-1 TPOT ms | TPOT speed-up | "
        "mean abs dlogprob | max abs dlogprob | top-1 agreement | greedy prefix | "
        "greedy-equal prompts |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for s in summary.values():
        s["tok_s_median"] = statistics.median(s["tok_s"])
        s["tpot_ms_median"] = statistics.median(s["tpot_ms"])
    for name, s in summary.items():
        mem = s["weight_mib"] / base["weight_mib"] if base else float("nan")
        speed = base["tpot_ms_median"] / s["tpot_ms_median"] if base else float("nan")
        label = {"float32": "float32 expansion", "int8": "int8 per channel (linears)"}.get(
            name, f"{name.split('/')[0]} held"
        )
        if name.endswith("/f32"):
            label += " (float32 activations)"
        print(
            f"| {label} | {s['weight_mib']:.1f} | {mem:.2f} | {s['tok_s_median']:.1f} | "
            f"{s['tpot_ms_median']:.2f} | {speed:.2f}x | {s['mean_abs_delta_logprob']:.4f} | "
            f"{s['max_abs_delta_logprob']:.3f} | {s['top1_agreement']:.1%} | "
            f"{s['greedy_prefix_share']:.1%} | {s['greedy_equal_prompts']:.0%} |"
        )
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump({"args": vars(args), "variants": summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
