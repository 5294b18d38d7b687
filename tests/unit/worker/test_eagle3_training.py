"""`train-draft --method eagle3` (kvserve/training/train_eagle3.py) on a tiny float32 Llama:
a few training steps lower the loss, the folder written loads in eagle3.py as the same
weights, and the training module's unrolled steps are what the served head computes when it
drafts (over the aux states the served target keeps)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.services.worker.models import load_model
from kvserve.services.worker.spec_decode.eagle3 import load_eagle3
from kvserve.shared.launch_options import TrainDraftOptions
from kvserve.training.train_draft import HFTarget
from kvserve.training.train_eagle3 import (
    collect_eagle3_sequences,
    draft_target_logits,
    draft_vocabulary,
    eagle3_config_of,
    eagle3_loss,
    make_eagle3,
    save_eagle3_model,
    score_eagle3,
    train_eagle3_model,
)
from tests.support.model_steps import bind_kv_caches, build_step
from tests.support.models import build_tiny_llama, tiny_successor

DRAFT_VOCAB = 128
DEPTH = 3


@pytest.fixture(scope="module")
def successor_dir(tmp_path_factory) -> str:
    return build_tiny_llama(str(tmp_path_factory.mktemp("successor")), successor=True)


def _sequences(num: int, seed: int, length: int = 20) -> list[tuple[list[int], int]]:
    """Random 6-token prompts, each followed by the successor model's greedy continuation."""
    rng = np.random.default_rng(seed)
    successor = tiny_successor()
    out = []
    for _ in range(num):
        tokens = rng.integers(0, 256, 6).tolist()
        for _ in range(length):
            tokens.append(int(successor[tokens[-1]]))
        out.append((tokens, 6))
    return out


def _setup(model_dir: str, num: int, seed: int):
    target = HFTarget(model_dir)
    config = eagle3_config_of(target.model.config, DRAFT_VOCAB, model_dir)
    assert config.aux_layer_ids == (2, 1, 0)  # (2, L // 2, L - 3) clamped to 2 layers
    data = collect_eagle3_sequences(target, _sequences(num, seed), config.aux_layer_ids, "d")
    draft_ids = draft_vocabulary(data, config.layer.vocab_size, DRAFT_VOCAB)
    return target, data, make_eagle3(target, draft_ids, base_model=model_dir)


def test_a_few_steps_lower_the_loss_and_the_folder_loads(successor_dir, tmp_path):
    torch.manual_seed(0)  # the head's initial weights (torch's default init)
    target, train, model = _setup(successor_dir, 8, seed=0)
    options = TrainDraftOptions(
        model=successor_dir,
        output=str(tmp_path / "head"),
        method="eagle3",
        epochs=4,
        lr=3e-3,
        batch_size=2,
        num_spec_tokens=DEPTH,
        draft_vocab_size=DRAFT_VOCAB,
    )
    logits = draft_target_logits(target, model.draft_ids)
    with torch.no_grad():
        before = eagle3_loss(model, train, logits, DEPTH)[0].item()
    # Scored on the training sequences: the tiny successor model's continuations of other
    # prompts hold tokens the training data never had (a head learns each token's successor
    # one by one), so a held-out score is 0 or 1 draft by chance, trained or not.
    untrained = score_eagle3(model, train, DEPTH)
    train_eagle3_model(model, train, logits, options)  # 16 steps
    with torch.no_grad():
        after = eagle3_loss(model, train, logits, DEPTH)[0].item()
    assert after < 0.7 * before, (before, after)
    trained = score_eagle3(model, train, DEPTH)
    assert trained.num_positions > 0
    assert trained.mean_acceptance_length > untrained.mean_acceptance_length
    # The draft vocabulary: the data's most frequent ids.
    counts = torch.bincount(torch.cat([s.token_ids for s in train]), minlength=len(model.t2d))
    assert counts[model.t2d].min() >= counts[~model.t2d].max()
    assert (model.draft_ids == torch.nonzero(model.t2d)[:, 0]).all()

    save_eagle3_model(model, options.output)
    target_model, _ = load_model(successor_dir, torch.float32, "cpu")
    head = load_eagle3(options.output, target_model)
    assert head.aux_layer_ids == (2, 1, 0)
    assert head.config.draft_vocab_size == DRAFT_VOCAB and head.embed_tokens is None
    published = head.published_state_dict()
    for name, tensor in model.state_dict().items():
        if name != "t2d":  # checked for shape only, not kept
            torch.testing.assert_close(published[name], tensor, rtol=0, atol=0)


@torch.no_grad()
def test_the_unrolled_steps_are_what_the_served_head_drafts(successor_dir, tmp_path):
    target, data, model = _setup(successor_dir, 1, seed=2)
    generator = torch.Generator().manual_seed(0)
    for param in model.parameters():  # weights other than the init: a check that can fail
        param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    save_eagle3_model(model.eval(), str(tmp_path))
    target_model, _ = load_model(successor_dir, torch.float32, "cpu")
    head = load_eagle3(str(tmp_path), target_model)
    bind_kv_caches(target_model)
    bind_kv_caches(head)
    seq = data[0]
    token_ids = seq.token_ids.tolist()
    # The served target keeps the same aux states as the HF target's layer inputs.
    target_model(*build_step([(token_ids, 0, [1, 2, 3, 4, 5, 6, 7])]))
    aux = target_model.model.aux_hidden_states[: len(token_ids)]
    torch.testing.assert_close(aux, seq.aux, rtol=0, atol=1e-4)

    outs = model(seq.token_ids[None], seq.aux[None], DEPTH)
    blocks = [3, 0, 7, 1, 9]
    for last in (4, 11):  # the chain from the verified pairs 0..last
        ids, positions, metadata = build_step([(token_ids[1 : last + 2], 0, blocks)])
        h = head(ids, head.fc(aux[: last + 1]), positions, metadata)
        torch.testing.assert_close(h, outs[0][0, : last + 1], rtol=0, atol=1e-4)
        h = h[-1:]
        for j in range(1, DEPTH):
            torch.testing.assert_close(
                head.guess(h), model.draft_ids[model.logits(outs[j - 1][0, last]).argmax(-1)][None]
            )
            ids, positions, metadata = build_step([([token_ids[last + 1 + j]], last + j, blocks)])
            h = head(ids, h, positions, metadata)
            torch.testing.assert_close(h[0], outs[j][0, last], rtol=0, atol=1e-4)
