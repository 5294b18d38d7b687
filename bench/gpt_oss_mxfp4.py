"""gpt-oss MXFP4 experts held as stored against their float expansion: weight memory and
batch-1 decode step time, on a tiny-but-wide random gpt-oss whose expert weights dominate.

The checkpoint is written in the published layout (experts as `*_blocks` + `*_scales`,
config.json `quantization_config.quant_method: mxfp4`), with random bytes for the blocks and
exponents near 2^-7, random float tensors elsewhere. Variants, each loaded by the shipped
`load_model` in float32 and in bfloat16:

- `none`: `quantization="none"`, the experts expanded to float at load (the reference);
- `mxfp4`: the experts held as stored (the default for this checkpoint), int8 activations
  in the C kernel;
- `mxfp4/f32`: the same blocks with KVSERVE_QUANT_ACTIVATIONS=float32 (weight tiles
  expanded to float32 in the kernel).

Per variant: weight MiB (parameters and held blocks, each storage counted once:
`quantization.weight_bytes`), and the batch-1 decode step (one token through the model's
forward and LM head over a paged KV cache holding a PROMPT_LEN-token context), median over
ROUNDS rounds of STEPS steps, the variants interleaved round by round so drift on a shared
machine hits each alike; wall time and the process's CPU time (with --threads 1, the compute
a step costs whatever else waits for the cores).

    .venv/bin/python bench/gpt_oss_mxfp4.py [--hidden 1024] [--experts 16] [--layers 4]
        [--rounds 5] [--steps 16] [--threads N] [--save-result FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

PROMPT_LEN = 64
BLOCK_SIZE = 16


def write_checkpoint(model_dir: str, hidden: int, experts: int, layers: int, vocab: int) -> None:
    """A random gpt-oss in the published layout: MXFP4 experts, float everything else."""
    from safetensors.torch import save_file
    from transformers import GptOssConfig

    head_dim, num_heads, num_kv_heads = 64, hidden // 64, max(1, hidden // 256)
    config = GptOssConfig(
        hidden_size=hidden,
        intermediate_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        num_local_experts=experts,
        num_experts_per_tok=4,
        vocab_size=vocab,
        sliding_window=128,
        max_position_embeddings=4096,
    )
    config.architectures = ["GptOssForCausalLM"]
    config.save_pretrained(model_dir)
    with open(os.path.join(model_dir, "config.json")) as f:
        raw = json.load(f)
    raw["quantization_config"] = {"quant_method": "mxfp4"}
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)

    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    def mxfp4(rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = torch.randint(
            0, 256, (experts, rows, k // 32, 16), dtype=torch.uint8, generator=gen
        )
        scales = torch.randint(118, 123, (experts, rows, k // 32), dtype=torch.uint8, generator=gen)
        return blocks, scales

    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    tensors = {
        "model.embed_tokens.weight": randn(vocab, hidden),
        "lm_head.weight": randn(vocab, hidden),
        "model.norm.weight": torch.ones(hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": randn(q_size, hidden),
            p + "self_attn.q_proj.bias": randn(q_size),
            p + "self_attn.k_proj.weight": randn(kv_size, hidden),
            p + "self_attn.k_proj.bias": randn(kv_size),
            p + "self_attn.v_proj.weight": randn(kv_size, hidden),
            p + "self_attn.v_proj.bias": randn(kv_size),
            p + "self_attn.o_proj.weight": randn(hidden, q_size),
            p + "self_attn.o_proj.bias": randn(hidden),
            p + "self_attn.sinks": randn(num_heads),
            p + "mlp.router.weight": randn(experts, hidden),
            p + "mlp.router.bias": randn(experts),
            p + "mlp.experts.gate_up_proj_bias": randn(experts, 2 * hidden),
            p + "mlp.experts.down_proj_bias": randn(experts, hidden),
        }
        e = p + "mlp.experts."
        tensors[e + "gate_up_proj_blocks"], tensors[e + "gate_up_proj_scales"] = mxfp4(
            2 * hidden, hidden
        )
        tensors[e + "down_proj_blocks"], tensors[e + "down_proj_scales"] = mxfp4(hidden, hidden)
    save_file(tensors, os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})


class DecodeBench:
    """One loaded variant with its KV cache holding a PROMPT_LEN-token context."""

    def __init__(self, model_dir: str, dtype: torch.dtype, quantization: str | None, steps: int):
        from kvserve.services.worker.layers.attention import Attention
        from kvserve.services.worker.models import load_model
        from kvserve.services.worker.quantization import weight_bytes

        self.model, self.config = load_model(model_dir, dtype, "cpu", quantization)
        self.weight_mib = weight_bytes(self.model) / 2**20
        num_blocks = (PROMPT_LEN + steps) // BLOCK_SIZE + 2
        for module in self.model.modules():
            if isinstance(module, Attention):
                module.kv_cache = torch.zeros(
                    2, num_blocks, BLOCK_SIZE, module.num_kv_heads, module.head_size, dtype=dtype
                )
        self.block_ids = list(range(1, num_blocks))
        prompt = torch.randint(
            0, self.config.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)
        )
        self._step(prompt.tolist(), 0)

    @torch.no_grad()
    def _step(self, token_ids: list[int], start: int) -> torch.Tensor:
        from kvserve.services.worker.layers.attention import AttentionMetadata

        n = len(token_ids)
        positions = torch.arange(start, start + n)
        blocks = torch.tensor(self.block_ids, dtype=torch.int64)
        slots = blocks[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([start + n], dtype=torch.int32),
            block_table=torch.tensor([self.block_ids], dtype=torch.int32),
            slot_mapping=slots,
            max_query_len=n,
            max_seq_len=start + n,
        )
        hidden = self.model(torch.tensor(token_ids), positions, metadata)
        return self.model.compute_logits(hidden[-1:])

    def time_steps(self, steps: int) -> tuple[float, float]:
        """(wall ms, process CPU ms) per step, mean of `steps` batch-1 decode steps after
        the prompt."""
        token = 0
        start, start_cpu = time.perf_counter(), time.process_time()
        for i in range(steps):
            token = int(self._step([token], PROMPT_LEN + i).argmax())
        wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
        return 1e3 * wall / steps, 1e3 * cpu / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--save-result", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = [
        (dtype_name, quant)
        for dtype_name in ("float32", "bfloat16")
        for quant in ("none", "mxfp4", "mxfp4/f32")
    ]
    with tempfile.TemporaryDirectory() as model_dir:
        write_checkpoint(model_dir, args.hidden, args.experts, args.layers, args.vocab)
        benches = {}
        for dtype_name, quant in variants:
            dtype = getattr(torch, dtype_name)
            quantization = "none" if quant == "none" else "mxfp4"
            benches[(dtype_name, quant)] = DecodeBench(model_dir, dtype, quantization, args.steps)
    times: dict[tuple[str, str], list[tuple[float, float]]] = {v: [] for v in variants}
    for _ in range(args.rounds + 1):  # the first round warms up
        for variant in variants:
            os.environ["KVSERVE_QUANT_ACTIVATIONS"] = (
                "float32" if variant[1].endswith("/f32") else "int8"
            )
            times[variant].append(benches[variant].time_steps(args.steps))
    os.environ.pop("KVSERVE_QUANT_ACTIVATIONS", None)
    print(
        f"hidden {args.hidden}, intermediate {args.hidden}, {args.experts} experts (top 4), "
        f"{args.layers} layers, vocab {args.vocab}; {torch.get_num_threads()} threads, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(
        "| activations | experts | weight MiB | vs expansion | batch-1 decode step ms "
        "| speed-up | CPU ms per step | CPU speed-up |"
    )
    print("|---|---|---|---|---|---|---|---|")
    results = []
    for dtype_name, quant in variants:
        bench = benches[(dtype_name, quant)]
        ref = benches[(dtype_name, "none")]
        ms = statistics.median(t[0] for t in times[(dtype_name, quant)][1:])
        ref_ms = statistics.median(t[0] for t in times[(dtype_name, "none")][1:])
        cpu_ms = statistics.median(t[1] for t in times[(dtype_name, quant)][1:])
        ref_cpu_ms = statistics.median(t[1] for t in times[(dtype_name, "none")][1:])
        label = {
            "none": "float expansion",
            "mxfp4": "MXFP4 held",
            "mxfp4/f32": "MXFP4 held, f32 act.",
        }[quant]
        print(
            f"| {dtype_name} | {label} | {bench.weight_mib:.1f} "
            f"| {bench.weight_mib / ref.weight_mib:.2f} | {ms:.2f} | {ref_ms / ms:.2f}x "
            f"| {cpu_ms:.2f} | {ref_cpu_ms / cpu_ms:.2f}x |"
        )
        results.append(
            dict(
                dtype=dtype_name,
                variant=quant,
                weight_mib=bench.weight_mib,
                step_ms=ms,
                step_cpu_ms=cpu_ms,
            )
        )
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(dict(args=vars(args), results=results), f, indent=2)


if __name__ == "__main__":
    main()
