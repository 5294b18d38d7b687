"""The engine core refuses what the api should have caught, one ERROR output per request,
and keeps stepping: a real EngineCore over the tiny random model.

Each bad request here would otherwise fail a whole step (an embedding row past the
vocabulary, a NaN in the sampler, top-k wider than the logits) and with it the engine.
"""

from __future__ import annotations

import pytest

from kvserve.services.scheduler.engine.engine_core import EngineCore
from kvserve.shared.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvserve.shared.messages import EngineCoreRequest, FinishReason
from kvserve.shared.sampling_params import SamplingParams
from kvserve.shared.wire import QUEUE_FULL_ERROR
from tests.support.models import TINY_EOS_TOKEN_ID, TINY_KV_CACHE_MEMORY, TINY_VOCAB_SIZE

MAX_WAITING = 3


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    config = EngineConfig(
        model=ModelConfig(model=tiny_llama_dir),
        cache=CacheConfig(kv_cache_memory_bytes=TINY_KV_CACHE_MEMORY),
        scheduler=SchedulerConfig(max_num_seqs=1, max_waiting_requests=MAX_WAITING),
    )
    core = EngineCore(config, tiny_llama_dir, bound_waiting=True)  # as the engine process
    yield core
    core.shutdown()


def make_request(req_id: str, prompt=(1, 2, 3), eos=TINY_EOS_TOKEN_ID, **params_fields):
    """A request as a foreign client could send it: `params_fields` are set after
    SamplingParams' own checks ran (msgpack from another api carries what it likes)."""
    params = SamplingParams(max_tokens=2, temperature=0.0)
    for name, value in params_fields.items():
        setattr(params, name, value)
    return EngineCoreRequest(req_id, list(prompt), params, eos_token_id=eos)


def run(engine: EngineCore, max_steps: int = 100) -> dict[str, list]:
    """Step until idle; each request's outputs."""
    outputs: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return outputs
        for out in engine.step().outputs:
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError("the engine never went idle")


BAD = {
    "prompt-past-vocab": (dict(prompt=[1, TINY_VOCAB_SIZE]), "prompt_token_ids"),
    "negative-prompt-id": (dict(prompt=[-1, 2]), "prompt_token_ids"),
    "nan-temperature": (dict(temperature=float("nan")), "temperature"),
    "inf-top-p": (dict(top_p=float("inf")), "top_p"),
    "nan-penalty": (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    "nan-logit-bias": (dict(logit_bias={5: float("nan")}), "logit_bias"),
    "logit-bias-past-vocab": (dict(logit_bias={10**6: 1.0}), "logit_bias"),
    "stop-id-past-vocab": (dict(stop_token_ids=[10**6]), "stop_token_ids"),
    "allowed-past-vocab": (dict(allowed_token_ids=[TINY_VOCAB_SIZE]), "allowed_token_ids"),
    "bad-words-past-vocab": (dict(bad_words_token_ids=[[3, 10**6]]), "bad_words_token_ids"),
    "huge-logprobs": (dict(logprobs=10**6), "logprobs"),
    "huge-prompt-logprobs": (dict(prompt_logprobs=10**6), "prompt_logprobs"),
    "seed-past-64-bits": (dict(seed=2**64), "seed"),
    "eos-past-vocab": (dict(eos=10**6), "eos_token_id"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_request_is_an_error_output_and_the_engine_serves_on(engine, name):
    fields, blamed = BAD[name]
    engine.add_request(make_request(name, **fields))
    engine.add_request(make_request(f"{name}-good"))
    outputs = run(engine)
    (refused,) = outputs[name]
    assert refused.finish_reason == FinishReason.ERROR
    assert blamed in refused.error, refused.error
    good = outputs[f"{name}-good"]
    assert good[-1].finish_reason == FinishReason.LENGTH
    assert sum(len(out.new_token_ids) for out in good) == 2


def test_past_max_waiting_requests_is_refused_as_queue_full(engine):
    for i in range(MAX_WAITING + 2):
        engine.add_request(make_request(f"q{i}"))
    assert engine.num_waiting_requests == MAX_WAITING
    outputs = run(engine)
    for i in range(MAX_WAITING):
        assert outputs[f"q{i}"][-1].finish_reason == FinishReason.LENGTH
    for i in range(MAX_WAITING, MAX_WAITING + 2):
        (refused,) = outputs[f"q{i}"]
        assert refused.finish_reason == FinishReason.ERROR
        assert refused.error.startswith(QUEUE_FULL_ERROR)
    # The queue drained: new requests are taken again.
    engine.add_request(make_request("after"))
    assert run(engine)["after"][-1].finish_reason == FinishReason.LENGTH


def test_offline_engine_queues_every_request(tiny_llama_dir):
    """The offline LLM's EngineCore (bound_waiting off) takes a batch past the bound."""
    config = EngineConfig(
        model=ModelConfig(model=tiny_llama_dir),
        cache=CacheConfig(kv_cache_memory_bytes=TINY_KV_CACHE_MEMORY),
        scheduler=SchedulerConfig(max_waiting_requests=2),
    )
    core = EngineCore(config, tiny_llama_dir)
    try:
        for i in range(5):
            core.add_request(make_request(f"o{i}"))
        outputs = run(core)
        assert all(outputs[f"o{i}"][-1].finish_reason == FinishReason.LENGTH for i in range(5))
    finally:
        core.shutdown()
