"""Rejection sampler tests: exact greedy verification, and speculative sampling that emits
tokens in the target's own distribution (chi-square against a tiny Markov-chain "model")."""

from __future__ import annotations

import math

import torch

from kvserve.services.worker.spec_decode.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID as PAD,
)
from kvserve.services.worker.spec_decode.rejection_sampler import (
    num_accepted,
    rejection_sample,
)


def greedy_sample(drafts: list[list[int]], argmax: list[list[int]]) -> torch.Tensor:
    """All-greedy call from per-request drafts and per-request target argmax rows (k + 1 each)."""
    assert all(len(a) == len(d) + 1 for d, a in zip(drafts, argmax))
    return rejection_sample(
        draft_token_ids=torch.tensor([t for d in drafts for t in d], dtype=torch.int64),
        num_draft_tokens=[len(d) for d in drafts],
        target_argmax=torch.tensor([t for a in argmax for t in a], dtype=torch.int64),
        target_probs=None,
        is_greedy=torch.ones(len(drafts), dtype=torch.bool),
        draft_probs=None,
        generators={},
    )


def reference_greedy(drafts: list[int], argmax: list[int]) -> list[int]:
    """One request's greedy output, token by token."""
    emitted = []
    for draft, target in zip(drafts, argmax):
        if draft != target:
            return emitted + [target]
        emitted.append(draft)
    return emitted + [argmax[-1]]


def emitted(output: torch.Tensor) -> list[list[int]]:
    return [[t for t in row if t != PAD] for row in output.tolist()]


def random_inputs(num_draft_tokens: list[int], vocab_size: int, seed: int) -> dict:
    """A random batch: softmax target rows, softmax draft rows, drafts drawn from them."""
    gen = torch.Generator().manual_seed(seed)
    num_drafts, num_reqs = sum(num_draft_tokens), len(num_draft_tokens)
    target_probs = torch.randn(num_drafts + num_reqs, vocab_size, generator=gen).softmax(-1)
    draft_probs = (torch.randn(num_drafts, vocab_size, generator=gen) * 2).softmax(-1)
    draft_token_ids = torch.multinomial(draft_probs, 1, generator=gen).squeeze(1)
    return dict(
        draft_token_ids=draft_token_ids,
        num_draft_tokens=num_draft_tokens,
        target_argmax=target_probs.argmax(-1),
        target_probs=target_probs,
        is_greedy=torch.zeros(num_reqs, dtype=torch.bool),
        draft_probs=draft_probs,
        generators={},
    )


# --- greedy -------------------------------------------------------------------------------


def test_greedy_all_accepted_appends_bonus():
    out = greedy_sample([[5, 6, 7]], [[5, 6, 7, 8]])
    assert out.tolist() == [[5, 6, 7, 8]]
    assert num_accepted(out, [3]) == [3]


def test_greedy_first_mismatch_emits_target_token():
    out = greedy_sample([[5, 6, 7]], [[1, 6, 7, 8]])
    assert out.tolist() == [[1, PAD, PAD, PAD]]
    assert num_accepted(out, [3]) == [0]


def test_greedy_mid_mismatch_stops_there():
    # Row 2 would match again, but nothing after a rejection counts.
    out = greedy_sample([[5, 6, 7, 9]], [[5, 2, 7, 9, 8]])
    assert out.tolist() == [[5, 2, PAD, PAD, PAD]]
    assert num_accepted(out, [4]) == [1]


def test_greedy_no_drafts_emits_target_token():
    out = greedy_sample([[]], [[4]])
    assert out.tolist() == [[4]]
    assert num_accepted(out, [0]) == [0]


def test_greedy_ragged_batch_matches_reference():
    gen = torch.Generator().manual_seed(0)
    num_draft_tokens = [3, 0, 5, 1, 2, 0, 4]
    drafts, argmax = [], []
    for k in num_draft_tokens:
        # A vocabulary of 3 gives a mix of early, late and no mismatches.
        drafts.append(torch.randint(0, 3, (k,), generator=gen).tolist())
        argmax.append(torch.randint(0, 3, (k + 1,), generator=gen).tolist())
    out = greedy_sample(drafts, argmax)
    assert out.shape == (len(num_draft_tokens), max(num_draft_tokens) + 1)
    expected = [reference_greedy(d, a) for d, a in zip(drafts, argmax)]
    assert emitted(out) == expected
    assert num_accepted(out, num_draft_tokens) == [len(e) - 1 for e in expected]


def test_mixed_batch_keeps_greedy_rows_exact():
    num_draft_tokens = [3, 4, 2, 0, 3]
    inputs = random_inputs(num_draft_tokens, vocab_size=4, seed=1)
    is_greedy = torch.tensor([True, False, True, True, False])
    inputs["is_greedy"] = is_greedy
    # Greedy rows follow target_argmax, not target_probs: give them an argmax that disagrees
    # with their probabilities, and drafts that match it for a while.
    drafts = inputs["draft_token_ids"].split(num_draft_tokens)
    argmax = list(inputs["target_argmax"].split([k + 1 for k in num_draft_tokens]))
    argmax[0] = torch.cat([drafts[0], torch.tensor([3])])  # all accepted
    argmax[2] = torch.stack([drafts[2][0], (drafts[2][1] + 1) % 4, drafts[2][0]])  # mismatch
    inputs["target_argmax"] = torch.cat(argmax)
    out = rejection_sample(**inputs)
    rows = emitted(out)
    for b in (0, 2, 3):
        assert rows[b] == reference_greedy(drafts[b].tolist(), argmax[b].tolist())
    for b in (1, 4):
        assert 1 <= len(rows[b]) <= num_draft_tokens[b] + 1
        assert rows[b][:-1] == drafts[b][: len(rows[b]) - 1].tolist()


def test_random_one_hot_target_is_deterministic():
    # A one-hot p accepts a draft on its token with certainty and rejects any other, and the
    # residual max(0, p - q) is then that token: the random path must agree with greedy.
    vocab_size = 5
    drafts = [[1, 2, 3], [4, 0], [2]]
    argmax = [[1, 2, 0, 4], [4, 0, 3], [1, 2]]
    target_probs = torch.nn.functional.one_hot(
        torch.tensor([t for a in argmax for t in a]), vocab_size
    ).float()
    draft_probs = torch.full((6, vocab_size), 1.0 / vocab_size)
    out = rejection_sample(
        draft_token_ids=torch.tensor([t for d in drafts for t in d]),
        num_draft_tokens=[3, 2, 1],
        target_argmax=target_probs.argmax(-1),
        target_probs=target_probs * 3.0,  # unnormalised rows are fine
        is_greedy=torch.zeros(3, dtype=torch.bool),
        draft_probs=draft_probs,
        generators={},
    )
    assert emitted(out) == [reference_greedy(d, a) for d, a in zip(drafts, argmax)]


# --- shape, padding and degenerate rows --------------------------------------------------


def test_output_shape_and_padding():
    num_draft_tokens = [0, 2, 5, 1]
    out = rejection_sample(**random_inputs(num_draft_tokens, vocab_size=10, seed=2))
    assert out.shape == (4, 6) and out.dtype == torch.int64
    counts = num_accepted(out, num_draft_tokens)
    for row, k, accepted in zip(out.tolist(), num_draft_tokens, counts):
        assert 0 <= accepted <= k
        assert all(0 <= t < 10 for t in row[: accepted + 1])
        assert row[accepted + 1 :] == [PAD] * (len(row) - accepted - 1)


def test_empty_batch():
    out = rejection_sample(**random_inputs([], vocab_size=4, seed=0))
    assert out.shape == (0, 1)


def test_zero_probabilities_give_no_nan_and_stay_in_support():
    # Top-2 filtered target rows, draft rows with zeros too, and every draft on a token the
    # target forbids: each random request rejects its first draft and must emit one of the
    # two kept tokens. The last request's bonus row is all zero (only on bad input): it must
    # fall back to the argmax instead of producing garbage.
    vocab_size, num_draft_tokens = 8, [3, 1, 0]
    inputs = random_inputs(num_draft_tokens, vocab_size, seed=3)
    target_probs = inputs["target_probs"]
    kept = target_probs.topk(2, dim=-1).indices
    target_probs = torch.zeros_like(target_probs).scatter_(1, kept, target_probs.gather(1, kept))
    target_probs[-1] = 0.0
    forbidden = (target_probs == 0).float().argmax(-1)  # a zero-probability token per row
    draft_rows = [0, 1, 2, 4]  # the target rows of the four drafts
    draft_token_ids = forbidden[draft_rows]
    draft_probs = torch.nn.functional.one_hot(draft_token_ids, vocab_size).float() * 0.5
    draft_probs[:, (draft_token_ids + 1) % vocab_size] += 0.5
    for probs in (draft_probs, None):
        out = rejection_sample(
            **{
                **inputs,
                "draft_token_ids": draft_token_ids,
                "target_probs": target_probs,
                "target_argmax": target_probs.argmax(-1),
                "draft_probs": probs,
            }
        )
        assert num_accepted(out, num_draft_tokens) == [0, 0, 0]
        first = out[:, 0]
        assert target_probs[[0, 4], first[:2]].gt(0).all()
        assert first[2] == target_probs[-1].argmax()


# --- seeds ------------------------------------------------------------------------------


def test_seeded_request_independent_of_batch():
    num_draft_tokens = [4, 2, 5, 0, 3, 4]
    batch = random_inputs(num_draft_tokens, vocab_size=16, seed=4)
    seeds = {0: 10, 2: 11, 3: 12, 5: 13}
    starts = torch.tensor([0] + num_draft_tokens).cumsum(0).tolist()
    for global_seed in (0, 1):
        torch.manual_seed(global_seed)
        generators = {b: torch.Generator().manual_seed(s) for b, s in seeds.items()}
        out = rejection_sample(**{**batch, "generators": generators})
        for b, seed in seeds.items():
            k = num_draft_tokens[b]
            drafts = slice(starts[b], starts[b] + k)
            targets = slice(starts[b] + b, starts[b] + b + k + 1)
            alone = rejection_sample(
                draft_token_ids=batch["draft_token_ids"][drafts],
                num_draft_tokens=[k],
                target_argmax=batch["target_argmax"][targets],
                target_probs=batch["target_probs"][targets],
                is_greedy=torch.zeros(1, dtype=torch.bool),
                draft_probs=batch["draft_probs"][drafts],
                generators={0: torch.Generator().manual_seed(seed)},
            )
            assert emitted(alone) == [emitted(out)[b]]


def test_different_seeds_differ_and_draw_count_is_fixed():
    # Eight copies of one request: each seed decides its own outcome.
    k, vocab_size, num_reqs = 5, 16, 8
    one = random_inputs([k], vocab_size, seed=5)
    draft_rows, target_rows = one["draft_probs"], one["target_probs"]
    generators = {b: torch.Generator().manual_seed(100 + b) for b in range(num_reqs)}
    out = rejection_sample(
        draft_token_ids=one["draft_token_ids"].repeat(num_reqs),
        num_draft_tokens=[k] * num_reqs,
        target_argmax=one["target_argmax"].repeat(num_reqs),
        target_probs=target_rows.repeat(num_reqs, 1),
        is_greedy=torch.zeros(num_reqs, dtype=torch.bool),
        draft_probs=draft_rows.repeat(num_reqs, 1),
        generators=generators,
    )
    assert len({tuple(row) for row in out.tolist()}) > 1
    # Each generator was advanced by exactly k acceptance uniforms and one final uniform.
    for b, generator in generators.items():
        reference = torch.Generator().manual_seed(100 + b)
        torch.rand(k, generator=reference)
        torch.rand(1, generator=reference)
        assert torch.equal(torch.rand(3, generator=generator), torch.rand(3, generator=reference))


# --- statistical exactness ----------------------------------------------------------------

VOCAB_SIZE = 6
NUM_SEQUENCES = 20_000
NUM_SPEC_TOKENS = 3
START_TOKEN = 0


def markov_chains() -> tuple[torch.Tensor, torch.Tensor]:
    """Target P(next | prev) and a sharper, different draft Q(next | prev), both [V, V]."""
    gen = torch.Generator().manual_seed(2024)
    target = (torch.randn(VOCAB_SIZE, VOCAB_SIZE, generator=gen) * 0.7).softmax(-1)
    draft = (torch.randn(VOCAB_SIZE, VOCAB_SIZE, generator=gen) * 1.5).softmax(-1)
    return target, draft


def speculative_step(
    prev_token_ids: torch.Tensor,
    target: torch.Tensor,
    draft: torch.Tensor,
    random_drafts: bool,
    gen: torch.Generator,
) -> torch.Tensor:
    """Drafts NUM_SPEC_TOKENS tokens per sequence from Q and verifies them against P."""
    num_seqs = prev_token_ids.shape[0]
    token_ids, q_rows = [prev_token_ids], []
    for _ in range(NUM_SPEC_TOKENS):
        q = draft[token_ids[-1]]
        q_rows.append(q)
        if random_drafts:
            token_ids.append(torch.multinomial(q, 1, generator=gen).squeeze(1))
        else:
            token_ids.append(q.argmax(-1))
    # Sequence s owns rows s * (k + 1) ... : P after its prefix, each draft, then the bonus.
    target_probs = target[torch.stack(token_ids, dim=1)].reshape(-1, VOCAB_SIZE)
    draft_probs = torch.stack(q_rows, dim=1).reshape(-1, VOCAB_SIZE)
    # Rows scaled by random factors: the sampler must normalise p itself.
    row_scales = torch.rand(target_probs.shape[0], 1, generator=gen) + 0.2
    return rejection_sample(
        draft_token_ids=torch.stack(token_ids[1:], dim=1).reshape(-1),
        num_draft_tokens=[NUM_SPEC_TOKENS] * num_seqs,
        target_argmax=target_probs.argmax(-1),
        target_probs=target_probs * row_scales,
        is_greedy=torch.zeros(num_seqs, dtype=torch.bool),
        draft_probs=draft_probs if random_drafts else None,
        generators={},
    )


def generate_three(random_drafts: bool) -> tuple[torch.Tensor, float]:
    """The first three tokens of NUM_SEQUENCES speculative generations from START_TOKEN.

    A sequence with fewer than three tokens is continued from its last token, so every
    sequence's first three tokens are read off one unbroken speculative stream (keeping only
    sequences that emitted three in one step would bias toward accepted drafts).
    Returns the [S, 3] tokens and the mean number of drafts accepted in the first step.
    """
    torch.manual_seed(7)
    gen = torch.Generator().manual_seed(8)
    target, draft = markov_chains()
    tokens = torch.full((NUM_SEQUENCES, 3), PAD, dtype=torch.int64)
    num_tokens = torch.zeros(NUM_SEQUENCES, dtype=torch.int64)
    prev_token_ids = torch.full((NUM_SEQUENCES,), START_TOKEN, dtype=torch.int64)
    mean_accepted = -1.0
    while bool((num_tokens < 3).any()):
        active = (num_tokens < 3).nonzero().squeeze(1)
        out = speculative_step(prev_token_ids[active], target, draft, random_drafts, gen)
        num_emitted = (out != PAD).sum(dim=1)
        if mean_accepted < 0:
            mean_accepted = float(num_emitted.float().mean()) - 1
        for t in range(NUM_SPEC_TOKENS + 1):
            position = num_tokens[active] + t
            keep = (t < num_emitted) & (position < 3)
            tokens[active[keep], position[keep]] = out[keep, t]
        prev_token_ids[active] = out.gather(1, (num_emitted - 1).unsqueeze(1)).squeeze(1)
        num_tokens[active] += num_emitted
    return tokens, mean_accepted


def chi_square(tokens: torch.Tensor) -> tuple[float, float]:
    """Chi-square of the joint (y1, y2, y3) counts against the target chain from START_TOKEN.

    Cells expecting fewer than 5 are pooled into one. The critical value for p = 0.001 is the
    Wilson-Hilferty approximation df * (1 - 2 / (9 df) + z sqrt(2 / (9 df)))^3 with z = 3.0902
    (the 0.999 normal quantile); it is within 0.5% of the exact quantile for df > 30.
    Returns (statistic, critical value).
    """
    target, _ = markov_chains()
    v = VOCAB_SIZE
    expected = (
        target[START_TOKEN].view(v, 1, 1) * target.view(v, v, 1) * target.view(1, v, v)
    ).reshape(-1) * tokens.shape[0]
    cells = tokens[:, 0] * v * v + tokens[:, 1] * v + tokens[:, 2]
    observed = torch.bincount(cells, minlength=v**3).double()
    small = expected < 5
    assert small.any(), "the pooled cell must not be empty"
    expected = torch.cat([expected[~small], expected[small].sum().view(1)]).double()
    observed = torch.cat([observed[~small], observed[small].sum().view(1)])
    statistic = float(((observed - expected) ** 2 / expected).sum())
    df = expected.shape[0] - 1
    critical = df * (1 - 2 / (9 * df) + 3.0902 * math.sqrt(2 / (9 * df))) ** 3
    return statistic, critical


def test_random_drafts_emit_target_distribution():
    tokens, mean_accepted = generate_three(random_drafts=True)
    # The draft must disagree with the target often, or the test would prove little.
    assert 0.5 < mean_accepted < 2.0, mean_accepted
    statistic, critical = chi_square(tokens)
    assert statistic < critical, (statistic, critical)


def test_deterministic_drafts_emit_target_distribution():
    tokens, mean_accepted = generate_three(random_drafts=False)
    assert 0.1 < mean_accepted < 2.0, mean_accepted
    statistic, critical = chi_square(tokens)
    assert statistic < critical, (statistic, critical)
