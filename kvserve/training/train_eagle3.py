"""`kvserve train-draft --method eagle3`: an EAGLE-3 head trained with the training-time test.

The data are train_draft's (kvserve's greedy generations of the prompts); one no-grad HF
forward per sequence keeps, at every position p, the residual stream entering the three aux
layers (a_p | b_p | c_p, what `LlamaModel.aux_hidden_state_layers` keeps when serving) and
the final hidden state f_p (the target's next-token distribution is softmax(LM(f_p))).

The head is eagle3.py's (arXiv 2503.01840). Training-time test: the draft is unrolled k steps
(k = --num-spec-tokens) over every start pair p of a sequence at once, as it drafts:

    step 0:  pair (g_p = fc([a_p|b_p|c_p]), x_{p+1}) at position p, causal over pairs 0..p
    step j:  pair (h^{j-1}_p, x_{p+1+j}) at position p + j; its keys: the step-0 pairs 0..p
             and this chain's own pairs of steps 1..j (the diagonal: the chain from p only)
    loss j:  soft cross-entropy of lm_head(norm(h^j_p)) against the target's distribution
             of x_{p+2+j} over the draft vocabulary, softmax(LM(f_{p+1+j})[draft ids]),
             where the target's own argmax is a draft token; weight 0.8 ** j

The tokens fed are the model's own (its greedy generations), not the draft's guesses: a chain
is accepted only while its guesses equal them, so where it matters they are the same. For
the same reason scoring (the greedy chain on held-out sequences: a draft counts while it and
every earlier one equal the model's tokens) runs the same unrolled forward without a grad.

The draft vocabulary is the --draft-vocab-size most frequent tokens of the training
sequences, `d2t` (draft id -> target id - draft id) and `t2d` (target id in it) its maps.
lm_head starts as the target's LM head rows of those tokens and norm as the target's final
norm; fc and the layer at torch's default init. `Eagle3TrainModel` is plain torch under the
published names: its state_dict is what `save_eagle3_tensors` writes and `load_eagle3` reads.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from kvserve.services.worker.layers.rotary_embedding import RotaryEmbedding
from kvserve.services.worker.spec_decode.eagle import EagleConfig
from kvserve.services.worker.spec_decode.eagle3 import (
    Eagle3Config,
    default_aux_layer_ids,
    save_eagle3_tensors,
)
from kvserve.shared.launch_options import TrainDraftOptions
from kvserve.training.train_draft import DraftScore, HFTarget, generate_sequences, load_prompts
from kvserve.training.train_eagle import (
    _MLP,
    _RMSNorm,
    _rotate,
    _SelfAttention,
    eagle_config_of,
    print_score,
    score_chains,
    train_head,
)

# Each further unrolled step's loss weighs 0.8 times the one before (the paper's weights).
STEP_DECAY = 0.8


@dataclass
class Eagle3Sequence:
    """One sequence: token_ids [T] int64, aux [T, 3H] (the aux layers' input streams),
    features [T, H] (f, after the final norm), top_ids [T] (the target's argmax at each
    position), prompt_len."""

    token_ids: torch.Tensor
    aux: torch.Tensor
    features: torch.Tensor
    top_ids: torch.Tensor
    prompt_len: int


# ---------------------------------------------------------------------- the module


class _WideAttention(_SelfAttention):
    """EAGLE-3's attention: q, k and v read [embedding | hidden state], 2H wide."""

    def __init__(self, config: EagleConfig):
        super().__init__(config)
        wide = 2 * config.hidden_size
        self.q_proj = nn.Linear(wide, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(wide, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(wide, self.num_kv_heads * self.head_dim, bias=False)


class _MidLayer(nn.Module):
    def __init__(self, config: EagleConfig):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = _RMSNorm(hidden, eps)
        self.hidden_norm = _RMSNorm(hidden, eps)
        self.post_attention_layernorm = _RMSNorm(hidden, eps)
        self.self_attn = _WideAttention(config)
        self.mlp = _MLP(config)


class Eagle3TrainModel(nn.Module):
    """EAGLE-3's draft in plain torch, its parameters and vocabulary maps under the published
    names (fc, midlayer.*, norm, lm_head, d2t, t2d).

    Args:
        config: the head's config (draft_vocab_size, aux_layer_ids set).
        embed_weight: [V, H] the target's embedding (a buffer: neither trained nor saved).
        draft_ids: [draft_vocab_size] the target ids of the draft vocabulary, ascending.
    """

    d2t: torch.Tensor  # buffers, registered below
    t2d: torch.Tensor
    embed_weight: torch.Tensor
    cos_sin: torch.Tensor

    def __init__(self, config: Eagle3Config, embed_weight: torch.Tensor, draft_ids: torch.Tensor):
        super().__init__()
        shape = config.layer
        assert shape.hidden_act == "silu", "train-draft builds silu MLPs"
        assert config.aux_layer_ids is not None and len(draft_ids) == config.draft_vocab_size
        self.config = config
        hidden = shape.hidden_size
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        self.midlayer = _MidLayer(shape)
        self.norm = _RMSNorm(hidden, shape.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", draft_ids - torch.arange(len(draft_ids)))
        t2d = torch.zeros(shape.vocab_size, dtype=torch.bool)
        t2d[draft_ids] = True
        self.register_buffer("t2d", t2d)
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        rope = shape.rope_parameters
        table = RotaryEmbedding(
            shape.head_dim, shape.max_position_embeddings, rope["rope_theta"], rope
        ).cos_sin_cache
        self.register_buffer("cos_sin", table, persistent=False)

    @property
    def draft_ids(self) -> torch.Tensor:
        """[draft_vocab_size] the target id of each draft id."""
        return torch.arange(len(self.d2t)) + self.d2t

    def step_inputs(self, ids: torch.Tensor, features: torch.Tensor):
        """(attention input [..., 2H], residual [..., H]) of pairs (features, ids)."""
        layer = self.midlayer
        normed = layer.hidden_norm(features)
        embeds = layer.input_layernorm(F.embedding(ids, self.embed_weight))
        residual = normed if self.config.norm_before_residual else features
        return torch.cat([embeds, normed], dim=-1), residual

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """x [B, N, 2H], positions [N] -> q [B, Hq, N, D], k and v [B, Hkv, N, D]."""
        attn = self.midlayer.self_attn

        def heads(y: torch.Tensor, num: int) -> torch.Tensor:
            return y.unflatten(-1, (num, attn.head_dim)).transpose(-2, -3)

        q = heads(attn.q_proj(x), attn.num_heads)
        k = heads(attn.k_proj(x), attn.num_kv_heads)
        v = heads(attn.v_proj(x), attn.num_kv_heads)
        cos, sin = self.cos_sin[positions].unsqueeze(-3).chunk(2, dim=-1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def attend_chains(self, q, k0, v0, own_k, own_v) -> torch.Tensor:
        """Query p over the step-0 keys 0..p and the keys own_k[s][p] of its chain's own
        earlier steps; [B, N, Hq * D]."""
        attn = self.midlayer.self_attn
        repeat = attn.num_heads // attn.num_kv_heads

        def grouped(t: torch.Tensor) -> torch.Tensor:
            return t.repeat_interleave(repeat, dim=-3)

        num_pairs = q.shape[-2]
        scale = attn.head_dim**-0.5
        causal = torch.ones(num_pairs, num_pairs, dtype=torch.bool).tril()
        scores = (q @ grouped(k0).transpose(-1, -2)) * scale
        scores = scores.masked_fill(~causal, float("-inf"))
        diagonal = [(q * grouped(k)).sum(-1, keepdim=True) * scale for k in own_k]
        probs = torch.softmax(torch.cat([scores, *diagonal], dim=-1).float(), dim=-1)
        probs = probs.to(q.dtype)
        out = probs[..., :num_pairs] @ grouped(v0)
        for s, v in enumerate(own_v):
            out = out + probs[..., num_pairs + s, None] * grouped(v)
        return out.transpose(-2, -3).flatten(-2)

    def finish(self, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """h = r + mlp(post_attention_layernorm(r)), r = residual + o(attn)."""
        layer = self.midlayer
        r = residual + layer.self_attn.o_proj(attn_out)
        return r + layer.mlp(layer.post_attention_layernorm(r))

    def forward(self, token_ids: torch.Tensor, aux: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """token_ids [B, T], aux [B, T, 3H]: the k-step unrolled draft over every start pair
        p = 0 .. T - 2. Returns per step j the outputs h^j [B, T - 1, H] (before the norm)."""
        num_pairs = token_ids.shape[1] - 1
        positions = torch.arange(num_pairs)
        padded = F.pad(token_ids, (0, depth))  # x_{p+1+j} past the end: any id (masked)
        x, residual = self.step_inputs(padded[:, 1 : 1 + num_pairs], self.fc(aux[:, :-1]))
        q, k0, v0 = self.qkv(x, positions)
        h = self.finish(residual, self.attend_chains(q, k0, v0, [], []))
        outs = [h]
        own_k: list[torch.Tensor] = []
        own_v: list[torch.Tensor] = []
        for j in range(1, depth):
            x, residual = self.step_inputs(padded[:, 1 + j : 1 + j + num_pairs], h)
            q, k, v = self.qkv(x, positions + j)
            own_k.append(k)
            own_v.append(v)
            h = self.finish(residual, self.attend_chains(q, k0, v0, own_k, own_v))
            outs.append(h)
        return outs

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of head outputs."""
        return self.lm_head(self.norm(h))


def eagle3_config_of(hf_config, draft_vocab_size: int, base_model: str | None) -> Eagle3Config:
    """A head with the target's layer shape, reading the default aux layers (clamped to the
    target's depth for a target of fewer than five layers)."""
    num_layers = hf_config.num_hidden_layers
    ids = tuple(min(max(i, 0), num_layers) for i in default_aux_layer_ids(num_layers))
    return Eagle3Config(
        layer=eagle_config_of(hf_config, base_model),
        draft_vocab_size=min(draft_vocab_size, hf_config.vocab_size),
        aux_layer_ids=ids,
    )


def make_eagle3(
    target: HFTarget, draft_ids: torch.Tensor, base_model: str | None = None
) -> Eagle3TrainModel:
    """A fresh head: lm_head = the target's LM head rows of the draft vocabulary, norm = its
    final norm, the rest torch's default init."""
    hf_model = target.model
    config = eagle3_config_of(hf_model.config, len(draft_ids), base_model)
    model = Eagle3TrainModel(config, hf_model.get_input_embeddings().weight, draft_ids)
    with torch.no_grad():
        model.lm_head.weight.copy_(target.lm_head.weight[draft_ids])
        model.norm.weight.copy_(hf_model.base_model.norm.weight)
    return model


def save_eagle3_model(model: Eagle3TrainModel, folder: str) -> None:
    """The published layout eagle3.py loads."""
    save_eagle3_tensors(model.config, model.state_dict(), folder)


# ---------------------------------------------------------------------- data


@torch.no_grad()
def target_states(
    target: HFTarget, token_ids: list[int], layer_ids: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [T, 3H]: the stream entering each aux layer, an index of L the final norm's input;
    f [T, H]: the final hidden states)."""
    inner = target.model.base_model
    modules = [*inner.layers, inner.norm]
    kept: dict[int, torch.Tensor] = {}

    def keeper(index: int):
        def hook(module, args, kwargs):
            kept[index] = (args[0] if args else kwargs["hidden_states"])[0]

        return hook

    hooks = [
        modules[i].register_forward_pre_hook(keeper(i), with_kwargs=True) for i in set(layer_ids)
    ]
    try:
        ids = torch.tensor([token_ids], dtype=torch.int64)
        final = inner(input_ids=ids).last_hidden_state[0]
    finally:
        for hook in hooks:
            hook.remove()
    return torch.cat([kept[i] for i in layer_ids], dim=-1), final


def collect_eagle3_sequences(
    target: HFTarget,
    sequences: list[tuple[list[int], int]],
    layer_ids: tuple[int, ...],
    desc: str,
) -> list[Eagle3Sequence]:
    out = []
    for token_ids, prompt_len in tqdm(sequences, desc=desc, dynamic_ncols=True):
        if len(token_ids) < 3:
            continue
        aux, features = target_states(target, token_ids, layer_ids)
        with torch.no_grad():
            top_ids = target.logits(features).argmax(-1)
        out.append(Eagle3Sequence(torch.tensor(token_ids), aux, features, top_ids, prompt_len))
    if not out:
        raise ValueError("no sequence was longer than two tokens: raise --max-tokens")
    return out


def draft_vocabulary(data: list[Eagle3Sequence], vocab_size: int, size: int) -> torch.Tensor:
    """[size] ascending target ids: the most frequent tokens of the sequences (ties and
    unseen tokens by id)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for seq in data:
        counts += torch.bincount(seq.token_ids, minlength=vocab_size)
    order = torch.argsort(counts, descending=True, stable=True)
    return order[: min(size, vocab_size)].sort().values


# ---------------------------------------------------------------------- training and scoring


@dataclass
class _Batch:
    """Sequences padded to one length: token_ids [B, T], aux [B, T, 3H], features [B, T, H],
    top_ids [B, T], lengths [B]."""

    token_ids: torch.Tensor
    aux: torch.Tensor
    features: torch.Tensor
    top_ids: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def of(cls, batch: list[Eagle3Sequence]) -> _Batch:
        def pad(tensors: list[torch.Tensor]) -> torch.Tensor:
            return nn.utils.rnn.pad_sequence(tensors, batch_first=True)

        return cls(
            pad([s.token_ids for s in batch]),
            pad([s.aux for s in batch]),
            pad([s.features for s in batch]),
            pad([s.top_ids for s in batch]),
            torch.tensor([len(s.token_ids) for s in batch]),
        )

    def step_rows(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(valid [B, T - 1]: pairs p whose step j has a next token, p + 1 + j <= T - 1;
        target position p + 1 + j [B, T - 1], clamped)."""
        num_pairs = self.token_ids.shape[1] - 1
        p = torch.arange(num_pairs)[None, :]
        valid = p + 1 + j <= self.lengths[:, None] - 1
        return valid, (p + 1 + j).clamp(max=num_pairs).expand(len(self.lengths), -1)


def draft_target_logits(
    target: HFTarget, draft_ids: torch.Tensor
) -> Callable[[torch.Tensor], torch.Tensor]:
    """f -> the target's logits of the draft vocabulary's tokens (its LM head's rows of them,
    then the soft cap if any)."""
    weight = target.lm_head.weight[draft_ids].detach()
    bias = getattr(target.lm_head, "bias", None)
    bias = None if bias is None else bias[draft_ids].detach()
    softcap = target.softcap

    def logits(features: torch.Tensor) -> torch.Tensor:
        out = F.linear(features, weight, bias)
        return torch.tanh(out / softcap) * softcap if softcap else out

    return logits


def eagle3_loss(
    model: Eagle3TrainModel,
    batch: list[Eagle3Sequence],
    target_logits: Callable[[torch.Tensor], torch.Tensor],
    depth: int,
) -> tuple[torch.Tensor, list[float]]:
    """(loss, per step the share of guesses equal to the target's argmax) of a batch.

    Args:
        target_logits: f -> the target's logits over the draft vocabulary
            (`draft_target_logits`).
    """
    data = _Batch.of(batch)
    outs = model(data.token_ids, data.aux, depth)
    with torch.no_grad():  # [B, T, draft vocabulary]
        target_p = torch.softmax(target_logits(data.features).float(), dim=-1)
    draft_ids = model.draft_ids
    loss = torch.zeros(())
    agreement = []
    for j, h in enumerate(outs):
        valid, at = data.step_rows(j)
        rows = torch.arange(len(batch))[:, None].expand_as(at)
        p, top = target_p[rows, at][valid], data.top_ids[rows, at][valid]
        logits = model.logits(h[valid]).float()
        cross_entropy = -(p * torch.log_softmax(logits, dim=-1)).sum(-1)
        # Where the target's own choice is outside the draft vocabulary, nothing to learn.
        in_vocab = model.t2d[top]
        loss = loss + STEP_DECAY**j * (cross_entropy * in_vocab).sum() / max(len(top), 1)
        agreement.append((draft_ids[logits.argmax(-1)] == top).float().mean().item())
    return loss, agreement


def train_eagle3_model(
    model: Eagle3TrainModel,
    data: list[Eagle3Sequence],
    target_logits: Callable[[torch.Tensor], torch.Tensor],
    options: TrainDraftOptions,
) -> None:
    """AdamW over batches of whole sequences, cosine-decayed learning rate (train_head)."""

    def batch_loss(batch: list, generator: torch.Generator) -> tuple[torch.Tensor, dict]:
        del generator  # the unrolled steps draw nothing
        loss, agreement = eagle3_loss(model, batch, target_logits, options.num_spec_tokens)
        return loss, {"loss": f"{loss.item():.3f}", "top1": f"{agreement[0]:.2f}"}

    train_head(model, data, options, batch_loss, "Training EAGLE-3")


@torch.no_grad()
def score_eagle3(model: Eagle3TrainModel, data: list[Eagle3Sequence], depth: int) -> DraftScore:
    """Greedy chain acceptance from every position whose next token is generated and whose
    `depth` following tokens exist (train_eagle.score_eagle's positions and figures)."""
    chains = []
    for seq in data:
        num_tokens = len(seq.token_ids)
        starts = torch.arange(seq.prompt_len - 1, num_tokens - 1 - depth)
        if not len(starts):
            continue
        outs = model(seq.token_ids[None], seq.aux[None], depth)
        guesses = torch.stack([model.draft_ids[model.logits(h[0]).argmax(-1)] for h in outs], 1)
        truth = seq.token_ids[starts[:, None] + 2 + torch.arange(depth)[None, :]]
        chains.append((guesses[starts] == truth).int().cumprod(dim=1))
    return score_chains(chains, depth)


# ---------------------------------------------------------------------- the command


@dataclass
class Eagle3Run:
    """What `train_eagle3` made: the model, the held-out data, and the scores on it."""

    model: Eagle3TrainModel
    held_out: list[Eagle3Sequence]
    score: DraftScore
    untrained_score: DraftScore
    seconds: dict


def fit_eagle3(
    target: HFTarget,
    model_dir: str,
    sequences: tuple[list[tuple[list[int], int]], list[tuple[list[int], int]]],
    options: TrainDraftOptions,
) -> Eagle3Run:
    """Collect the target's states of (train, held-out) sequences, pick the draft vocabulary,
    train, score; write the head to options.output."""
    seconds = {}
    start = time.perf_counter()
    config = eagle3_config_of(target.model.config, options.draft_vocab_size, model_dir)
    assert config.aux_layer_ids is not None
    train = collect_eagle3_sequences(target, sequences[0], config.aux_layer_ids, "Train set")
    held_out = collect_eagle3_sequences(target, sequences[1], config.aux_layer_ids, "Held-out set")
    seconds["features"] = time.perf_counter() - start
    draft_ids = draft_vocabulary(train, config.layer.vocab_size, config.draft_vocab_size)
    model = make_eagle3(target, draft_ids, base_model=model_dir)
    depth = options.num_spec_tokens
    untrained_score = score_eagle3(model, held_out, depth)
    mark = time.perf_counter()
    train_eagle3_model(model, train, draft_target_logits(target, draft_ids), options)
    seconds["train"] = time.perf_counter() - mark
    score = score_eagle3(model, held_out, depth)
    save_eagle3_model(model, options.output)
    seconds = {k: round(v, 1) for k, v in seconds.items()}
    return Eagle3Run(model, held_out, score, untrained_score, seconds)


def train_eagle3(options: TrainDraftOptions, **engine_kwargs) -> Eagle3Run:
    """Generate, collect the target's states, train, score; write the head to options.output.

    Args:
        engine_kwargs: further `LLM` arguments for the generation engine.
    """
    torch.manual_seed(options.seed)
    start = time.perf_counter()
    prompts = load_prompts(options.prompts, options.num_prompts, options.seed)
    num_held_out = max(1, len(prompts) // 10)
    model_dir, sequences = generate_sequences(
        options.model, prompts, options.max_tokens, options.seed, **engine_kwargs
    )
    generate_seconds = round(time.perf_counter() - start, 1)
    split = (sequences[:-num_held_out], sequences[-num_held_out:])
    run = fit_eagle3(HFTarget(model_dir), model_dir, split, options)
    run.seconds = {"generate": generate_seconds, **run.seconds}
    return run


def run_train_eagle3(options: TrainDraftOptions) -> int:
    """The command: train, write, print the held-out chain acceptance."""
    start = time.perf_counter()
    run = train_eagle3(options)
    elapsed = time.perf_counter() - start
    report = {
        "options": {k: getattr(options, k) for k in options.__struct_fields__},
        "aux_layer_ids": list(run.model.config.aux_layer_ids or ()),
        "held_out": asdict(run.score),
        "held_out_untrained": asdict(run.untrained_score),
        "seconds": round(elapsed, 1),
        "seconds_by_phase": run.seconds,
    }
    with open(os.path.join(options.output, "train_report.json"), "w") as f:
        json.dump(report, f, indent=1)
    score = run.score
    print(f"wrote an EAGLE-3 head to {options.output} in {elapsed:.0f} s ({run.seconds})")
    print_score(score, run.untrained_score, options.num_spec_tokens)
    return 0
