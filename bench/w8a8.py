"""W8A8 int8 (a compressed-tensors checkpoint of the default model written by llm-compressor)
against kvserve's own bfloat16 on the float checkpoint, in one process, interleaved.

The W8A8 folder is made once by tests/support/make_w8a8_checkpoints.py --default-model (in a
venv with llmcompressor) from the default model's float folder. Per variant:

- offline output tok/s: NUM_PROMPTS random prompts (INPUT_LEN tokens) decoded together,
  OUTPUT_LEN tokens each, ignore_eos (`LLM.generate`, the default token budget: up to 32
  sequences decode per step, so this is also the concurrency-32 decode load);
- quality: the float32 model greedy-decodes the chat prompts; each variant scores that
  continuation teacher-forced: top-1 agreement (share of positions where the variant's own
  argmax is the float32 token) and mean |delta logprob| against float32.

Rounds alternate the variants (bf16, W8A8, bf16, ...); the load average is printed beside
each figure (the machine may be shared).

    python bench/w8a8.py --w8a8 /path/to/smollm2-w8a8 [--rounds 3] [--num-prompts 32]
    python bench/w8a8.py --kernels [--rows 1,4,16,32,128,512]
        # per-shape us per call: bf16 oneDNN, kvq, intmm, oneDNN qlinear, the AMX kernel
    python bench/w8a8.py --w8a8 /path/to/smollm2-w8a8 --profile
        # where a 32-row decode step's time goes: linears, attention, the rest, logits
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import numpy as np

from kvserve.benchmarks.datasets import CHAT_QUESTIONS


def _throughput(llm, prompts, tokens: int) -> float:
    from kvserve import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def _score(llm, sequences, prompt_lens):
    from kvserve import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    return [
        [(e[t].logprob, e[t].rank) for e, t in zip(out.prompt_logprobs[n:], seq[n:])]
        for out, seq, n in zip(outputs, sequences, prompt_lens)
    ]


SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def kernel_table(rounds: int, rows_list=(1, 4, 16, 32, 64, 128, 256, 512)) -> None:
    """Microseconds per call at SmolLM2-135M's shapes, bfloat16 activations, best of rounds
    (interleaved): oneDNN's bfloat16 linear on a prepacked weight (what the bf16 model runs),
    the I8 VNNI kernel, the per-token int8 GEMM by torch._int_mm, oneDNN's int8 linear on a
    prepacked weight (not shipped: `_qlinear_prepacked`) and the fused AMX-INT8 kernel (its
    weight packed before timing, as at a layer's first call); the shipped W8A8 plan picks
    among kvq, intmm and amx."""
    import torch

    from kvserve.kernels import w8a8
    from kvserve.kernels.quant import _quant_linear_blocks, quantize_int8

    def best(fn, reps):
        fn()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) / reps * 1e6

    has_amx = w8a8.amx_available()
    print("| shape | rows | bf16 oneDNN us | kvq us | intmm us | intmm / bf16 | "
          "qlinear us | qlinear / bf16 | amx us | amx / bf16 | load |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    totals: dict[int, list[float]] = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k) * 0.05
        wb = w.bfloat16()
        packed = torch.ops.mkldnn._reorder_linear_weight(wb, None)
        qt = quantize_int8(w)
        wq = qt.data.view(torch.int8)
        prepacked = torch.ops.onednn.qlinear_prepack(wq, None)
        for rows in rows_list:
            x = torch.randn(rows, k).bfloat16()
            paths = [
                functools.partial(
                    torch.ops.mkldnn._linear_pointwise, x, packed, None, "none", [], ""
                ),
                functools.partial(_quant_linear_blocks, x, qt, None, None),
                functools.partial(w8a8.linear_torch_int_mm, x, wq, qt.scales),
                functools.partial(_qlinear_prepacked, x, prepacked, qt.scales),
            ]
            if has_amx:
                paths.append(functools.partial(w8a8.linear_amx, x, wq, qt.scales))
            reps = max(3, 256 // rows)
            t = [float("inf")] * 5
            for _ in range(rounds):
                for i, fn in enumerate(paths):
                    t[i] = min(t[i], best(fn, reps))
            acc = totals.setdefault(rows, [0.0] * 5)
            for i in range(5):
                acc[i] += t[i]
            print(f"| {name} {n}x{k} | {rows} | {t[0]:.1f} | {t[1]:.1f} | {t[2]:.1f} | "
                  f"{t[2] / t[0]:.2f} | {t[3]:.1f} | {t[3] / t[0]:.2f} | {t[4]:.1f} | "
                  f"{t[4] / t[0]:.2f} | {os.getloadavg()[0]:.1f} |", flush=True)  # fmt: skip
    for rows, (b, kvq, intmm, ql, amx) in totals.items():
        print(f"| all four | {rows} | {b:.0f} | {kvq:.0f} | {intmm:.0f} | {intmm / b:.2f} | "
              f"{ql:.0f} | {ql / b:.2f} | {amx:.0f} | {amx / b:.2f} | |")  # fmt: skip


def _qlinear_prepacked(x, prepacked, weight_scales):
    """Not shipped, the next lever measured: per-token quantization, then oneDNN's int8
    linear on a weight packed once (per-channel weight scales in the op, bfloat16 out), the
    token scales applied after."""
    import torch

    from kvserve.kernels import w8a8

    q, sx = w8a8.quantize_per_token(x)
    zero_points = torch.zeros(weight_scales.numel(), dtype=torch.int64)
    y = torch.ops.onednn.qlinear_pointwise(
        q, 1.0, 0, prepacked, weight_scales, zero_points, None, 1.0, 0, torch.bfloat16,
        "none", [None], "",
    )  # fmt: skip
    return y.mul_(sx.to(torch.bfloat16)[:, None])


def decode_profile(
    w8a8_folder: str, rounds: int, num_prompts: int, input_len: int, query_len: int = 1
) -> None:
    """Where the time of a decode step of num_prompts requests (input_len cached tokens each)
    goes, per variant: the model runner's timing step (what its start-up measurements run)
    through the model and compute_logits, forward hooks timing the linears (every
    LinearBase) and the attention modules; "rest" is the forward minus both (norms, rotary,
    SiLU-and-mul, residual adds, embedding, Python). rounds steps per variant, interleaved;
    the step with the least total is reported (the others were preempted more), with the
    median total beside it. query_len > 1: a prefill step of num_prompts x query_len tokens
    instead (after input_len cached tokens each; 0 for fresh prompts). Steps the native
    decode stack takes time it whole: their linears and attention count under "rest"."""
    import torch

    from kvserve import LLM
    from kvserve.services.worker.layers.attention import Attention
    from kvserve.services.worker.layers.linear import LinearBase

    def instrument(model) -> dict[str, float]:
        times = dict.fromkeys(("linears", "attention"), 0.0)
        start: dict[int, float] = {}

        def pre(module, args):
            start[id(module)] = time.perf_counter()

        def post(kind):
            def hook(module, args, out):
                times[kind] += time.perf_counter() - start[id(module)]

            return hook

        for module in model.modules():
            kind = "linears" if isinstance(module, LinearBase) else None
            kind = "attention" if isinstance(module, Attention) else kind
            if kind is not None:
                module.register_forward_pre_hook(pre)
                module.register_forward_hook(post(kind))
        return times

    kw = dict(kv_cache_memory_bytes=1 << 30, enable_prefix_caching=False)
    engines = {
        "bfloat16": LLM(dtype="bfloat16", **kw),
        "W8A8": LLM(model=w8a8_folder, dtype="bfloat16", **kw),
    }
    rng = np.random.default_rng(0)
    prompt_len = max(input_len, query_len)
    prompts = [rng.integers(100, 40000, prompt_len).tolist() for _ in range(num_prompts)]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    setups = {}
    for name, llm in engines.items():
        _throughput(llm, prompts, 4)  # warm: plans measured at every row count used
        runner = llm.engine_core.executor.worker.runner
        lens = np.full(num_prompts, query_len, dtype=np.int32)
        step = runner.step_timer.timing_step(lens, context=input_len)
        setups[name] = (runner, step, instrument(runner.model))
    with torch.inference_mode():
        for _ in range(rounds):
            for name, (runner, step, times) in setups.items():
                for key in times:
                    times[key] = 0.0
                begin = time.perf_counter()
                hidden = runner._run_stage(*step)
                forward = time.perf_counter() - begin
                runner.model.compute_logits(hidden)
                total = time.perf_counter() - begin
                runs[name].append(dict(times, forward=forward, total=total))
    kind = "decode" if query_len == 1 else f"{query_len}-token prefill"
    print(f"\n| variant | ms per {num_prompts}-request {kind} step (best; median) | linears | "
          f"attention | rest | logits (LM head, float) | load |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, steps in runs.items():
        best = min(steps, key=lambda r: r["total"])
        median = statistics.median(r["total"] for r in steps) * 1e3
        ms = {key: v * 1e3 for key, v in best.items()}
        rest = ms["forward"] - ms["linears"] - ms["attention"]
        parts = [ms["linears"], ms["attention"], rest, ms["total"] - ms["forward"]]
        cells = " | ".join(f"{v:.2f} ({v / ms['total']:.0%})" for v in parts)
        print(f"| {name} | {ms['total']:.2f}; {median:.2f} | {cells} | "
              f"{os.getloadavg()[0]:.1f} |")  # fmt: skip


def forward_share(w8a8_folder: str, num_prompts: int, input_len: int, output_len: int) -> None:
    """Per variant, one offline round (after a warm one) with the model runner's steps timed:
    how much of the round's wall time is the runner's execute_model (the forward, logits and
    sampling of every step) and how much is outside it (scheduling, inputs, outputs)."""
    from kvserve import LLM

    kw = dict(kv_cache_memory_bytes=1 << 30, enable_prefix_caching=False)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, input_len).tolist() for _ in range(num_prompts)]
    print("\n| variant | round s | execute_model s (steps) | forward s | of which steps of "
          "> 128 tokens s (steps) | outside s | load |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, model in (("bfloat16", None), ("W8A8", w8a8_folder)):
        llm = LLM(model=model, dtype="bfloat16", **kw)
        runner = llm.engine_core.executor.worker.runner
        _throughput(llm, prompts[:8], 4)  # warm
        spent = {"execute": 0.0, "forward": 0.0, "steps": 0, "big": 0.0, "big_steps": 0}

        def timed(fn, key, spent=spent):
            def call(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    took = time.perf_counter() - start
                    spent[key] += took
                    spent["steps"] += key == "execute"
                    if key == "forward" and args[0].shape[0] > 128:  # carries prefill chunks
                        spent["big"] += took
                        spent["big_steps"] += 1

            return call

        runner.execute_model = timed(runner.execute_model, "execute")
        runner._run_stage = timed(runner._run_stage, "forward")
        start = time.perf_counter()
        tok_s = _throughput(llm, prompts, output_len)
        total = time.perf_counter() - start
        print(f"| {name} ({tok_s:.0f} tok/s) | {total:.2f} | {spent['execute']:.2f} "
              f"({spent['steps']}) | {spent['forward']:.2f} | {spent['big']:.2f} "
              f"({spent['big_steps']}) | {total - spent['execute']:.2f} | "
              f"{os.getloadavg()[0]:.1f} |")  # fmt: skip
        del llm


def main() -> int:
    from kvserve import LLM, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--w8a8", help="the W8A8 compressed-tensors folder")
    parser.add_argument("--kernels", action="store_true", help="only the kernel table")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=48, help="greedy tokens scored")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--rows", default="1,4,16,32,64,128,256,512", help="--kernels' rows")
    parser.add_argument("--profile", action="store_true", help="only the decode-step profile")
    parser.add_argument(
        "--forward-share", action="store_true", help="only the step time against the round's"
    )
    parser.add_argument(
        "--query-len", type=int, default=1, help="--profile: tokens per request (1: decode)"
    )
    args = parser.parse_args()
    if args.kernels:
        kernel_table(rounds=args.rounds, rows_list=[int(r) for r in args.rows.split(",")])
        return 0
    if not args.w8a8:
        parser.error("--w8a8 FOLDER is needed (or --kernels)")
    if args.forward_share:
        forward_share(args.w8a8, args.num_prompts, args.input_len, args.output_len)
        return 0
    if args.profile:
        decode_profile(args.w8a8, args.rounds, args.num_prompts, args.input_len, args.query_len)
        return 0
    kw = dict(kv_cache_memory_bytes=1 << 30)

    summary: dict[str, dict] = {}
    if not args.skip_quality:
        conversations = [[{"role": "user", "content": q}] for q in CHAT_QUESTIONS[:16]]
        greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        ref = LLM(dtype="float32", enable_prefix_caching=False, **kw)
        outs = ref.chat(conversations, greedy, use_tqdm=False)
        prompts = [list(o.prompt_token_ids) for o in outs]
        sequences = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
        lens = [len(p) for p in prompts]
        ref_lp = np.concatenate([[lp for lp, _ in s] for s in _score(ref, sequences, lens)])
        del ref
        for name, model in (("bfloat16", None), ("W8A8", args.w8a8)):
            llm = LLM(model=model, dtype="bfloat16", enable_prefix_caching=False, **kw)
            scored = _score(llm, sequences, lens)
            del llm
            lps = np.concatenate([[lp for lp, _ in s] for s in scored])
            ranks = np.concatenate([[r for _, r in s] for s in scored])
            summary[name] = {
                "top1": float(np.mean(ranks == 1)),
                "mean_abs_dlp": float(np.mean(np.abs(lps - ref_lp))),
            }

    engines = {
        "bfloat16": LLM(dtype="bfloat16", enable_prefix_caching=False, **kw),
        "W8A8": LLM(model=args.w8a8, dtype="bfloat16", enable_prefix_caching=False, **kw),
    }
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, args.input_len).tolist() for _ in range(args.num_prompts)]
    for llm in engines.values():  # warm: plans measured, pages touched
        _throughput(llm, prompts[:4], 4)
    tok_s: dict[str, list[float]] = {name: [] for name in engines}
    loads: list[float] = []
    for r in range(args.rounds):
        for name, llm in engines.items():
            tok_s[name].append(_throughput(llm, prompts, args.output_len))
            loads.append(os.getloadavg()[0])
            print(f"round {r} {name}: {tok_s[name][-1]:.1f} tok/s (load {loads[-1]:.1f})",
                  flush=True)  # fmt: skip
    ratios = [w / b for w, b in zip(tok_s["W8A8"], tok_s["bfloat16"])]
    print("\n| variant | offline output tok/s per round | median | top-1 vs float32 | "
          "mean abs dlogprob |")  # fmt: skip
    print("|---|---|---|---|---|")
    for name, values in tok_s.items():
        q = summary.get(name, {})
        print(f"| {name} | {', '.join(f'{v:.0f}' for v in values)} | "
              f"{statistics.median(values):.0f} | {q.get('top1', float('nan')):.3f} | "
              f"{q.get('mean_abs_dlp', float('nan')):.4f} |")  # fmt: skip
    spread = f"[{min(ratios):.2f}-{max(ratios):.2f}]"
    load = f"{min(loads):.1f}-{max(loads):.1f}"
    print(f"\nW8A8 / bfloat16: median {statistics.median(ratios):.2f}x {spread}; load {load}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
