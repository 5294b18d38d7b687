"""The fused mixture-of-experts path against a per-expert loop written from the definition."""

from __future__ import annotations

import pytest
import torch

from kvserve.services.worker.layers.fused_moe import FusedMoE, fused_experts, select_experts


def _naive_moe(x, w13, w2, router_logits, top_k, renormalize):
    probs = torch.softmax(router_logits.double(), dim=-1)
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        weights, experts = probs[t].topk(top_k)
        if renormalize:
            weights = weights / weights.sum()
        for w, e in zip(weights, experts.tolist()):
            gate_up = w13[e].double() @ x[t].double()
            act = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += w * (w2[e].double() @ act)
    return out


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("num_tokens", [0, 1, 3, 40])
@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_experts_match_per_expert_loop(dtype, atol, num_tokens, renormalize):
    torch.manual_seed(num_tokens)
    num_experts, top_k, hidden, inter = 6, 2, 32, 24
    x = torch.randn(num_tokens, hidden).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden) * 0.2).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter) * 0.2).to(dtype)
    router_logits = torch.randn(num_tokens, num_experts)
    # With 1 or 3 tokens most experts get no rows: empty groups must be harmless.
    weights, expert_ids = select_experts(router_logits, top_k, renormalize)
    got = fused_experts(x, w13, w2, weights, expert_ids)
    expected = _naive_moe(x, w13, w2, router_logits, top_k, renormalize)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), expected, atol=atol, rtol=atol)


def test_weight_loader_places_each_expert_and_shard():
    moe = FusedMoE(num_experts=3, top_k=1, hidden_size=4, intermediate_size=5)
    w1, w3, w2 = torch.randn(5, 4), torch.randn(5, 4), torch.randn(4, 5)
    moe.weight_loader(moe.w13_weight, w1, (2, "w1"))
    moe.weight_loader(moe.w13_weight, w3, (2, "w3"))
    moe.weight_loader(moe.w2_weight, w2, (2, "w2"))
    assert torch.equal(moe.w13_weight[2], torch.cat([w1, w3]))
    assert torch.equal(moe.w2_weight[2], w2)
    with pytest.raises(ValueError, match="expert 1 w1"):
        moe.weight_loader(moe.w13_weight, torch.randn(6, 4), (1, "w1"))
