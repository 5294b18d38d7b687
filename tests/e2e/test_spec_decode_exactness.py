"""Random sampling with speculation is exact: through the whole engine, the tokens a tiny
model emits with a draft that disagrees with it are distributed as the target's own.

The target is a tiny random Llama over 16 tokens; the draft is its first 3 of 4 layers (a
self-draft whose guesses the target often rejects). Each of 4,000 requests samples 4 tokens
at temperature 1; the exact marginal distribution of each position comes from HF
transformers by enumerating every prefix. A chi-square test per position compares them.
The first token is sampled without drafts; tokens 2-4 come out of the rejection sampler.
Removing its correction (drawing the replacement from p instead of norm(max(0, p - q)))
makes this test fail: 607.6 at position 1 against a critical value of 37.8 (25.2, 10.9,
10.5, 21.5 at positions 0-3 with it).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams
from tests.support.kv import assert_no_leaked_blocks
from tests.support.models import make_tiny_hf_model

pytestmark = pytest.mark.slow

VOCAB = 16
PROMPT = [3, 5, 7, 1]
NUM_SAMPLES = 4000
NUM_TOKENS = 4
TEMPERATURE = 1.0


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    model_dir = str(tmp_path_factory.mktemp("tiny-exactness-llama"))
    model = make_tiny_hf_model(
        "llama",
        seed=3,
        vocab_size=VOCAB,
        num_hidden_layers=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model.save_pretrained(model_dir, safe_serialization=True)
    return model_dir, model.eval()


def _exact_marginals(hf_model) -> list[np.ndarray]:
    """P(token at position i) for i < NUM_TOKENS, summed over every prefix of the target."""
    marginals = []
    # prefix -> probability; start from the prompt alone.
    prefixes = {(): 1.0}
    with torch.inference_mode():
        for _ in range(NUM_TOKENS):
            keys = list(prefixes)
            ids = torch.tensor([PROMPT + list(k) for k in keys])
            logits = hf_model(ids).logits[:, -1].double() / TEMPERATURE
            probs = torch.softmax(logits, dim=-1).numpy()
            weights = np.array([prefixes[k] for k in keys])
            marginals.append((weights[:, None] * probs).sum(axis=0))
            if len(marginals) == NUM_TOKENS:
                break
            prefixes = {
                (*k, t): prefixes[k] * float(probs[i, t])
                for i, k in enumerate(keys)
                for t in range(VOCAB)
            }
    return marginals


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic, cells expecting fewer than 5 pooled; (statistic, dof)."""
    expected = probs * counts.sum()
    small = expected < 5
    cells_obs = list(counts[~small]) + ([counts[small].sum()] if small.any() else [])
    cells_exp = list(expected[~small]) + ([expected[small].sum()] if small.any() else [])
    stat = sum((o - e) ** 2 / e for o, e in zip(cells_obs, cells_exp) if e > 0)
    return stat, len(cells_obs) - 1


def _critical_value(dof: int, z: float = 3.09) -> float:
    """The chi-square quantile at p = 0.001 (z of 0.999), Wilson-Hilferty approximation."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def test_emitted_tokens_follow_the_target_distribution(tiny_target, default_model_dir):
    model_dir, hf_model = tiny_target
    exact = _exact_marginals(hf_model)
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "num_draft_layers": 3,
            "adaptive": False}  # fmt: skip
    llm = LLM(
        model_dir,
        tokenizer=default_model_dir,
        dtype="float32",
        speculative_config=spec,
        max_num_seqs=256,
        max_model_len=64,
        kv_cache_memory=64 << 20,
        enable_prefix_caching=False,
    )
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=NUM_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * NUM_SAMPLES, params, use_tqdm=False)
    tokens = np.array([o.outputs[0].token_ids for o in outs])
    assert tokens.shape == (NUM_SAMPLES, NUM_TOKENS)
    totals = llm.stats_totals
    # The draft disagrees often enough for the correction to matter.
    assert 0.2 < totals.spec_num_accepted_tokens / totals.spec_num_draft_tokens < 0.9
    for position in range(NUM_TOKENS):
        counts = np.bincount(tokens[:, position], minlength=VOCAB)
        stat, dof = _chi_square(counts, exact[position])
        assert stat < _critical_value(dof), (
            f"position {position}: chi-square {stat:.1f} over {dof} dof "
            f"(critical {_critical_value(dof):.1f}); counts {counts.tolist()}"
        )
    assert_no_leaked_blocks(llm.engine_core.scheduler)


def test_the_critical_value_approximation():
    # Tabulated chi-square quantiles at p = 0.001.
    for dof, table in ((5, 20.515), (10, 29.588), (15, 37.697)):
        assert _critical_value(dof) == pytest.approx(table, rel=0.02)
