"""`kvserve train-draft --method eagle`: an EAGLE-1 head trained by self-distillation.

The data are train_draft's: kvserve's greedy generations and HF's final hidden states f (after
the final norm). Each sequence of T tokens gives T - 1 pairs, trained at once with full causal
attention (the convention of eagle.py):

    pair p:   (f_p, x_{p+1}) at RoPE position p,   p = 0 .. T - 2
    targets:  f_{p+1} (smooth L1)  and  the target's next-token distribution at p + 1,
              softmax(LM(f_{p+1})) (soft cross-entropy through the frozen LM head, weight w)

fc and the layer start at torch's default init (starting from the target's last layer, or
fc as [0 | I], measured no better). Half the input features are the draft's own no-grad
guesses of them (`OWN_FEATURE_RATE`), as every chain step after the first reads those.
`EagleTrainModel` is plain torch under the published names; its state_dict is what
`save_eagle` writes and `load_eagle` reads into our EagleHead.

Scoring simulates the real chain on held-out sequences: from each position p whose next
token is generated, d1 comes from the true pairs 0..p; then (h_p, d1) at p + 1 gives d2, the
draft's own h feeding every later step. A draft is accepted while it and all earlier ones
equal the model's own greedy tokens; the mean acceptance length is 1 + accepted per step.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from kvserve.services.worker.layers.rotary_embedding import (
    RotaryEmbedding,
    rope_parameters_from_config,
)
from kvserve.services.worker.spec_decode.eagle import EagleConfig, save_eagle
from kvserve.shared.launch_options import TrainDraftOptions
from kvserve.training.train_draft import Corpus, DraftScore, HFTarget, generate_corpus

# The classification loss's weight beside the feature regression (EAGLE-1 used 0.1; 1.0
# measured better acceptance on SmolLM2 with our few thousand sequences).
CLS_WEIGHT = 1.0
# The share of training inputs that are the draft's own feature guesses (see eagle_loss).
OWN_FEATURE_RATE = 0.5


@dataclass
class EagleSequence:
    """One sequence: token_ids [T] int64, features [T, H] float32 (f), prompt_len."""

    token_ids: torch.Tensor
    features: torch.Tensor
    prompt_len: int


# ---------------------------------------------------------------------- the module


class _RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * (
            self.weight
        )


class _SelfAttention(nn.Module):
    def __init__(self, config: EagleConfig):
        super().__init__()
        hidden, head_dim = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = head_dim
        self.q_proj = nn.Linear(hidden, self.num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * head_dim, hidden, bias=False)


class _MLP(nn.Module):
    def __init__(self, config: EagleConfig):
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _DecoderLayer(nn.Module):
    def __init__(self, config: EagleConfig):
        super().__init__()
        self.self_attn = _SelfAttention(config)
        self.mlp = _MLP(config)
        self.post_attention_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps)


class EagleTrainModel(nn.Module):
    """EAGLE-1's draft in plain torch, its parameters under the published names.

    Args:
        config: the head's shape (hidden_act must be silu).
        embed_weight: [V, H] the target's embedding (a buffer: neither trained nor saved).
    """

    def __init__(self, config: EagleConfig, embed_weight: torch.Tensor):
        super().__init__()
        assert config.hidden_act == "silu", "train-draft builds silu MLPs"
        self.config = config
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=config.fc_bias)
        self.layers = nn.ModuleList([_DecoderLayer(config)])
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        # The same cos/sin table as our RotaryEmbedding: cos | sin halves per position.
        rope = config.rope_parameters
        table = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, rope["rope_theta"], rope
        ).cos_sin_cache
        self.register_buffer("cos_sin", table, persistent=False)

    embed_weight: torch.Tensor  # buffers, registered above
    cos_sin: torch.Tensor

    @property
    def _layer(self) -> _DecoderLayer:
        """The one decoder layer (in a ModuleList for its published parameter names)."""
        return cast(_DecoderLayer, self.layers[0])

    def pair_inputs(self, next_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """z = fc([embed(x_{p+1}) | f_p]), [..., H]."""
        return self.fc(torch.cat([F.embedding(next_ids, self.embed_weight), features], dim=-1))

    def qkv(self, z: torch.Tensor, positions: torch.Tensor):
        """z [..., N, H], positions [..., N] (or [N]) -> q [..., Hq, N, D], k and v
        [..., Hkv, N, D]."""
        attn = self._layer.self_attn

        def heads(x: torch.Tensor, num: int) -> torch.Tensor:
            return x.unflatten(-1, (num, attn.head_dim)).transpose(-2, -3)

        q = heads(attn.q_proj(z), attn.num_heads)
        k = heads(attn.k_proj(z), attn.num_kv_heads)
        v = heads(attn.v_proj(z), attn.num_kv_heads)
        cos, sin = self.cos_sin[positions].unsqueeze(-3).chunk(2, dim=-1)  # [..., 1, N, D/2]
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def attend(self, q, k, v, mask=None, causal: bool = False) -> torch.Tensor:
        """Attention of q over k/v (KV heads repeated for GQA); [..., N, Hq * D]."""
        attn = self._layer.self_attn
        repeat = attn.num_heads // attn.num_kv_heads
        k, v = k.repeat_interleave(repeat, dim=-3), v.repeat_interleave(repeat, dim=-3)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=attn.head_dim**-0.5
        )
        return out.transpose(-2, -3).flatten(-2)

    def finish(self, z: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """h = r + mlp(norm(r)), r = z + o(attn): the layer's output sum."""
        layer = self._layer
        residual = z + layer.self_attn.o_proj(attn_out)
        return residual + layer.mlp(layer.post_attention_layernorm(residual))

    def forward(self, next_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """next_ids [B, P] (x_{p+1}), features [B, P, H] (f_p) at positions 0..P-1, causal.
        Returns h [B, P, H]."""
        z = self.pair_inputs(next_ids, features)
        positions = torch.arange(z.shape[-2], device=z.device)
        q, k, v = self.qkv(z, positions)
        return self.finish(z, self.attend(q, k, v, causal=True))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Neox rotate-half over the whole head, as kernels/rotary.py.
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def eagle_config_of(hf_config, base_model: str | None = None) -> EagleConfig:
    """An EAGLE-1 head with the target's layer shape."""
    return EagleConfig(
        hidden_size=hf_config.hidden_size,
        vocab_size=hf_config.vocab_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_key_value_heads=getattr(hf_config, "num_key_value_heads", None)
        or hf_config.num_attention_heads,
        head_dim=getattr(hf_config, "head_dim", None)
        or hf_config.hidden_size // hf_config.num_attention_heads,
        intermediate_size=hf_config.intermediate_size,
        rms_norm_eps=hf_config.rms_norm_eps,
        rope_parameters=rope_parameters_from_config(hf_config),
        max_position_embeddings=hf_config.max_position_embeddings,
        hidden_act="silu",
        fc_bias=True,
        base_model=base_model,
    )


def make_eagle(
    target: HFTarget,
    base_model: str | None = None,
    from_last_layer: bool = False,
    pass_through_fc: bool = False,
) -> EagleTrainModel:
    """A fresh head for the target.

    Args:
        from_last_layer: start the layer as the target's last decoder layer (its input norm
            dropped) rather than torch's default init; it measured worse on SmolLM2 (the
            last layer expects a normed residual stream, not f).
        pass_through_fc: fc = [0 | I], so z_p = f_p at first (rather than torch's init;
            no better after one epoch on SmolLM2: 1.265 against 1.279).
    """
    hf_model = target.model
    config = eagle_config_of(hf_model.config, base_model)
    model = EagleTrainModel(config, hf_model.get_input_embeddings().weight)
    with torch.no_grad():
        if from_last_layer:
            last_layer = hf_model.base_model.layers[-1].state_dict()
            for name, tensor in model.layers[0].state_dict().items():
                if name in last_layer and last_layer[name].shape == tensor.shape:
                    tensor.copy_(last_layer[name])
        if pass_through_fc:
            hidden = config.hidden_size
            model.fc.weight.zero_()
            model.fc.weight[:, hidden:].copy_(torch.eye(hidden))
            if model.fc.bias is not None:
                model.fc.bias.zero_()
    return model


# ---------------------------------------------------------------------- data and training


def collect_sequences(
    target: HFTarget, sequences: list[tuple[list[int], int]], desc: str
) -> list[EagleSequence]:
    out = []
    for token_ids, prompt_len in tqdm(sequences, desc=desc, dynamic_ncols=True):
        if len(token_ids) < 3:
            continue
        features = target.final_hidden_states(token_ids)
        out.append(EagleSequence(torch.tensor(token_ids), features, prompt_len))
    if not out:
        raise ValueError("no sequence was longer than two tokens: raise --max-tokens")
    return out


def _pad_batch(batch: list[EagleSequence]):
    """(next_ids [B, P], features [B, P, H], target features [B, P, H], valid [B, P])."""
    num_pairs = max(len(s.token_ids) for s in batch) - 1
    hidden = batch[0].features.shape[1]
    next_ids = torch.zeros(len(batch), num_pairs, dtype=torch.int64)
    features = torch.zeros(len(batch), num_pairs + 1, hidden)
    valid = torch.zeros(len(batch), num_pairs, dtype=torch.bool)
    for i, seq in enumerate(batch):
        n = len(seq.token_ids) - 1
        next_ids[i, :n] = seq.token_ids[1:]
        features[i, : n + 1] = seq.features
        valid[i, :n] = True
    return next_ids, features[:, :-1], features[:, 1:], valid


def eagle_loss(
    model: EagleTrainModel,
    batch: list[EagleSequence],
    target_logits: Callable[[torch.Tensor], torch.Tensor],
    cls_weight: float | None = None,
    own_feature_rate: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, float, float]:
    """(loss, regression part, classification part) of a batch of sequences.

    Args:
        own_feature_rate: the share of input features f_p (p >= 1) replaced by the draft's
            own no-grad guess of them, h_{p-1}: at inference every step after the first
            reads the draft's h, so the layer learns to read its own errors.
    """
    next_ids, features, target_features, valid = _pad_batch(batch)
    if own_feature_rate > 0:
        with torch.no_grad():
            guesses = model(next_ids, features)[:, :-1]  # h_{p-1}: the guess of f_p
        swap = torch.rand(guesses.shape[:2], generator=generator) < own_feature_rate
        features = features.clone()
        features[:, 1:][swap] = guesses[swap]
    h = model(next_ids, features)[valid]
    target_features = target_features[valid]
    reg = F.smooth_l1_loss(h, target_features)
    with torch.no_grad():
        target_p = torch.softmax(target_logits(target_features).float(), dim=-1)
    logp = torch.log_softmax(target_logits(h).float(), dim=-1)
    cls = -(target_p * logp).sum(-1).mean()
    weight = CLS_WEIGHT if cls_weight is None else cls_weight
    return reg + weight * cls, reg.item(), cls.item()


def train_eagle_model(
    model: EagleTrainModel,
    data: list[EagleSequence],
    target_logits: Callable[[torch.Tensor], torch.Tensor],
    options: TrainDraftOptions,
) -> None:
    """AdamW over batches of whole sequences, cosine-decayed learning rate."""

    def batch_loss(batch: list, generator: torch.Generator) -> tuple[torch.Tensor, dict]:
        loss, reg, cls = eagle_loss(
            model, batch, target_logits, own_feature_rate=OWN_FEATURE_RATE, generator=generator
        )
        return loss, {"reg": f"{reg:.3f}", "cls": f"{cls:.3f}"}

    train_head(model, data, options, batch_loss, "Training EAGLE")


def train_head(
    model: torch.nn.Module,
    data: list,
    options: TrainDraftOptions,
    batch_loss: Callable[[list, torch.Generator], tuple[torch.Tensor, dict]],
    desc: str,
) -> None:
    """The draft heads' training loop (EAGLE-1's and EAGLE-3's): AdamW over shuffled batches
    of whole sequences, a cosine-decayed learning rate, gradients clipped at 0.5;
    `batch_loss(batch, generator)` gives the loss and what the progress bar shows."""
    generator = torch.Generator().manual_seed(options.seed)
    batch_size = options.train_batch_size
    num_batches = math.ceil(len(data) / batch_size)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=options.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=num_batches * options.train_epochs
    )
    model.train()
    bar = tqdm(total=num_batches * options.train_epochs, desc=desc, dynamic_ncols=True)
    for _ in range(options.train_epochs):
        order = torch.randperm(len(data), generator=generator).tolist()
        for start in range(0, len(order), batch_size):
            batch = [data[i] for i in order[start : start + batch_size]]
            loss, shown = batch_loss(batch, generator)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            optimizer.step()
            schedule.step()
            bar.update(1)
            bar.set_postfix(**shown)
    bar.close()
    model.eval()


# ---------------------------------------------------------------------- scoring


@torch.no_grad()
def draft_chains(
    model: EagleTrainModel,
    seq: EagleSequence,
    starts: torch.Tensor,
    depth: int,
    target_logits: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """[S, depth] greedy drafts from each start pair p (true pairs 0..p, then the draft's own
    h and tokens at p + 1, p + 2, ...): what the runner's chain proposes."""
    num_pairs = len(seq.token_ids) - 1
    z = model.pair_inputs(seq.token_ids[1:], seq.features[:-1])
    q, k, v = model.qkv(z, torch.arange(num_pairs))
    h = model.finish(z, model.attend(q, k, v, causal=True))[starts]
    drafts = [target_logits(h).argmax(-1)]
    # Start p sees true pairs 0..p, then its own draft pairs.
    #   keys: | true 0 .. num_pairs - 1 (masked past p) | draft p+1 .. p+j |
    true_mask = torch.arange(num_pairs)[None, :] <= starts[:, None]
    own_k, own_v = [], []
    for step in range(1, depth):
        z = model.pair_inputs(drafts[-1], h)[:, None]  # [S, 1, H]
        q_j, k_j, v_j = model.qkv(z, (starts + step)[:, None])  # [S, heads, 1, D]
        own_k.append(k_j)
        own_v.append(v_j)
        keys = torch.cat([k[None].expand(len(starts), -1, -1, -1), *own_k], dim=-2)
        values = torch.cat([v[None].expand(len(starts), -1, -1, -1), *own_v], dim=-2)
        mask = torch.cat([true_mask, torch.ones(len(starts), step, dtype=torch.bool)], dim=1)
        h = model.finish(z, model.attend(q_j, keys, values, mask[:, None, None, :]))[:, 0]
        drafts.append(target_logits(h).argmax(-1))
    return torch.stack(drafts, dim=1)


@torch.no_grad()
def score_eagle(
    model: EagleTrainModel,
    data: list[EagleSequence],
    target_logits: Callable[[torch.Tensor], torch.Tensor],
    depth: int,
) -> DraftScore:
    """Chain acceptance at each depth from every position whose next token is generated and
    whose `depth` following tokens exist. top1[j]: the share right at depth j among the
    chains whose drafts before j were all right."""
    chains = []
    for seq in data:
        num_tokens = len(seq.token_ids)
        # Start p: the target's token x_{p+1} is generated; drafts guess x_{p+2} .. x_{p+1+depth}.
        starts = torch.arange(seq.prompt_len - 1, num_tokens - 1 - depth)
        if not len(starts):
            continue
        drafts = draft_chains(model, seq, starts, depth, target_logits)
        truth = seq.token_ids[starts[:, None] + 2 + torch.arange(depth)[None, :]]
        chains.append((drafts == truth).int().cumprod(dim=1))
    return score_chains(chains, depth)


def score_chains(chains: list[torch.Tensor], depth: int) -> DraftScore:
    """The score of accepted-prefix chains ([positions, depth] of 0/1, each row a cumprod
    of draft == truth): per-depth top-1 given the chain so far, the chain, and the mean
    accepted length per verify step."""
    if not chains:
        return DraftScore([0.0] * depth, [0.0] * depth, 1.0, 0)
    accepted = torch.cat(chains).float()
    chain = accepted.mean(0)
    reached = torch.cat([torch.ones(1), chain[:-1]])
    top1 = chain / reached.clamp(min=1e-9)
    return DraftScore(
        top1=[round(v, 4) for v in top1.tolist()],
        chain=[round(v, 4) for v in chain.tolist()],
        mean_acceptance_length=round(1.0 + chain.sum().item(), 4),
        num_positions=accepted.shape[0],
    )


# ---------------------------------------------------------------------- the command


@dataclass
class EagleRun:
    """What `train_eagle` made: the model, the held-out data, and the scores on it."""

    model: EagleTrainModel
    held_out: list[EagleSequence]
    target_logits: Callable[[torch.Tensor], torch.Tensor]
    score: DraftScore
    untrained_score: DraftScore
    seconds: dict


def train_eagle(
    options: TrainDraftOptions, corpus: Corpus | None = None, **engine_kwargs
) -> EagleRun:
    """Generate, collect features, train, score; write the head to options.output.

    Args:
        corpus: generate_corpus(options)'s, made already (None: generated here).
        engine_kwargs: further `LLM` arguments for the generation engine.
    """
    seconds = {}
    start = time.perf_counter()
    if corpus is None:
        corpus = generate_corpus(options, **engine_kwargs)
    model_dir, sequences = corpus
    # Seeded after the generation, so a corpus made elsewhere trains the same head.
    torch.manual_seed(options.seed)
    num_held_out = max(1, len(sequences) // 10)
    seconds["generate"] = time.perf_counter() - start
    target = HFTarget(model_dir)
    train = collect_sequences(target, sequences[:-num_held_out], "Train set")
    held_out = collect_sequences(target, sequences[-num_held_out:], "Held-out set")
    seconds["features"] = time.perf_counter() - start - seconds["generate"]
    model = make_eagle(target, base_model=model_dir)
    depth = options.num_spec_tokens
    untrained_score = score_eagle(model, held_out, target.logits, depth)
    mark = time.perf_counter()
    train_eagle_model(model, train, target.logits, options)
    seconds["train"] = time.perf_counter() - mark
    score = score_eagle(model, held_out, target.logits, depth)
    save_eagle(model.state_dict(), options.output, base_model=model_dir, config=model.config)
    seconds = {k: round(v, 1) for k, v in seconds.items()}
    return EagleRun(model, held_out, target.logits, score, untrained_score, seconds)


def run_train_eagle(options: TrainDraftOptions) -> int:
    """The command: train, write, print the held-out chain acceptance."""
    start = time.perf_counter()
    run = train_eagle(options)
    elapsed = time.perf_counter() - start
    report = {
        "options": {k: getattr(options, k) for k in options.__struct_fields__},
        "held_out": asdict(run.score),
        "held_out_untrained": asdict(run.untrained_score),
        "seconds": round(elapsed, 1),
        "seconds_by_phase": run.seconds,
    }
    with open(os.path.join(options.output, "train_report.json"), "w") as f:
        json.dump(report, f, indent=1)
    score = run.score
    print(f"wrote an EAGLE-1 head to {options.output} in {elapsed:.0f} s ({run.seconds})")
    print_score(score, run.untrained_score, options.num_spec_tokens)
    return 0


def print_score(score: DraftScore, untrained: DraftScore, depth: int) -> None:
    """The held-out score of a trained head, as `kvserve train-draft` prints it."""
    print(f"held-out chains (all {depth} next tokens known): {score.num_positions}")
    for i, (top1, chain) in enumerate(zip(score.top1, score.chain)):
        print(
            f"  draft {i + 1} (token t+{i + 2}): right when reached {top1:.3f}, "
            f"chain accepted {chain:.3f}"
        )
    print(
        f"expected mean acceptance length (greedy chain, 1 + accepted drafts): "
        f"{score.mean_acceptance_length:.3f} (untrained head: "
        f"{untrained.mean_acceptance_length:.3f})"
    )
