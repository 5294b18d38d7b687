"""EAGLE-3 against EAGLE-1 on the default model (SmolLM2-135M-Instruct), trained on this CPU.

Both heads are trained by `kvserve train-draft`'s own code (train_eagle.py, train_eagle3.py)
on the same data with the same step budget: kvserve's greedy replies (float32, chat template)
to `--num-prompts` prompts of bench/spec_decode/train_prompts.jsonl, generated once; the
last tenth of the (shuffled) prompts is held out. Same epochs, batch size and learning rate,
so the same number of optimizer steps. Then each head serves held-out prompts through the
offline LLM (greedy, k = --num-spec-tokens, adaptive off; the held-out tenth, then further
prompts of the file that neither head trained on, --num-serve-prompts in all) and the
engine's counters give the mean accepted length per verify step, 1 + accepted drafts /
verify steps; greedy output is checked against the same prompts without speculation.

    nice -n 10 .venv/bin/python bench/spec_decode/eagle3_vs_eagle.py --out /tmp/eagle3-bench

Prints one JSON object (also written to OUT/report.json): the options, each head's held-out
simulated score (train-draft's), its served mean accepted length, the ratio, the seconds.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import msgspec
import torch

from kvserve import LLM, SamplingParams
from kvserve.services.worker.spec_decode.eagle import save_eagle
from kvserve.shared.launch_options import TrainDraftOptions
from kvserve.training.train_draft import HFTarget, generate_sequences, load_prompts
from kvserve.training.train_eagle import (
    collect_sequences,
    make_eagle,
    score_eagle,
    train_eagle_model,
)
from kvserve.training.train_eagle3 import fit_eagle3

KV_CACHE_MEMORY = 512 << 20


def train_eagle1(target: HFTarget, model_dir: str, split, options: TrainDraftOptions) -> dict:
    """train-draft --method eagle's steps on the given split; its held-out score."""
    start = time.perf_counter()
    train = collect_sequences(target, split[0], "EAGLE-1 train set")
    held_out = collect_sequences(target, split[1], "EAGLE-1 held-out set")
    model = make_eagle(target, base_model=model_dir)
    mark = time.perf_counter()
    train_eagle_model(model, train, target.logits, options)
    train_seconds = time.perf_counter() - mark
    score = score_eagle(model, held_out, target.logits, options.num_spec_tokens)
    save_eagle(model.state_dict(), options.output, base_model=model_dir, config=model.config)
    return {
        "simulated_mean_acceptance_length": score.mean_acceptance_length,
        "simulated_chain": score.chain,
        "seconds_train": round(train_seconds, 1),
        "seconds_total": round(time.perf_counter() - start, 1),
    }


def train_eagle3(target: HFTarget, model_dir: str, split, options: TrainDraftOptions) -> dict:
    start = time.perf_counter()
    run = fit_eagle3(target, model_dir, split, options)
    return {
        "simulated_mean_acceptance_length": run.score.mean_acceptance_length,
        "simulated_chain": run.score.chain,
        "seconds_train": run.seconds["train"],
        "seconds_total": round(time.perf_counter() - start, 1),
    }


def serve(prompts: list[str], max_tokens: int, spec: dict | None) -> tuple[list, dict]:
    """Greedy replies to the prompts and the spec-decode counters."""
    llm = LLM(model=None, dtype="float32", kv_cache_memory=KV_CACHE_MEMORY, speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    totals = llm.stats_totals
    llm.engine_core.shutdown()
    del llm
    gc.collect()
    steps, accepted = totals.spec_num_drafts, totals.spec_num_accepted_tokens
    counters = {
        "verify_steps": steps,
        "draft_tokens": totals.spec_num_draft_tokens,
        "accepted_tokens": accepted,
        "mean_accepted_length": round(1 + accepted / steps, 4) if steps else None,
    }
    return [list(o.outputs[0].token_ids) for o in outs], counters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="/tmp/eagle3-bench")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--num-spec-tokens", type=int, default=3)
    parser.add_argument("--draft-vocab-size", type=int, default=8192)
    parser.add_argument(
        "--num-serve-prompts",
        type=int,
        default=20,
        help="held-out prompts served: the held-out tenth, then prompts not trained on",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (training)")
    args = parser.parse_args()
    start = time.perf_counter()
    eagle1 = TrainDraftOptions(
        output=os.path.join(args.out, "eagle"),
        method="eagle",
        num_prompts=args.num_prompts,
        max_tokens=args.max_tokens,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        num_spec_tokens=args.num_spec_tokens,
        draft_vocab_size=args.draft_vocab_size,
    )
    eagle3 = msgspec.structs.replace(
        eagle1, method="eagle3", output=os.path.join(args.out, "eagle3")
    )
    torch.manual_seed(eagle1.seed)
    torch.set_num_threads(args.threads)
    # The shuffled prompt file: the first num_prompts are train-draft's (a tenth held out);
    # the served prompts start at the held-out ones and go on past them.
    all_prompts = load_prompts(None, 10**9, eagle1.seed)
    prompts = all_prompts[: eagle1.num_prompts]
    num_held_out = max(1, len(prompts) // 10)
    first_served = len(prompts) - num_held_out
    served = all_prompts[first_served : first_served + args.num_serve_prompts]
    model_dir, sequences = generate_sequences(
        None, prompts, eagle1.max_tokens, eagle1.seed, kv_cache_memory=KV_CACHE_MEMORY
    )
    split = (sequences[:-num_held_out], sequences[-num_held_out:])
    target = HFTarget(model_dir)
    report: dict = {"options": vars(args), "num_train_sequences": len(split[0]),
                    "num_held_out_prompts": num_held_out,
                    "optimizer_steps_each": -(-len(split[0]) // args.batch_size) * args.epochs,
                    "seconds_generate": round(time.perf_counter() - start, 1)}  # fmt: skip
    report["eagle"] = train_eagle1(target, model_dir, split, eagle1)
    report["eagle3"] = train_eagle3(target, model_dir, split, eagle3)
    del target
    gc.collect()
    report["num_served_prompts"] = len(served)
    reference, _ = serve(served, args.max_tokens, None)
    for name, options in (("eagle", eagle1), ("eagle3", eagle3)):
        spec = {"method": name, "model": options.output,
                "num_speculative_tokens": args.num_spec_tokens, "adaptive": False}  # fmt: skip
        outputs, counters = serve(served, args.max_tokens, spec)
        report[name].update(counters, greedy_output_unchanged=outputs == reference)
    first, third = (report[n]["mean_accepted_length"] for n in ("eagle", "eagle3"))
    report["ratio_eagle3_over_eagle"] = round(third / first, 4) if first and third else None
    report["seconds"] = round(time.perf_counter() - start, 1)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
