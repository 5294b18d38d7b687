"""One step of our model's forward over a paged KV cache, built by hand, and its comparison with
HF transformers: the worker tests' shared pieces (tests/unit/worker/test_model.py,
test_model_families.py)."""

from __future__ import annotations

import torch

from kvserve.services.worker.layers.attention import Attention, AttentionMetadata
from kvserve.services.worker.models import load_model
from tests.support.distributed import init_two_ranks, leave_two_ranks, run_two_ranks

ATOL = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 12


def bind_kv_caches(
    model: torch.nn.Module, num_blocks: int = NUM_BLOCKS, block_size: int = BLOCK_SIZE
) -> None:
    for module in model.modules():
        if isinstance(module, Attention):  # the layer's own layout (MLA: one latent plane)
            module.kv_cache = module.kv_cache_spec().allocate(
                num_blocks, block_size, torch.get_default_dtype(), "cpu"
            )


def build_step(requests: list[tuple[list[int], int, list[int]]], block_size: int = BLOCK_SIZE):
    """requests: (new token ids, tokens already in the cache, block ids). Returns the model
    inputs (input_ids, positions, AttentionMetadata) of one step."""
    input_ids, positions, slots, query_start_loc, seq_lens = [], [], [], [0], []
    for token_ids, num_computed, block_ids in requests:
        for pos in range(num_computed, num_computed + len(token_ids)):
            positions.append(pos)
            slots.append(block_ids[pos // block_size] * block_size + pos % block_size)
        input_ids += token_ids
        query_start_loc.append(query_start_loc[-1] + len(token_ids))
        seq_lens.append(num_computed + len(token_ids))
    max_blocks = max(len(block_ids) for _, _, block_ids in requests)
    block_table = [block_ids + [0] * (max_blocks - len(block_ids)) for *_, block_ids in requests]
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.tensor(block_table, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(len(token_ids) for token_ids, *_ in requests),
        max_seq_len=max(seq_lens),
    )
    return torch.tensor(input_ids), torch.tensor(positions), metadata


@torch.no_grad()
def run_step(model, requests, block_size: int = BLOCK_SIZE) -> list[torch.Tensor]:
    """Logits [query_len, vocab] of every token of each request, from one flattened call."""
    input_ids, positions, metadata = build_step(requests, block_size)
    logits = model.compute_logits(model(input_ids, positions, metadata))
    assert logits.dtype == torch.float32
    return list(logits.split([len(token_ids) for token_ids, *_ in requests]))


@torch.no_grad()
def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([token_ids])).logits[0].float()


def random_tokens(n: int, vocab_size: int, seed: int) -> list[int]:
    return torch.randint(
        0, vocab_size, (n,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


def _tp_worker(
    rank: int, model_dir: str, store_path: str, out_path: str, requests, num_blocks: int
) -> None:
    init_two_ranks(rank, store_path, tp=2)
    try:
        model, _ = load_model(model_dir, torch.float32, "cpu")
        bind_kv_caches(model, num_blocks=num_blocks)
        logits = run_step(model, requests)
        if rank == 0:
            torch.save(logits, out_path)
    finally:
        leave_two_ranks()


def assert_tensor_parallel_2_matches_hf(
    tmp_path, model_dir: str, hf_model, requests, num_blocks: int = NUM_BLOCKS
) -> None:
    """Two gloo ranks run one step of requests (whole prompts: (tokens, 0, block ids)) on
    model_dir with num_blocks KV blocks; rank 0's logits must equal HF's."""
    out_path = str(tmp_path / "logits.pt")
    args = (model_dir, str(tmp_path / "store"), out_path, requests, num_blocks)
    run_two_ranks(_tp_worker, args)
    logits = torch.load(out_path)
    assert len(logits) == len(requests)
    for step_logits, (tokens, _, _) in zip(logits, requests):
        torch.testing.assert_close(step_logits, hf_logits(hf_model, tokens), atol=ATOL, rtol=0)
