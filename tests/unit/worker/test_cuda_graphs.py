"""The CUDA graph path of decode steps (services/worker/cuda_graphs.py): sizes, padding and
the static buffers on CPU (EagerBackend runs the same path without a graph), and on a GPU
the captured graphs against eager steps."""

from __future__ import annotations

import pytest
import torch

from kvserve.services.worker.cuda_graphs import (
    DecodeGraphs,
    EagerBackend,
    capture_sizes,
    cuda_graphs_unsupported,
)
from kvserve.services.worker.layers.attention import Attention
from kvserve.services.worker.models import load_model
from kvserve.shared.config import EngineConfig
from tests.support.model_steps import BLOCK_SIZE, bind_kv_caches, build_step, random_tokens
from tests.support.models import TINY_KV_CACHE_MEMORY

MAX_BLOCKS_PER_SEQ = 3
# (prompt tokens, block ids) of each request; block 0 is the null block, never handed out.
REQUESTS = [
    (random_tokens(5, 96, seed=10), [7, 3, 9]),
    (random_tokens(3, 96, seed=11), [1, 5]),
    (random_tokens(8, 96, seed=12), [2, 11, 4]),
]


def test_default_sizes_cap_at_the_largest_step():
    assert capture_sizes(None, 256, 2048) == [1, 2, 4, *range(8, 257, 8)]
    assert capture_sizes(None, 10, 2048) == [1, 2, 4, 8, 10]
    assert capture_sizes(None, 512, 2048)[-1] == 256  # larger steps run eagerly
    assert capture_sizes(None, 64, 6) == [1, 2, 4, 6]  # the token budget caps too


def test_given_sizes_are_sorted_deduplicated_and_capped():
    assert capture_sizes([8, 1, 4, 4, 64], 16, 2048) == [1, 4, 8]
    assert capture_sizes([], 16, 2048) == []


def test_graphs_only_on_one_cuda_rank_without_enforce_eager():
    cuda = torch.device("cuda", 0)
    config = EngineConfig.from_kwargs()
    assert cuda_graphs_unsupported(config, torch.device("cpu")) == "not a CUDA device"
    assert cuda_graphs_unsupported(config, cuda) is None
    eager = EngineConfig.from_kwargs(enforce_eager=True)
    assert cuda_graphs_unsupported(eager, cuda) == "--enforce-eager"
    tp2 = EngineConfig.from_kwargs(tensor_parallel_size=2)
    assert "TP x PP" in cuda_graphs_unsupported(tp2, cuda)


def _graphs(forward, sizes=(1, 2, 4, 8)) -> DecodeGraphs:
    graphs = DecodeGraphs(
        forward,
        list(sizes),
        MAX_BLOCKS_PER_SEQ,
        MAX_BLOCKS_PER_SEQ * BLOCK_SIZE,
        torch.device("cpu"),
        EagerBackend(),
    )
    graphs.capture()
    return graphs


def test_a_step_pads_to_the_nearest_captured_size():
    graphs = _graphs(lambda ids, pos, md: torch.zeros(ids.shape[0], 1), sizes=(8, 1, 4, 2))
    assert [graphs.padded_size(n) for n in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, None]
    assert graphs.can_run(num_reqs=5, num_tokens=5, max_query_len=1)
    assert not graphs.can_run(num_reqs=9, num_tokens=9, max_query_len=1)  # too many
    assert not graphs.can_run(num_reqs=2, num_tokens=5, max_query_len=4)  # a prefill chunk


def test_padding_rows_skip_kv_writes_and_read_the_null_block():
    seen = []
    graphs = _graphs(lambda ids, pos, md: seen.append(md) or torch.zeros(ids.shape[0], 1))
    *_, metadata = build_step([([3], 4, [6, 2]), ([5], 1, [8])])
    seen.clear()
    out = graphs.run(torch.tensor([3, 5]), torch.tensor([4, 1]), metadata)
    assert out.shape == (2, 1)
    (md,) = seen
    assert md.query_start_loc.tolist() == [0, 1, 2]  # size 2: no padding
    graphs.run(torch.tensor([3]), torch.tensor([4]), build_step([([3], 4, [6, 2])])[2])
    *_, md3 = build_step([([3], 4, [6, 2]), ([5], 1, [8]), ([7], 0, [10])])
    seen.clear()
    graphs.run(torch.tensor([3, 5, 7]), torch.tensor([4, 1, 0]), md3)
    (md,) = seen  # 3 tokens -> size 4
    assert md.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert md.slot_mapping.tolist() == [2 * 4 + 0, 8 * 4 + 1, 10 * 4 + 0, -1]  # slot -1: no write
    assert md.seq_lens.tolist() == [5, 2, 1, 1]  # the padding row reads the null block
    assert md.block_table[:, 0].tolist() == [6, 8, 10, 0]
    assert md.block_table.shape == (4, MAX_BLOCKS_PER_SEQ)
    assert md.max_query_len == 1


@pytest.fixture
def tiny_model(tiny_checkpoint):
    model_dir, _ = tiny_checkpoint("llama")
    model, _ = load_model(model_dir, torch.float32, "cpu")
    bind_kv_caches(model)
    return model


def _kv_caches(model) -> list[torch.Tensor]:
    return [m.kv_cache for m in model.modules() if isinstance(m, Attention)]


def _decode_inputs(num_reqs: int, step: int):
    """Decode token `step` (0, 1, ...) after each prompt of the first num_reqs REQUESTS."""
    return build_step(
        [
            ([(17 * step + i) % 96], len(tokens) + step, block_ids)
            for i, (tokens, block_ids) in enumerate(REQUESTS[:num_reqs])
        ]
    )


@torch.no_grad()
def test_padded_decode_steps_match_eager_steps(tiny_model):
    model = tiny_model
    forward = lambda ids, pos, md: model(ids, pos, md)  # noqa: E731
    model(*build_step([(tokens, 0, block_ids) for tokens, block_ids in REQUESTS]))
    prefilled = [c.clone() for c in _kv_caches(model)]
    graphs = _graphs(forward, sizes=(1, 2, 4))
    for cache, before in zip(_kv_caches(model), prefilled):
        torch.testing.assert_close(cache, before, rtol=0, atol=0)  # capture wrote nothing

    # Graph path first, then the same steps eagerly from the same cache: 3 requests pad to 4,
    # then 2 (a size of its own, over stale rows of the larger step), then 3 again.
    schedule = [(3, 0), (2, 1), (3, 1)]
    padded = [model.compute_logits(graphs.run(*_decode_inputs(n, s))) for n, s in schedule]
    padded_caches = [c.clone() for c in _kv_caches(model)]
    for cache, before in zip(_kv_caches(model), prefilled):
        cache.copy_(before)
    eager = [model.compute_logits(model(*_decode_inputs(n, s))) for n, s in schedule]
    assert graphs.num_replays == len(schedule)
    for got, want in zip(padded, eager):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for got, want in zip(padded_caches, _kv_caches(model)):
        # 4-row GEMMs round differently from 3-row ones; padding rows wrote nothing.
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        assert not got[:, 0].any(), "the null block stays zero"


def _runner(llm):
    return llm.engine_core.executor.worker.runner


def _greedy(llm, prompts, max_tokens=6) -> list[list[int]]:
    from kvserve import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


PROMPTS = ["hello there", "one two three four", "a"]


def test_model_runner_decodes_through_the_static_buffers(tiny_llama_dir):
    """The runner's hook: its decode steps through DecodeGraphs (eager backend, padded
    sizes) give the tokens of its plain eager steps."""
    from kvserve import LLM

    llm = LLM(tiny_llama_dir, kv_cache_memory=TINY_KV_CACHE_MEMORY, enable_prefix_caching=False)
    runner = _runner(llm)
    assert runner.cuda_graphs is None  # a CPU captures none
    want = _greedy(llm, PROMPTS)
    runner.cuda_graphs = DecodeGraphs(
        runner._run_stage,
        [2, 4],  # 3 requests pad to 4; 1 request (the last one left) runs eagerly
        runner.input_batch.block_table.shape[1],
        runner.max_model_len,
        runner.device,
        EagerBackend(),
    )
    runner.cuda_graphs.capture()
    assert _greedy(llm, PROMPTS) == want
    assert runner.cuda_graphs.num_replays > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_decode_matches_enforce_eager(tiny_llama_dir):
    from kvserve import LLM

    tokens = {}
    for enforce_eager in (True, False):
        llm = LLM(
            tiny_llama_dir,
            dtype="float32",
            kv_cache_memory=TINY_KV_CACHE_MEMORY,
            enforce_eager=enforce_eager,
            max_num_seqs=8,
        )
        graphs = _runner(llm).cuda_graphs
        assert (graphs is None) == enforce_eager
        tokens[enforce_eager] = _greedy(llm, PROMPTS, max_tokens=12)
        if graphs is not None:
            assert graphs.sizes == [1, 2, 4, 8]
            assert graphs.num_replays > 0
        del llm
    assert tokens[False] == tokens[True]
