"""The accuracy cost of bfloat16 against float32, on the default model.

For each chat prompt, float32 greedy-decodes a continuation; then both dtypes score that same
continuation (teacher forcing, `prompt_logprobs`), so every position compares like with like:
- top-1 agreement: the share of continuation tokens that are also the dtype's own argmax there;
- mean |delta logprob| of those tokens against float32's;
- greedy match: the share of prompts whose free-running bfloat16 greedy output equals float32's,
  and the mean length of the common prefix.

    .venv/bin/python bench/bf16_accuracy.py [--max-tokens 64] [--save-result FILE]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from kvserve.benchmarks.datasets import CHAT_QUESTIONS as QUESTIONS


def _score(llm, sequences: list[list[int]], prompt_lens: list[int]):
    """Per sequence: (logprob, rank) of each continuation token under llm (teacher forcing)."""
    from kvserve import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    scored = []
    for out, seq, prompt_len in zip(outputs, sequences, prompt_lens):
        entries = out.prompt_logprobs[prompt_len:]
        scored.append(
            [(entry[tid].logprob, entry[tid].rank) for entry, tid in zip(entries, seq[prompt_len:])]
        )
    return scored


def main() -> int:
    from kvserve import LLM, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--save-result", default=None)
    args = parser.parse_args()

    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    results = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(dtype=dtype, enable_prefix_caching=False)
        outputs = llm.chat(conversations, greedy, use_tqdm=False)
        if dtype == "float32":
            prompts = [o.prompt_token_ids for o in outputs]
            reference = [list(o.outputs[0].token_ids) for o in outputs]
            sequences = [p + c for p, c in zip(prompts, reference)]
        own = [list(o.outputs[0].token_ids) for o in outputs]
        results[dtype] = {
            "greedy": own,
            "scored": _score(llm, sequences, [len(p) for p in prompts]),
        }
        del llm

    ref_lp = np.concatenate([[lp for lp, _ in s] for s in results["float32"]["scored"]])
    summary = {"num_prompts": len(QUESTIONS), "max_tokens": args.max_tokens}
    for dtype, r in results.items():
        lps = np.concatenate([[lp for lp, _ in s] for s in r["scored"]])
        ranks = np.concatenate([[rank for _, rank in s] for s in r["scored"]])
        prefix = [
            next((i for i, (a, b) in enumerate(zip(own, ref)) if a != b), min(len(own), len(ref)))
            for own, ref in zip(r["greedy"], reference)
        ]
        summary[dtype] = {
            "top1_agreement": float(np.mean(ranks == 1)),
            "mean_abs_delta_logprob": float(np.mean(np.abs(lps - ref_lp))),
            "max_abs_delta_logprob": float(np.max(np.abs(lps - ref_lp))),
            "mean_nll": float(-np.mean(lps)),
            "greedy_match": float(
                np.mean([own == ref for own, ref in zip(r["greedy"], reference)])
            ),
            "mean_common_prefix_tokens": float(np.mean(prefix)),
        }
    print(
        "| dtype | top-1 agreement | mean abs dlogprob | max abs dlogprob | mean NLL | "
        "greedy match | mean common prefix |"
    )
    print("|---|---|---|---|---|---|---|")
    for dtype in ("float32", "bfloat16"):
        s = summary[dtype]
        print(
            f"| {dtype} | {s['top1_agreement']:.1%} | {s['mean_abs_delta_logprob']:.4f} | "
            f"{s['max_abs_delta_logprob']:.3f} | {s['mean_nll']:.3f} | "
            f"{s['greedy_match']:.0%} | {s['mean_common_prefix_tokens']:.1f} |"
        )
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
