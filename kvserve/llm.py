"""`LLM`: offline batch inference, ported from vLLM by changing the import."""

from __future__ import annotations

import gc
import itertools
from collections.abc import Sequence
from typing import Any, cast

import msgspec

from kvserve.services.api.engine_client.client import StatsTotals
from kvserve.services.api.serving.generation_config import load_generation_defaults
from kvserve.services.api.serving.output_processor import OutputProcessor, make_engine_requests
from kvserve.services.api.serving.outputs import RequestOutput
from kvserve.services.api.serving.request_constraints import bad_words_token_ids
from kvserve.services.api.serving.tokenizer import TokenizerInfo
from kvserve.shared.config import EngineConfig
from kvserve.shared.lora import LoRARequest, read_adapter_config
from kvserve.shared.sampling_params import (
    SamplingParams,
    logprobs_over_limit,
    token_ids_out_of_range,
)

PromptType = str | list[int] | dict[str, Any]


class LLM:
    """An engine core in this process, with tokenizer and detokenizer around it.

    Args:
        model: HF folder, GGUF file, hub id in the local HF cache, or None for the embedded
            SmolLM2-135M-Instruct.
        generation_config: "auto" (the model's generation_config.json supplies
            get_default_sampling_params), "vllm" (none), or a folder holding one.
        **kwargs: engine arguments with vLLM's names (dtype, seed, max_model_len,
            enable_prefix_caching, max_num_batched_tokens, max_num_seqs, block_size,
            kv_cache_memory, num_gpu_blocks_override, long_prefill_token_threshold,
            scheduling_policy, ...).
    """

    def __init__(self, model: str | None = None, generation_config: str = "auto", **kwargs):
        self._start(EngineConfig.from_kwargs(model=model, **kwargs), generation_config)

    @classmethod
    def from_config(cls, config: EngineConfig, generation_config: str = "auto") -> LLM:
        """An LLM from a whole EngineConfig (what the CLI's flags build)."""
        llm = cls.__new__(cls)
        llm._start(config, generation_config)
        return llm

    def _start(self, config: EngineConfig, generation_config: str) -> None:
        from kvserve.services.scheduler.engine.engine_core import EngineCore
        from kvserve.services.worker.model_loader import resolve_model

        self.config = config
        self.model_dir = resolve_model(config.model.model)
        self.tokenizer_info = TokenizerInfo(self.config.model.tokenizer or self.model_dir)
        self.generation_defaults = load_generation_defaults(generation_config, self.model_dir)
        # An engine is a web of reference cycles (torch modules, callbacks), so one the caller
        # dropped stays allocated until the cyclic collector's rare full pass: collect it
        # before loading another, which reuses its memory instead of adding to it.
        gc.collect()
        self.engine_core = EngineCore(self.config, self.model_dir)
        self.max_model_len = self.engine_core.ready.max_model_len
        self.output_processor = OutputProcessor(self.tokenizer_info.tokenizer)
        self._counter = itertools.count()
        # The engine's counters (preemptions, prefix-cache and speculative-decoding
        # figures) summed over every step since start-up, as the server's /metrics has them.
        self.stats_totals = StatsTotals()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation-config defaults (vLLM's)."""
        return SamplingParams(**self.generation_defaults)

    def get_tokenizer(self):
        return self.tokenizer_info.tokenizer

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1; on CUDA the weights move to pinned host memory) or
        the KV cache and the weights (level 2) on every worker (needs enable_sleep_mode=True
        and no request in flight, as vLLM's LLM.sleep)."""
        if not self.engine_core.sleep(level):
            raise RuntimeError("requests are in flight: the engine did not sleep")

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what sleep freed: `tags` among "weights" and "kv_cache" (None: both)."""
        self.engine_core.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine_core.sleep_level > 0

    # ------------------------------------------------------------------ public API

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for one or many prompts (text, token ids, or dicts with
        `prompt` / `prompt_token_ids`), in the order given.

        `lora_request`: one adapter for every prompt, or one per prompt (None: the base
        model); needs `LLM(..., enable_lora=True)`. Prompts of different adapters run in one
        batch (up to max_loras adapters at a time)."""
        prompt_list = self._as_prompt_list(prompts)
        inputs = [self._tokenize(p) for p in prompt_list]
        return self._run(inputs, sampling_params, use_tqdm, priority, lora_request)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them."""
        # One conversation is a list of dicts; a list of them, a list of lists.
        conversations = cast(
            list[list[dict]],
            [messages] if messages and isinstance(messages[0], dict) else messages,
        )
        inputs = []
        for conversation in conversations:
            ids = self.tokenizer_info.apply_chat_template(
                conversation, add_generation_prompt, **(chat_template_kwargs or {})
            )
            inputs.append((None, ids))
        return self._run(inputs, sampling_params, use_tqdm, None)

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _as_prompt_list(prompts) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        prompts = list(prompts)
        if prompts and isinstance(prompts[0], int):
            return [prompts]  # a single prompt given as token ids
        return prompts

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer_info.encode(prompt)
        return None, list(cast(list[int], prompt))  # token ids (a dict's "prompt" may be too)

    def _validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt: the prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(prompt_token_ids)} tokens do not fit "
                f"max_model_len={self.max_model_len} (prompt + at least one "
                f"new token)"
            )
        vocab = len(self.tokenizer_info.tokenizer)
        if max(prompt_token_ids) >= vocab or min(prompt_token_ids) < 0:
            raise ValueError(f"prompt_token_ids: ids must be in [0, {vocab})")
        over_limit = logprobs_over_limit(params, self.config.model.max_logprobs)
        if over_limit is not None:
            raise ValueError(f"{over_limit[0]}: {over_limit[1]}")
        out_of_range = token_ids_out_of_range(params, vocab)
        if out_of_range is not None:
            raise ValueError(f"{out_of_range[0]}: {out_of_range[1]}")
        if params.structured_outputs is not None:
            # Compiled here, so a bad schema raises now (the engine then hits the cache).
            manager = self.engine_core.structured_output_manager
            error = manager.compile(params.structured_outputs).exception()
            if error is not None:
                raise ValueError(f"structured_outputs: {error}")

    def _lora_requests(self, lora_request, num_prompts: int) -> list[LoRARequest | None]:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_list = [lora_request] * num_prompts
        else:
            lora_list = list(lora_request)
        if len(lora_list) != num_prompts:
            raise ValueError(f"lora_request: {len(lora_list)} given for {num_prompts} prompts")
        if any(lora_list) and not self.config.lora.enable_lora:
            raise ValueError(
                "lora_request: LoRA is not enabled; create the LLM with enable_lora=True"
            )
        for lora in {r for r in lora_list if r is not None}:
            read_adapter_config(lora.lora_path, self.config.lora.max_lora_rank)  # raises now
        return lora_list

    def _run(
        self, inputs, sampling_params, use_tqdm, priority, lora_request=None
    ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = (
            list(sampling_params)
            if isinstance(sampling_params, Sequence)
            else [sampling_params] * len(inputs)
        )
        if len(params_list) != len(inputs):
            raise ValueError(f"sampling_params: {len(params_list)} given for {len(inputs)} prompts")
        params_list = [self._with_bad_words_token_ids(p) for p in params_list]
        for (_, ids), params in zip(inputs, params_list):
            self._validate(ids, params)
        lora_list = self._lora_requests(lora_request, len(inputs))

        order = {}
        for i, ((prompt, ids), params) in enumerate(zip(inputs, params_list)):
            request_id = str(next(self._counter))
            order[request_id] = i
            self._add_request(
                request_id, prompt, ids, params, priority[i] if priority else 0, lora_list[i]
            )
        return self._run_engine(order, use_tqdm)

    def _with_bad_words_token_ids(self, params: SamplingParams) -> SamplingParams:
        if not params.bad_words or params.bad_words_token_ids is not None:
            return params
        ids = bad_words_token_ids(self.tokenizer_info.tokenizer, params.bad_words)
        return msgspec.structs.replace(params, bad_words_token_ids=ids)

    def _add_request(
        self, request_id, prompt, prompt_token_ids, params, priority, lora_request=None
    ) -> None:
        child_ids = self.output_processor.add_request(request_id, prompt, prompt_token_ids, params)
        for request in make_engine_requests(
            child_ids, prompt_token_ids, params, priority, self.tokenizer_info, lora_request
        ):
            self.engine_core.add_request(request)

    def _run_engine(self, order: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(order)
        bar = None
        if use_tqdm and len(order) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(order), desc="Processed prompts", dynamic_ncols=True)
        remaining = len(order)
        while remaining:
            if not self.engine_core.has_work():
                raise RuntimeError(f"{remaining} requests vanished from the engine")
            step = self.engine_core.step()
            if step.scheduler_stats is not None:
                self.stats_totals.add(step.scheduler_stats)
            outputs = step.outputs
            request_outputs, to_abort = self.output_processor.process_outputs(outputs)
            if to_abort:
                self.engine_core.abort_requests(to_abort)
            for ro in request_outputs:
                if ro.finished and ro.request_id in order:
                    results[order[ro.request_id]] = ro
                    remaining -= 1
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return cast(list[RequestOutput], results)  # remaining == 0: every slot is filled
