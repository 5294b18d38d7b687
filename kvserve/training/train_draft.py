"""`kvserve train-draft`: Medusa heads trained by self-distillation on one machine (an EAGLE-1
head with `--method eagle`: train_eagle.py, on the same data).

1. kvserve's own engine generates greedy continuations of the prompts (float32).
2. One no-grad HF transformers forward per sequence gives the final hidden states (after the
   final norm: what the LM head reads).
3. Head i at position t learns the model's own token at t + 2 + i (cross-entropy to the
   greedy generations): the LM head gives t + 1, head 0 the one after it, and so on.

    tokens   p p p p g g g g g g        (p: prompt, g: generated; T tokens, P of prompt)
    t              ^                    positions P - 1 .. T - 2: the next token is generated
    labels         t+1 (LM head)  t+2 (head 0)  t+3 (head 1) ...   (-100 past the end)

The last tenth of the (shuffled) prompts is held out: each head's top-1 accuracy and the
greedy chain acceptance (head j counts only if heads 0 .. j - 1 were right) are measured on
generations not trained on.
"""

from __future__ import annotations

import gc
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from kvserve.services.worker.spec_decode.medusa import MedusaConfig, MedusaHeads, save_medusa
from kvserve.shared.launch_options import TrainDraftOptions

IGNORE_ID = -100
_DEFAULT_PROMPTS = os.path.join(
    os.path.dirname(__file__), "..", "..", "bench", "spec_decode", "train_prompts.jsonl"
)


@dataclass
class DraftData:
    """Training or scoring positions.

    Args:
        hidden_states: [N, H] float32, the target's final hidden state at each position.
        future_ids: [N, K] int64, the model's own token 2 + i places ahead (IGNORE_ID past
            the sequence's end).
    """

    hidden_states: torch.Tensor
    future_ids: torch.Tensor

    @property
    def num_positions(self) -> int:
        return self.hidden_states.shape[0]


@dataclass(frozen=True)
class DraftScore:
    """Greedy drafting quality on held-out positions.

    Args:
        top1: per head, the share of positions where its argmax is the model's token.
        chain: per depth i, the share where heads 0..i were all right (accepted drafts).
        mean_acceptance_length: tokens per verification step, 1 + sum(chain).
        num_positions: positions where all K future tokens exist (the chain's denominator).
    """

    top1: list[float]
    chain: list[float]
    mean_acceptance_length: float
    num_positions: int


@dataclass
class DraftRun:
    """What `train_draft` made: the heads, the held-out data, and the scores on it."""

    heads: MedusaHeads
    held_out: DraftData
    target_logits: Callable[[torch.Tensor], torch.Tensor]
    score: DraftScore
    untrained_score: DraftScore


# ---------------------------------------------------------------------- data


def load_prompts(path: str | None, num_prompts: int, seed: int) -> list[str]:
    """`num_prompts` prompts of a {"prompt": ...} jsonl, shuffled with `seed`."""
    path = path or os.path.normpath(_DEFAULT_PROMPTS)
    if not os.path.isfile(path):
        raise ValueError(f"--prompts: no such file {path}")
    with open(path) as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    if len(prompts) < 2:
        raise ValueError(f"--prompts {path}: {len(prompts)} prompts; at least 2 are needed")
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(prompts), generator=generator).tolist()
    return [prompts[i] for i in order[:num_prompts]]


# What the heads learn from: (model folder, per sequence (prompt + greedy continuation ids,
# prompt length)).
Corpus = tuple[str, list[tuple[list[int], int]]]


def generate_corpus(options: TrainDraftOptions, **engine_kwargs) -> Corpus:
    """The target's greedy continuations of the options' prompts (model, prompts,
    num_prompts, max_tokens, seed): what train_draft and train_eagle learn from. One corpus
    can train both methods (the suite trains its Medusa heads and EAGLE head on one).

    Args:
        engine_kwargs: further `LLM` arguments for the generation engine.
    """
    prompts = load_prompts(options.prompts, options.num_prompts, options.seed)
    return generate_sequences(
        options.model, prompts, options.max_tokens, options.seed, **engine_kwargs
    )


def generate_sequences(
    model: str | None, prompts: list[str], max_tokens: int, seed: int, **engine_kwargs
) -> Corpus:
    """(model folder, per prompt (prompt + greedy continuation ids, prompt length)): the
    prompts go through the chat template when the tokenizer has one.

    Args:
        engine_kwargs: further `LLM` arguments (kv_cache_memory, ...).
    """
    from kvserve import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", seed=seed, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    if getattr(llm.get_tokenizer(), "chat_template", None):
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    sequences = [
        (list(out.prompt_token_ids) + list(out.outputs[0].token_ids), len(out.prompt_token_ids))
        for out in outputs
    ]
    model_dir = llm.model_dir
    llm.engine_core.shutdown()
    del llm
    gc.collect()
    return model_dir, sequences


class HFTarget:
    """The target in HF transformers (float32, frozen): final hidden states and the LM head.

    Args:
        model_dir: the HF-style folder kvserve serves (a GGUF is converted to one).
    """

    def __init__(self, model_dir: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.model.requires_grad_(False)
        self.lm_head = self.model.get_output_embeddings()
        self.softcap = getattr(self.model.config, "final_logit_softcapping", None)

    @torch.no_grad()
    def final_hidden_states(self, token_ids: list[int]) -> torch.Tensor:
        """[T, H]: the decoder's output after the final norm (the LM head's input)."""
        ids = torch.tensor([token_ids], dtype=torch.int64)
        return self.model.base_model(input_ids=ids).last_hidden_state[0]

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """What the target's compute_logits does: the LM head, then the soft cap if any."""
        logits = self.lm_head(hidden_states)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def collect_positions(
    target: HFTarget, sequences: list[tuple[list[int], int]], num_heads: int, desc: str
) -> DraftData:
    """The positions P - 1 .. T - 2 of every sequence, with the K tokens they should draft."""
    hidden_rows, future_rows = [], []
    for token_ids, prompt_len in tqdm(sequences, desc=desc, dynamic_ncols=True):
        num_tokens = len(token_ids)
        if num_tokens - prompt_len < 2:
            continue  # no generated token after the LM head's one
        hidden = target.final_hidden_states(token_ids)
        # Padded so that index t + 2 + i is IGNORE_ID past the end.
        padded = torch.full((num_tokens + num_heads + 2,), IGNORE_ID, dtype=torch.int64)
        padded[:num_tokens] = torch.tensor(token_ids)
        positions = torch.arange(prompt_len - 1, num_tokens - 1)
        offsets = 2 + torch.arange(num_heads)
        hidden_rows.append(hidden[positions])
        future_rows.append(padded[positions[:, None] + offsets[None, :]])
    if not hidden_rows:
        raise ValueError("no generation was longer than one token: raise --max-tokens")
    return DraftData(torch.cat(hidden_rows), torch.cat(future_rows))


# ---------------------------------------------------------------------- training and scoring


def make_heads(options: TrainDraftOptions, target: HFTarget) -> MedusaHeads:
    """Zero residual blocks, so each head starts as the LM head; own lm heads start as copies
    of the target's."""
    weight = target.lm_head.weight
    config = MedusaConfig(
        hidden_size=weight.shape[1],
        vocab_size=weight.shape[0],
        num_heads=options.num_heads,
        num_layers=options.num_layers,
        lm_head="target" if options.share_lm_head else "per_head",
    )
    heads = MedusaHeads(config)
    with torch.no_grad():
        for lm in heads.lm_heads:
            lm.get_parameter("weight").copy_(weight)
    return heads


def train_heads(
    heads: MedusaHeads,
    data: DraftData,
    target_logits: Callable[[torch.Tensor], torch.Tensor],
    options: TrainDraftOptions,
) -> None:
    """AdamW on cross-entropy to the model's own future tokens, cosine-decayed learning rate."""
    generator = torch.Generator().manual_seed(options.seed)
    num_batches = math.ceil(data.num_positions / options.train_batch_size)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=options.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=num_batches * options.train_epochs
    )
    heads.train()
    bar = tqdm(total=num_batches * options.train_epochs, desc="Training heads", dynamic_ncols=True)
    for _ in range(options.train_epochs):
        order = torch.randperm(data.num_positions, generator=generator)
        for batch in order.split(options.train_batch_size):
            head_states = heads(data.hidden_states[batch])
            logits = heads.compute_logits(head_states, target_logits)
            loss = F.cross_entropy(
                logits.flatten(0, 1), data.future_ids[batch].flatten(), ignore_index=IGNORE_ID
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
    bar.close()
    heads.eval()


@torch.no_grad()
def score_heads(
    heads: MedusaHeads,
    data: DraftData,
    target_logits: Callable[[torch.Tensor], torch.Tensor],
    batch_size: int = 256,
) -> DraftScore:
    """Top-1 accuracy per head and greedy chain acceptance on `data`."""
    predictions = torch.cat(
        [
            heads.compute_logits(heads(rows), target_logits).argmax(dim=-1)
            for rows in data.hidden_states.split(batch_size)
        ]
    )
    valid = data.future_ids != IGNORE_ID
    correct = (predictions == data.future_ids) & valid
    top1 = correct.sum(0) / valid.sum(0).clamp(min=1)
    # A draft is accepted only while every earlier one was: the running product of hits.
    complete = valid.all(dim=1)
    chain = correct[complete].int().cumprod(dim=1).float().mean(0)
    if not complete.any():
        chain = torch.zeros(heads.config.num_heads)
    return DraftScore(
        top1=[round(v, 4) for v in top1.tolist()],
        chain=[round(v, 4) for v in chain.tolist()],
        mean_acceptance_length=round(1.0 + chain.sum().item(), 4),
        num_positions=int(complete.sum()),
    )


def train_draft(
    options: TrainDraftOptions, corpus: Corpus | None = None, **engine_kwargs
) -> DraftRun:
    """Generate, collect hidden states, train, score; write the heads to options.output.

    Args:
        corpus: generate_corpus(options)'s, made already (None: generated here).
        engine_kwargs: further `LLM` arguments for the generation engine.
    """
    if corpus is None:
        corpus = generate_corpus(options, **engine_kwargs)
    model_dir, sequences = corpus
    # Seeded after the generation, so a corpus made elsewhere trains the same heads.
    torch.manual_seed(options.seed)
    num_held_out = max(1, len(sequences) // 10)
    target = HFTarget(model_dir)
    train = collect_positions(target, sequences[:-num_held_out], options.num_heads, "Train set")
    held_out = collect_positions(
        target, sequences[-num_held_out:], options.num_heads, "Held-out set"
    )
    heads = make_heads(options, target)
    untrained_score = score_heads(heads, held_out, target.logits)
    train_heads(heads, train, target.logits, options)
    score = score_heads(heads, held_out, target.logits)
    save_medusa(heads, options.output, base_model=model_dir)
    return DraftRun(heads, held_out, target.logits, score, untrained_score)


def run_train_draft(options: TrainDraftOptions) -> int:
    """The command for Medusa heads: train, write, print the held-out scores (EAGLE:
    train_eagle.run_train_eagle)."""
    start = time.perf_counter()
    run = train_draft(options)
    elapsed = time.perf_counter() - start
    report = {
        "options": {k: getattr(options, k) for k in options.__struct_fields__},
        "held_out": asdict(run.score),
        "held_out_untrained": asdict(run.untrained_score),
        "seconds": round(elapsed, 1),
    }
    with open(os.path.join(options.output, "train_report.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {options.num_heads} Medusa heads to {options.output} in {elapsed:.0f} s")
    print(f"held-out positions (all {options.num_heads} futures known): {run.score.num_positions}")
    for i, (top1, chain) in enumerate(zip(run.score.top1, run.score.chain)):
        print(f"  head {i} (token t+{i + 2}): top-1 {top1:.3f}, chain accepted {chain:.3f}")
    print(
        f"expected mean acceptance length (greedy chain, 1 + accepted drafts): "
        f"{run.score.mean_acceptance_length:.3f} (untrained heads: "
        f"{run.untrained_score.mean_acceptance_length:.3f})"
    )
    return 0
