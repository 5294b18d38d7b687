"""One encoder step in-process: where a BERT-base step's time goes, per GEMM plan.

The real model class (services/worker/models/bert.py) on the random-weight BERT-base folder
that bench/encoders.py builds, float32, run as the pooling runner runs it (inference mode,
the step's flattened tokens, one EncoderBatch). For each batch (8 x 256 and 32 x 256 tokens
by default) and each GEMM plan (`torch`: F.linear, what an encoder ran before issue 50;
`plan`: the start-up tuned plan of worker/cpu_tuning.prepare_gemm, the decoder's;
`onednn`: that plan forced to oneDNN's packed path, --cpu-gemm onednn), the
step's parts are timed apart, interleaved plan by plan, median of --repeats:

    embeddings   word + position + token type embeddings and their LayerNorm
    linears      every linear layer of the encoder
    attention    bidirectional_attention (torch SDPA) over the step's requests
    norm/act     the LayerNorms with their residual adds, and the activation
    padding      the pad / unpad copies around SDPA (a share of attention's time)
    pooling      pool_step: mean pooling and normalisation of every request
    forward      the whole forward, timed as one call (the parts should add up to it)

A per-layer part is timed on layer 0's modules at the step's rows, times the layers. Then
the levers tried, per step, each beside what the model runs: one fused QKV GEMM against
three, GELU in place against a new tensor, padding into reused buffers against new zeroed
ones (ragged batches only: equal lengths are not padded), SDPA per request (no padding)
against the padded batch.

Wall seconds (time.perf_counter) and process CPU seconds (time.process_time: every torch
thread). --ragged gives the requests lengths drawn from [len / 2, len] (padding appears).

    nice -n 10 .venv/bin/python bench/encoder_step_profile.py --workdir /tmp/enc
        [--batches 8x256 32x256] [--threads 2] [--repeats 5] [--plans torch plan onednn] [--ragged]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.encoders import build_folders  # noqa: E402
from kvserve.kernels import gemm  # noqa: E402
from kvserve.services.worker.cpu_tuning import prepare_gemm  # noqa: E402
from kvserve.services.worker.layers.attention import AttentionMetadata  # noqa: E402
from kvserve.services.worker.layers.bidirectional import (  # noqa: E402
    EncoderBatch,
    bidirectional_attention,
)
from kvserve.services.worker.models.bert import BertModel  # noqa: E402
from kvserve.services.worker.pooling import pool_step  # noqa: E402
from kvserve.shared.config import EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402

PARTS = ("embeddings", "linears", "attention", "norm/act", "padding", "pooling", "forward")


def load_model(folder: str) -> BertModel:
    from safetensors.torch import load_file
    from transformers import AutoConfig

    model = BertModel(AutoConfig.from_pretrained(folder))
    model.load_weights(load_file(os.path.join(folder, "model.safetensors")).items())
    return model.eval()


def linear_modules(model: torch.nn.Module) -> list[Any]:
    """The encoder's linear layers (each with a weight [N, K] and a `gemm` plan slot)."""
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear) or hasattr(m, "gemm")]


def make_plans(model: BertModel, folder: str, max_tokens: int) -> dict[str, dict]:
    """plan name -> {module: its LinearWeights or None}, applied by `use_plan`: torch (no
    plan), plan (prepare_gemm's measured or cached plan, as a server starts) and onednn
    (--cpu-gemm onednn: every linear on oneDNN's packed path)."""
    layers = linear_modules(model)
    plans = {"torch": {m: None for m in layers}}
    for name, mode in (("plan", "auto"), ("onednn", "onednn")):
        config = EngineConfig(
            model=ModelConfig(model=folder, dtype="float32", cpu_gemm=mode),
            scheduler=SchedulerConfig(max_num_batched_tokens=max_tokens),
        )
        gemm_plan = prepare_gemm(model, config)
        print(f"{name} ({gemm_plan.source}): {gemm_plan.summary()}", flush=True)
        plans[name] = {m: m.gemm for m in layers}
    return plans


def use_plan(plan: dict) -> None:
    for module, weights in plan.items():
        module.gemm = weights


def _median_times(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(wall, CPU) seconds of fn, medians over repeats, after one warm-up call."""
    fn()
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def step_inputs(lens: list[int], vocab: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, vocab, (sum(lens),), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lens])
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    metadata = AttentionMetadata(
        query_start_loc=starts,
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_table=torch.zeros(len(lens), 1, dtype=torch.int32),
        slot_mapping=torch.full((sum(lens),), -1, dtype=torch.int64),
        max_query_len=max(lens),
        max_seq_len=max(lens),
    )
    return input_ids, positions, metadata


def pooling_step(hidden: torch.Tensor, lens: list[int]) -> Any:
    """What pool_step reads of a StepBatch: every request a whole mean-pooled prompt."""
    params = SimpleNamespace(pooling="mean", normalize=True)
    states = [
        SimpleNamespace(
            req_id=f"r{i}", sampling_params=params, num_prompt_tokens=n, pooled_sum=None
        )
        for i, n in enumerate(lens)
    ]
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
    return SimpleNamespace(
        states=states,
        hidden=hidden,
        query_start_loc=starts,
        num_computed=[0] * len(lens),
        num_scheduled=lens,
        sample_idx=list(range(len(lens))),
    )


def part_calls(model: BertModel, lens: list[int]) -> dict[str, tuple[Callable[[], object], int]]:
    """Each part of one step as a call, and how many times a step runs it (a per-layer
    part is timed on layer 0 and counted once per layer)."""
    config = model.config
    num_tokens = sum(lens)
    input_ids, positions, metadata = step_inputs(lens, config.vocab_size)
    types = torch.zeros_like(input_ids)
    layer = model.encoder.layer[0]
    x = torch.randn(num_tokens, config.hidden_size)
    heads, head_dim = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    q, k, v = (torch.randn(num_tokens, heads, head_dim) for _ in range(3))
    inter = torch.randn(num_tokens, config.intermediate_size)
    batch = EncoderBatch(metadata.query_start_loc)
    layer_linears = [(m, torch.randn(num_tokens, m.weight.shape[1])) for m in linear_modules(layer)]
    act = layer.intermediate.act
    norms = (layer.attention.output.LayerNorm, layer.output.LayerNorm)

    def linears() -> None:
        for module, rows in layer_linears:
            module(rows)

    def attention() -> None:
        bidirectional_attention(q, k, v, batch, head_dim**-0.5)

    def norm_act() -> None:
        for norm in norms:
            norm(x + x)
        act(inter)

    def padding() -> None:  # what bidirectional_attention pads and unpads (part of it)
        for rows in (q, k, v):
            batch.pad(rows)
        batch.unpad(batch.pad(q))

    hidden = model(input_ids, positions, metadata, None, types)
    num_layers = config.num_hidden_layers
    return {
        "embeddings": (lambda: model.embeddings(input_ids, positions, types), 1),
        "linears": (linears, num_layers),
        "attention": (attention, num_layers),
        "norm/act": (norm_act, num_layers),
        "padding": (padding, num_layers),
        "pooling": (lambda: pool_step(pooling_step(hidden, lens), model), 1),
        "forward": (lambda: model(input_ids, positions, metadata, None, types), 1),
    }


def _fused_qkv(layer: Any, plan_name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """One [3 * hidden, hidden] GEMM in place of query, key and value (on oneDNN's packed
    path when the layer's query runs it, else torch's)."""
    attn = layer.attention.self
    weight = torch.cat([attn.query.weight, attn.key.weight, attn.value.weight])
    bias = torch.cat([attn.query.bias, attn.key.bias, attn.value.bias])
    if plan_name == "torch" or attn.query.gemm is None:
        return lambda x: F.linear(x, weight, bias)
    prepared = gemm.LinearWeights(attn.query.gemm.plan, gemm.pack_onednn(weight))
    return lambda x: gemm.linear(x, weight, bias, prepared)


def _attention_per_request(q, k, v, lens: list[int], scale: float) -> torch.Tensor:
    """Varlen: SDPA on each request's own rows (no padding, no mask), one call a request."""
    out, start = torch.empty(q.shape[0], q.shape[1] * q.shape[2]), 0
    for n in lens:
        rows = slice(start, start + n)
        qs, ks, vs = (x[rows].transpose(0, 1) for x in (q, k, v))  # [H, n, D]
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
        out[rows] = o.transpose(0, 1).reshape(n, -1)
        start += n
    return out


def _pad_anew(batch: EncoderBatch, rows: torch.Tensor) -> torch.Tensor:
    """EncoderBatch.pad as it was before issue 50: a new zeroed buffer per call."""
    padded = rows.new_zeros(batch.num_reqs * batch.max_len, *rows.shape[1:])
    padded[batch.slots] = rows
    return padded


def lever_calls(model: BertModel, lens: list[int], plan_name: str) -> dict[str, Callable]:
    """The levers tried, per layer, each beside what the model runs today."""
    config, num_tokens = model.config, sum(lens)
    layer = model.encoder.layer[0]
    attn = layer.attention.self
    heads, head_dim = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    x = torch.randn(num_tokens, config.hidden_size)
    q, k, v = (torch.randn(num_tokens, heads, head_dim) for _ in range(3))
    inter = torch.randn(num_tokens, config.intermediate_size)
    scratch = inter.clone()  # gelu_ overwrites it every call (timing only)
    batch = EncoderBatch(torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]))
    fused = _fused_qkv(layer, plan_name)
    return {
        "qkv: 3 GEMMs": lambda: [proj(x) for proj in (attn.query, attn.key, attn.value)],
        "qkv: fused": lambda: fused(x),
        "gelu": lambda: F.gelu(inter),
        "gelu in place": lambda: torch.ops.aten.gelu_(scratch),
        "pad q k v: new zeroed buffers": lambda: [_pad_anew(batch, x) for x in (q, k, v)],
        "pad q k v: reused buffers": lambda: [batch.pad(x, i) for i, x in enumerate((q, k, v))],
        "attention: padded SDPA": lambda: bidirectional_attention(q, k, v, batch, head_dim**-0.5),
        "attention: per request": lambda: _attention_per_request(q, k, v, lens, head_dim**-0.5),
    }


def profile(model: BertModel, plans: dict, lens: list[int], repeats: int) -> dict:
    """plan -> part -> (wall, CPU) seconds, the plans interleaved part by part."""
    calls = part_calls(model, lens)
    results: dict[str, dict[str, tuple[float, float]]] = {name: {} for name in plans}
    for part, (call, count) in calls.items():
        for name, plan in plans.items():
            use_plan(plan)
            wall, cpu = _median_times(call, repeats)
            results[name][part] = (wall * count, cpu * count)
    num_layers = model.config.num_hidden_layers
    levers = {name: lever_calls(model, lens, name) for name in plans}
    for part in levers["torch" if "torch" in plans else next(iter(plans))]:
        for name, plan in plans.items():
            use_plan(plan)
            wall, cpu = _median_times(levers[name][part], repeats)
            results[name][part] = (wall * num_layers, cpu * num_layers)
    return results


def print_table(label: str, results: dict, num_tokens: int) -> None:
    print(f"\n{label}: {num_tokens} tokens a step")
    print("| plan | " + " | ".join(PARTS) + " | sum of parts | tokens/s |")
    print("|---|" + "---|" * (len(PARTS) + 2))
    for name, parts in results.items():
        cells = [f"{parts[p][0] * 1e3:.0f} ms ({parts[p][1] * 1e3:.0f} CPU)" for p in PARTS]
        total = sum(parts[p][0] for p in PARTS if p not in ("forward", "padding"))
        rate = num_tokens / parts["forward"][0]
        print(f"| {name} | " + " | ".join(cells) + f" | {total * 1e3:.0f} ms | {rate:.0f} |")
    levers = [p for p in next(iter(results.values())) if p not in PARTS]
    print(f"\nlevers, {label}, per step (every layer): wall ms (CPU ms)")
    print("| plan | " + " | ".join(levers) + " |")
    print("|---|" + "---|" * len(levers))
    for name, parts in results.items():
        cells = [f"{parts[p][0] * 1e3:.0f} ({parts[p][1] * 1e3:.0f})" for p in levers]
        print(f"| {name} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/kvserve-encoders-bench")
    parser.add_argument("--batches", nargs="+", default=["8x256", "32x256"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--plans", nargs="+", default=["torch", "plan", "onednn"])
    parser.add_argument("--ragged", action="store_true")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.makedirs(args.workdir, exist_ok=True)
    embed_dir, _ = build_folders(args.workdir)
    model = load_model(embed_dir)
    shapes = [tuple(int(v) for v in b.split("x")) for b in args.batches]
    all_plans = make_plans(model, embed_dir, max(n * length for n, length in shapes))
    plans = {name: all_plans[name] for name in args.plans}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32")
    figures = {}
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for num_reqs, length in shapes:
            lens = [length] * num_reqs
            if args.ragged:
                lens = torch.randint(length // 2, length + 1, (num_reqs,), generator=gen).tolist()
            label = f"{num_reqs} x {length}" + (" (ragged)" if args.ragged else "")
            results = profile(model, plans, lens, args.repeats)
            print_table(label, results, sum(lens))
            figures[label] = results
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
