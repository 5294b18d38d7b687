"""The cost of batched LoRA: decode time per step against the base model, at batch 1 and 8.

Random rank-R adapters on all seven linears of the model (written as PEFT folders: an
adapter_config.json and safetensors, no training). For each batch size, greedy decoding of
`--max-tokens` tokens from short prompts, best of `--repeats`:

    base          LLM without --enable-lora
    lora-off      --enable-lora, every request on the base model (the wrappers' fixed cost)
    one-adapter   every request on the same adapter
    mixed         requests spread over `--max-loras` adapters and the base model

    .venv/bin/python bench/lora.py [--model DIR] [--max-tokens 32] [--rank 16] [--save-result F]

The machine is shared and noisy: compare the columns of one run, not runs of different days.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import msgspec
import numpy as np

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_random_adapter(model_dir: str, out_dir: str, rank: int, seed: int) -> str:
    """A PEFT folder with random A and B for every target linear of every layer."""
    from safetensors.numpy import save_file

    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_size = config["num_attention_heads"] * head_dim
    kv_size = config.get("num_key_value_heads", config["num_attention_heads"]) * head_dim
    shapes = {  # (in, out) of each HF linear
        "self_attn.q_proj": (hidden, q_size),
        "self_attn.k_proj": (hidden, kv_size),
        "self_attn.v_proj": (hidden, kv_size),
        "self_attn.o_proj": (q_size, hidden),
        "mlp.gate_proj": (hidden, inter),
        "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name, (fan_in, fan_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, 0.02, (rank, fan_in)).astype("f4")
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, 0.02, (fan_out, rank)).astype("f4")
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": TARGETS,
        "base_model_name_or_path": model_dir,
    }
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(adapter_config, f)
    return out_dir


def time_decode(llm, prompts, params, loras, repeats: int) -> float:
    """Best seconds per decode step over `repeats` runs (prefill excluded by subtracting a
    one-token run)."""

    def best(max_tokens: int) -> float:
        p = msgspec.structs.replace(params, max_tokens=max_tokens)
        times = []
        for _ in range(repeats):
            llm.reset_prefix_cache()
            start = time.perf_counter()
            llm.generate(prompts, p, use_tqdm=False, lora_request=loras)
            times.append(time.perf_counter() - start)
        return min(times)

    full, prefill = best(params.max_tokens), best(1)
    return (full - prefill) / (params.max_tokens - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF folder (default: the embedded model)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-loras", type=int, default=2)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--save-result", default=None, help="write the table as JSON here")
    args = parser.parse_args()

    from kvserve import LLM, LoRARequest, SamplingParams
    from kvserve.services.worker.model_loader import resolve_model

    model_dir = resolve_model(args.model)
    tmp = tempfile.mkdtemp(prefix="kvserve-lora-bench-")
    adapters = [
        LoRARequest(f"a{i}", i + 1, write_random_adapter(model_dir, f"{tmp}/a{i}", args.rank, i))
        for i in range(args.max_loras)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    common = dict(dtype=args.dtype, max_num_seqs=16)
    engines = {
        "base": LLM(model_dir, **common),
        "lora": LLM(
            model_dir,
            enable_lora=True,
            max_loras=args.max_loras,
            max_lora_rank=args.rank,
            **common,
        ),
    }
    results = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        prompts = [f"Question {i}: tell me about the number {i}." for i in range(batch)]
        mixed = [([*adapters, None])[i % (len(adapters) + 1)] for i in range(batch)]
        cases = {
            "base": (engines["base"], None),
            "lora-off": (engines["lora"], None),
            "one-adapter": (engines["lora"], adapters[0]),
            "mixed": (engines["lora"], mixed),
        }
        row = {"batch": batch}
        for name, (llm, loras) in cases.items():
            row[name] = 1e3 * time_decode(llm, prompts, params, loras, args.repeats)
        results.append(row)
        print(
            f"batch {batch}: "
            + ", ".join(
                f"{k} {v:.2f} ms/step ({v / row['base']:.2f}x)"
                for k, v in row.items()
                if k != "batch"
            ),
            flush=True,
        )
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump({"rank": args.rank, "model": model_dir, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
