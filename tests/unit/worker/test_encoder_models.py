"""Encoder models (BERT, XLM-RoBERTa, ModernBERT) through a real in-process engine: tiny
random-weight folders in sentence-transformers layout, pooled alone and batched, equal to
sentence-transformers' embeddings of the same folder to 1e-5; cross-encoders' logits equal HF
AutoModelForSequenceClassification's with the pair's token types; every request computed in
one step, no block kept; generation refused.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from kvserve.kernels import gemm
from kvserve.services.scheduler.engine.engine_core import EngineCore
from kvserve.services.worker.layers.bidirectional import EncoderBatch
from kvserve.shared.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvserve.shared.messages import EngineCoreRequest
from kvserve.shared.sampling_params import SamplingParams
from tests.support.encoders import (
    build_cross_encoder,
    build_encoder,
    hf_pair_scores,
    st_embeddings,
)
from tests.support.kv import assert_no_leaked_blocks

# The ModernBERT window reaches 4 tokens each side: the long text crosses many windows.
TEXTS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog near the river bank",
    "a",
    "paris is the capital of france.",
]
# (kind, pooling, normalize) per embedding folder.
ENCODERS = {
    "bert-mean": ("bert", "mean", True),
    "xlmr-cls": ("xlm-roberta", "cls", True),
    "modernbert-mean": ("modernbert", "mean", False),
}
_POOLING = {"mean": "mean", "cls": "cls", "lasttoken": "last"}


def _engine(model_dir: str, cpu_gemm: str = "auto") -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(model=model_dir, dtype="float32", cpu_gemm=cpu_gemm),
        cache=CacheConfig(block_size=16),
        # A budget below the longest input: the encoder config raises it to max_model_len.
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
    )
    return EngineCore(config, model_dir)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """name -> (EngineCore, model folder), built once."""
    cache: dict[str, tuple[EngineCore, str]] = {}

    def get(name: str):
        if name not in cache:
            folder = str(tmp_path_factory.mktemp(name))
            if name in ENCODERS:
                kind, pooling, normalize = ENCODERS[name]
                build_encoder(folder, kind, pooling, normalize)
            else:
                kind, num_labels = name.split("-ce")[0], int(name.rsplit("-", 1)[1])
                build_cross_encoder(folder, kind, num_labels)
            cache[name] = (_engine(folder), folder)
        return cache[name]

    yield get
    for core, _ in cache.values():
        core.shutdown()


def _pool(core: EngineCore, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    """Each prompt's pooled vector; every request ends the step it is scheduled in."""
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        core.add_request(EngineCoreRequest(f"r{i}", prompt, p))
    vectors: dict[str, np.ndarray] = {}
    while core.scheduler.has_requests():
        for out in core.step().outputs:
            assert out.error is None, out.error
            assert out.pooled is not None and out.finish_reason is not None
            vectors[out.request_id] = np.frombuffer(out.pooled, dtype=np.float32)
    assert_no_leaked_blocks(core.scheduler)
    return [vectors[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("name", list(ENCODERS))
def test_embeddings_equal_sentence_transformers_alone_and_batched(engines, name):
    core, folder = engines(name)
    _, pooling, normalize = ENCODERS[name]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = [tokenizer(text)["input_ids"] for text in TEXTS]
    params = SamplingParams(max_tokens=1, pooling=_POOLING[pooling], normalize=normalize)
    expected = st_embeddings(folder, TEXTS).numpy()
    batched = _pool(core, prompts, [params] * len(prompts))
    alone = [_pool(core, [prompt], [params])[0] for prompt in prompts]
    for got in (batched, alone):
        for vector, want in zip(got, expected, strict=True):
            cosine = vector @ want / (np.linalg.norm(vector) * np.linalg.norm(want))
            assert cosine == pytest.approx(1.0, abs=1e-5)
            np.testing.assert_allclose(vector, want, atol=1e-5)


@pytest.mark.parametrize("name", ["bert-ce-1", "xlm-roberta-ce-1", "modernbert-ce-3"])
def test_cross_encoder_logits_equal_hf_with_pair_token_types(engines, name):
    core, folder = engines(name)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    query, documents = "what is a fox", ["a fox is an animal", "paris is in france", "x"]
    kind = name.split("-ce")[0]
    pooling = "mean" if kind == "modernbert" else "cls"
    prompts, params = [], []
    for document in documents:
        encoded = tokenizer(query, document, return_token_type_ids=True)
        start = encoded["token_type_ids"].index(1) if kind == "bert" else None
        prompts.append(encoded["input_ids"])
        params.append(SamplingParams(max_tokens=1, pooling=pooling, token_type_start=start))
    logits = np.stack(_pool(core, prompts, params))
    np.testing.assert_allclose(logits, hf_pair_scores(folder, query, documents), atol=1e-4)


@pytest.mark.skipif(not gemm.onednn_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("name", ["bert-mean", "modernbert-mean", "bert-ce-1"])
def test_encoder_linears_take_the_cpu_gemm_plan_and_still_match(tmp_path, name):
    """--cpu-gemm onednn: every linear layer of the encoder (and of a cross-encoder's head)
    holds oneDNN's packed weight, as a decoder's do, with the same outputs."""
    folder = str(tmp_path)
    if name in ENCODERS:
        kind, pooling, normalize = ENCODERS[name]
        build_encoder(folder, kind, pooling, normalize)
    else:
        kind, pooling, normalize = "bert", "cls", False
        build_cross_encoder(folder, kind, 1)
    core = _engine(folder, cpu_gemm="onednn")
    try:
        model = core.executor.worker.runner.model
        linears = [m for m in model.modules() if hasattr(m, "gemm")]
        assert linears and all(m.gemm is not None and m.gemm.packed is not None for m in linears)
        assert not any(type(m) is torch.nn.Linear for m in model.modules())
        tokenizer = AutoTokenizer.from_pretrained(folder)
        if name in ENCODERS:
            prompts = [tokenizer(text)["input_ids"] for text in TEXTS]
            params = SamplingParams(max_tokens=1, pooling=_POOLING[pooling], normalize=normalize)
            got = np.stack(_pool(core, prompts, [params] * len(prompts)))
            np.testing.assert_allclose(got, st_embeddings(folder, TEXTS).numpy(), atol=1e-5)
        else:
            query, documents = "what is a fox", ["a fox is an animal", "paris is in france"]
            encoded = [tokenizer(query, d, return_token_type_ids=True) for d in documents]
            params = [
                SamplingParams(
                    max_tokens=1, pooling="cls", token_type_start=e["token_type_ids"].index(1)
                )
                for e in encoded
            ]
            logits = np.stack(_pool(core, [e["input_ids"] for e in encoded], params))
            want = hf_pair_scores(folder, query, documents)
            np.testing.assert_allclose(logits, want, atol=1e-4)
    finally:
        core.shutdown()


def test_an_encoder_refuses_generation_and_frees_everything(engines):
    core, _ = engines("bert-mean")
    core.add_request(EngineCoreRequest("gen", [2, 10, 3], SamplingParams(max_tokens=4)))
    outputs = [out for _ in range(2) for out in core.step().outputs]
    assert outputs and outputs[0].error is not None and "encoder" in outputs[0].error
    assert_no_leaked_blocks(core.scheduler)


def test_encoder_batch_pads_unequal_requests_and_masks_their_keys():
    batch = EncoderBatch(torch.tensor([0, 3, 5]))
    rows = torch.arange(5.0)[:, None]
    padded = batch.pad(rows)
    assert padded[:, :, 0].tolist() == [[0, 1, 2], [3, 4, 0]]
    assert torch.equal(batch.unpad(padded), rows)
    mask = batch.mask(None)
    assert mask is not None and mask[:, 0, 0].tolist() == [[True] * 3, [True, True, False]]
    window = batch.mask(1)
    assert window is not None and window[0, 0].tolist() == [
        [True, True, False],
        [True, True, True],
        [False, True, True],
    ]
    assert EncoderBatch(torch.tensor([0, 2, 4])).mask(None) is None  # equal: no mask at all


def test_encoder_batch_reuses_its_padded_buffers_and_keeps_the_padding_zero():
    batch = EncoderBatch(torch.tensor([0, 3, 5]))
    first = batch.pad(torch.ones(5, 2), buffer=0)
    other = batch.pad(torch.full((5, 2), 7.0), buffer=1)
    again = batch.pad(torch.full((5, 2), 3.0), buffer=0)
    assert again.data_ptr() == first.data_ptr() != other.data_ptr()
    assert again[:, :, 0].tolist() == [[3, 3, 3], [3, 3, 0]]
    assert other[:, :, 0].tolist() == [[7, 7, 7], [7, 7, 0]]
