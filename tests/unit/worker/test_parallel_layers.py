"""TP layers over gloo in two spawned processes equal the unsplit layers; the PP layer split
and the start-up size checks.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from kvserve.services.worker.parallel_check import verify_parallel_sizes
from kvserve.services.worker.parallel_state import pp_layer_range
from tests.support.distributed import init_two_ranks, leave_two_ranks, run_two_ranks

VOCAB, HIDDEN, NUM_TOKENS = 10, 8, 6


def _tp_layers_worker(rank: int, store_path: str, out_path: str) -> None:
    from kvserve.services.worker.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
    from kvserve.services.worker.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )

    init_two_ranks(rank, store_path, tp=2, pp=1)
    try:
        torch.manual_seed(0)  # both ranks draw the same full weights and inputs
        results = {}
        # Every id of the vocabulary, so both ranks' halves and the masking are exercised.
        ids = torch.tensor([0, 9, 4, 5, 1, 8, 3, 7, 2, 6])
        table = torch.randn(VOCAB, HIDDEN)
        embed = VocabParallelEmbedding(VOCAB, HIDDEN)
        embed.weight.weight_loader(embed.weight, table)
        results["embedding"] = (embed(ids), F.embedding(ids, table))

        hidden = torch.randn(NUM_TOKENS, HIDDEN)
        head = ParallelLMHead(VOCAB, HIDDEN)
        head.weight.weight_loader(head.weight, table)
        results["lm_head"] = (head(hidden), F.linear(hidden, table))

        # Row-parallel: each rank holds half of the input features and the sum is all-reduced;
        # the bias is added once.
        weight, bias = torch.randn(5, 12), torch.randn(5)
        x = torch.randn(NUM_TOKENS, 12)
        row = RowParallelLinear(12, 5, bias=True)
        row.weight.weight_loader(row.weight, weight)
        row.bias.weight_loader(row.bias, bias)
        results["row"] = (row(x[:, rank * 6 : (rank + 1) * 6]), F.linear(x, weight, bias))

        weight, bias = torch.randn(6, HIDDEN), torch.randn(6)
        column = ColumnParallelLinear(HIDDEN, 6, bias=True)
        column.weight.weight_loader(column.weight, weight)
        column.bias.weight_loader(column.bias, bias)
        results["column"] = (
            column(hidden),
            F.linear(hidden, weight, bias)[:, rank * 3 : (rank + 1) * 3],
        )

        # GQA: 4 query heads, 2 KV heads of size 2; rank r holds q heads 2r, 2r+1 and KV head r.
        q, k, v = torch.randn(8, HIDDEN), torch.randn(4, HIDDEN), torch.randn(4, HIDDEN)
        qkv = QKVParallelLinear(HIDDEN, 2, 4, 2)
        for shard_id, part in zip("qkv", (q, k, v)):
            qkv.weight.weight_loader(qkv.weight, part, shard_id)
        local = torch.cat(
            [
                q[rank * 4 : (rank + 1) * 4],
                k[rank * 2 : (rank + 1) * 2],
                v[rank * 2 : (rank + 1) * 2],
            ]
        )
        results["qkv"] = (qkv(hidden), F.linear(hidden, local))

        gate, up = torch.randn(6, HIDDEN), torch.randn(6, HIDDEN)
        merged = MergedColumnParallelLinear(HIDDEN, [6, 6])
        merged.weight.weight_loader(merged.weight, gate, 0)
        merged.weight.weight_loader(merged.weight, up, 1)
        local = torch.cat([gate[rank * 3 : (rank + 1) * 3], up[rank * 3 : (rank + 1) * 3]])
        results["merged"] = (merged(hidden), F.linear(hidden, local))
        torch.save(results, f"{out_path}.{rank}")
    finally:
        leave_two_ranks()


def test_tp2_layers_equal_the_unsplit_ones(tmp_path):
    out_path = str(tmp_path / "results")
    run_two_ranks(_tp_layers_worker, (str(tmp_path / "store"), out_path))
    for rank in range(2):
        results = torch.load(f"{out_path}.{rank}")
        assert set(results) == {"embedding", "lm_head", "row", "column", "qkv", "merged"}
        for name, (got, expected) in results.items():
            torch.testing.assert_close(
                got,
                expected,
                atol=1e-5,
                rtol=1e-5,
                msg=lambda m, n=name, r=rank: f"{n}, rank {r}: {m}",
            )


def _pp_model_worker(rank: int, store_path: str, model_dir: str, out_path: str) -> None:
    from kvserve.services.worker.models import load_model
    from kvserve.services.worker.models.llama import PPMissingLayer

    init_two_ranks(rank, store_path, tp=1, pp=2)
    try:
        model, _ = load_model(model_dir, torch.float32, "cpu")
        layers = model.model.layers
        summary = {
            "has_embedding": model.model.embed_tokens is not None,
            "has_norm": model.model.norm is not None,
            "has_lm_head": model.lm_head is not None,
            "real_layers": [
                i for i, layer in enumerate(layers) if not isinstance(layer, PPMissingLayer)
            ],
            "lm_head": None if model.lm_head is None else model.lm_head.weight.clone(),
        }
        torch.save(summary, f"{out_path}.{rank}")
    finally:
        leave_two_ranks()


def test_pp2_stages_hold_their_layers_and_load_a_tied_head(tiny_checkpoint, tmp_path):
    # llama3_rope has tied embeddings: the last stage must load its LM head from the
    # checkpoint's embedding, which it does not hold itself.
    model_dir, hf_model = tiny_checkpoint("llama3_rope")
    out_path = str(tmp_path / "summary")
    run_two_ranks(_pp_model_worker, (str(tmp_path / "store"), model_dir, out_path))
    first, last = torch.load(f"{out_path}.0"), torch.load(f"{out_path}.1")
    assert (first["has_embedding"], first["has_norm"], first["has_lm_head"]) == (True, False, False)
    assert (last["has_embedding"], last["has_norm"], last["has_lm_head"]) == (False, True, True)
    assert first["real_layers"] == [0] and last["real_layers"] == [1]
    torch.testing.assert_close(last["lm_head"], hf_model.model.embed_tokens.weight)


@pytest.mark.parametrize(
    "num_layers, pp_size, expected",
    [
        (30, 1, [(0, 30)]),
        (30, 4, [(0, 8), (8, 16), (16, 23), (23, 30)]),
        (4, 2, [(0, 2), (2, 4)]),
        (5, 5, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]),
    ],
)
def test_pp_layer_range_covers_every_layer_once(num_layers, pp_size, expected):
    assert [pp_layer_range(num_layers, r, pp_size) for r in range(pp_size)] == expected


def _config(**overrides):
    sizes = dict(
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
        num_hidden_layers=30,
    )
    return types.SimpleNamespace(**{**sizes, **overrides})


def test_verify_parallel_sizes_names_what_does_not_divide():
    verify_parallel_sizes(_config(), 3, 1)
    verify_parallel_sizes(_config(), 1, 30)
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size=2 .*num_attention_heads=9, "
        r"num_key_value_heads=3; .*fit this model: \[1, 3\]",
    ):
        verify_parallel_sizes(_config(), 2, 1)
    with pytest.raises(ValueError, match=r"vocab_size=49153"):
        verify_parallel_sizes(_config(vocab_size=49153), 3, 1)
    with pytest.raises(ValueError, match=r"intermediate_size=1537"):
        verify_parallel_sizes(_config(intermediate_size=1537), 3, 1)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=31 exceeds"):
        verify_parallel_sizes(_config(), 1, 31)
    with pytest.raises(ValueError, match="at least 1"):
        verify_parallel_sizes(_config(), 0, 1)
