"""OutputProcessor: engine-core outputs -> detokenized, stop-checked `RequestOutput`s.

A request with n > 1 is fanned out into n child requests in the engine core (ids
`"{index}_{request_id}"`); they share the prompt's KV blocks through the prefix cache, and the
processor gathers them back into one RequestOutput.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec

from kvserve.services.api.observability.stats import IterationStats, RequestTimes, RequestUsage
from kvserve.services.api.serving.detokenizer import (
    Detokenizer,
    check_stop_strings,
    make_detokenizer,
)
from kvserve.services.api.serving.latency_targets import NO_TARGETS, LatencyTargets
from kvserve.services.api.serving.outputs import CompletionOutput, Logprob, RequestOutput
from kvserve.services.api.tenancy.tenants import DEFAULT_TENANT, TenantSpec
from kvserve.shared.lora import LoRARequest
from kvserve.shared.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    EngineSpan,
    Logprobs,
    PromptPin,
)
from kvserve.shared.sampling_params import SamplingParams


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


def make_engine_requests(
    child_ids: list[str],
    prompt_token_ids: list[int],
    params: SamplingParams,
    priority: int,
    tokenizer_info,
    lora_request: LoRARequest | None = None,
    tenant: TenantSpec | None = None,
    trace_context: dict[str, str] | None = None,
    targets: LatencyTargets | None = None,
    pins: list[PromptPin] | None = None,
    standing_ttft_ms: float | None = None,
) -> list[EngineCoreRequest]:
    """One EngineCoreRequest per child; child i of a seeded request gets seed + i; all
    run with `lora_request`'s adapter (None: the base model), for `tenant` (None:
    "default", weight 1), traced under `trace_context` (None: not traced), with `targets`
    (None: the engine's --slo-*-ms), `pins` (prompt prefixes to pin; None: none) and
    `standing_ttft_ms` (the key file's tightest TTFT target; None: none)."""
    tenant = tenant or TenantSpec(name=DEFAULT_TENANT)
    targets = targets or NO_TARGETS
    if tokenizer_info.extra_stop_token_ids and not params.ignore_eos:
        stop_ids = list(params.stop_token_ids or ()) + tokenizer_info.extra_stop_token_ids
        params = msgspec.structs.replace(params, stop_token_ids=stop_ids)
    now = time.time()
    requests = []
    for index, child_id in enumerate(child_ids):
        child_params = params
        if params.n > 1:
            seed = None if params.seed is None else params.seed + index
            child_params = msgspec.structs.replace(params, n=1, seed=seed)
        requests.append(
            EngineCoreRequest(
                child_id,
                list(prompt_token_ids),
                child_params,
                tokenizer_info.eos_token_id,
                now,
                priority,
                lora_request=lora_request,
                tenant=tenant.name,
                tenant_weight=tenant.weight,
                # A chat's images travel with its token ids (multimodal.PromptWithImages).
                mm_inputs=getattr(prompt_token_ids, "mm_inputs", []),
                trace_context=trace_context,
                slo_ttft_ms=targets.ttft_ms,
                slo_tpot_ms=targets.tpot_ms,
                pins=list(pins or ()),
                standing_ttft_ms=standing_ttft_ms,
            )
        )
    return requests


@dataclass(slots=True)
class _Child:
    completion: CompletionOutput
    detokenizer: Detokenizer | None
    times: RequestTimes


@dataclass(slots=True)
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: dict[str, _Child] = field(default_factory=dict)
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = None
    num_unfinished: int = 0
    tenant: str = DEFAULT_TENANT
    # A traced request's engine phases, per child: (engine-core id, spans); None: untraced.
    engine_spans: list[tuple[str, list[EngineSpan]]] | None = None

    def usage(self) -> RequestUsage:
        """The tokens its response's `usage` counts (serving/base.py's count_usage): the prompt
        once, every choice's tokens; a choice still unfinished counts as aborted."""
        return RequestUsage(
            self.tenant,
            len(self.prompt_token_ids),
            sum(len(c.completion.token_ids) for c in self.children.values()),
            tuple(c.completion.finish_reason or "abort" for c in self.children.values()),
        )


class OutputProcessor:
    """
    Args:
        tokenizer: a HF tokenizer, or None to return token ids only.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.parents: dict[str, _Parent] = {}
        self.child_to_parent: dict[str, _Parent] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tenant: str = DEFAULT_TENANT,
        traced: bool = False,
        targets: LatencyTargets | None = None,
    ) -> list[str]:
        """Track a request served for `tenant` (`traced`: keep its engine phases; `targets`:
        the latency targets its children are timed against); returns the engine-core ids of
        its n children."""
        if request_id in self.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        parent = _Parent(
            request_id, prompt, prompt_token_ids, params, num_unfinished=params.n, tenant=tenant
        )
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
        if traced:
            parent.engine_spans = []
        arrival_time = time.monotonic()
        targets = targets or NO_TARGETS
        for index in range(params.n):
            child_id = child_request_id(request_id, index, params.n)
            detok = None
            if self.tokenizer is not None:
                detok = make_detokenizer(
                    self.tokenizer, prompt_token_ids, params.skip_special_tokens
                )
            parent.children[child_id] = _Child(
                CompletionOutput(index=index),
                detok,
                RequestTimes(arrival_time, targets.ttft_ms, targets.tpot_ms),
            )
            self.child_to_parent[child_id] = parent
        self.parents[request_id] = parent
        return list(parent.children)

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def abort_request(
        self, request_id: str, iteration_stats: IterationStats | None = None
    ) -> list[str]:
        """Forget a request; returns its children's engine-core ids (to abort there).

        Args:
            iteration_stats: gets the request's usage so far (None: not taken).
        """
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return []
        if iteration_stats is not None:
            iteration_stats.request_usages.append(parent.usage())
        for child_id in parent.children:
            self.child_to_parent.pop(child_id, None)
        return list(parent.children)

    def process_outputs(
        self, outputs: list[EngineCoreOutput], iteration_stats: IterationStats | None = None
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns (updated request outputs, engine-core ids to abort after a stop string).

        Args:
            outputs: one engine step's outputs.
            iteration_stats: gets the step's token counts and request timings (None: none
                are taken).
        """
        changed: dict[str, _Parent] = {}
        to_abort: list[str] = []
        for out in outputs:
            parent = self.child_to_parent.get(out.request_id)
            if parent is None:  # aborted meanwhile
                continue
            child = parent.children[out.request_id]
            if out.trace_spans is not None and parent.engine_spans is not None:
                parent.engine_spans.append((out.request_id, out.trace_spans))
            if self._update_child(parent, child, out):
                to_abort.append(out.request_id)
            num_prompt_tokens = len(parent.prompt_token_ids)
            if iteration_stats is not None:
                iteration_stats.observe_output(child.times, out, num_prompt_tokens, parent.tenant)
            if child.completion.finished():
                self.child_to_parent.pop(out.request_id, None)
                parent.num_unfinished -= 1
                if iteration_stats is not None:
                    assert child.completion.finish_reason is not None  # finished() says so
                    iteration_stats.observe_finished(
                        child.times,
                        child.completion.finish_reason,
                        num_prompt_tokens,
                        parent.params.max_tokens,
                        parent.tenant,
                    )
            changed[parent.request_id] = parent
        results = []
        for parent in changed.values():
            finished = parent.num_unfinished == 0
            if finished:
                self.parents.pop(parent.request_id, None)
                if iteration_stats is not None:
                    iteration_stats.observe_finished_parent(
                        parent.params.n,
                        max(c.times.num_generation_tokens for c in parent.children.values()),
                    )
                    iteration_stats.request_usages.append(parent.usage())
            results.append(self._make_output(parent, finished))
        return results, to_abort

    def _update_child(self, parent: _Parent, child: _Child, out: EngineCoreOutput) -> bool:
        """Apply one engine output; True when a stop string ended the child here."""
        comp, params = child.completion, parent.params
        # Only a child's first output carries its prefix hit (later ones say 0). With n > 1
        # the later children hit the first one's blocks: report the best, which is what
        # vLLM's final output shows (the hit of the last child to finish).
        parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
        if out.new_prompt_logprobs is not None and comp.index == 0:
            assert parent.prompt_logprobs is not None  # sent only when the request asks
            parent.prompt_logprobs.extend(self._to_logprob_dicts(out.new_prompt_logprobs))
        comp.token_ids.extend(out.new_token_ids)
        if out.pooled is not None:
            comp.pooled = out.pooled
        if out.new_logprobs is not None:
            if comp.logprobs is None:
                comp.logprobs, comp.cumulative_logprob = [], 0.0
            assert comp.cumulative_logprob is not None  # set together with logprobs
            for row in out.new_logprobs.logprobs:
                comp.cumulative_logprob += row[0]
            comp.logprobs.extend(self._to_logprob_dicts(out.new_logprobs))
        if out.finish_reason is not None:
            comp.finish_reason = str(out.finish_reason)
            comp.stop_reason = out.stop_reason if out.error is None else out.error
        if child.detokenizer is None:
            return False
        new_text = child.detokenizer.update(out.new_token_ids)
        comp.text = child.detokenizer.output_text
        if not (params.stop and new_text):
            return False
        assert not isinstance(params.stop, str)  # SamplingParams.__post_init__ lists it
        hit = check_stop_strings(
            comp.text, len(new_text), params.stop, params.include_stop_str_in_output
        )
        if hit is None:
            return False
        stop_str, truncate_to = hit
        comp.text = comp.text[:truncate_to]
        comp.finish_reason, comp.stop_reason = "stop", stop_str
        # The core still runs the request unless it ended in this same step.
        return out.finish_reason is None

    def _to_logprob_dicts(self, lp: Logprobs) -> list[dict[int, Logprob]]:
        rows = []
        for ids, values, rank in zip(lp.token_ids, lp.logprobs, lp.ranks):
            d: dict[int, Logprob] = {}
            for j, (tid, value) in enumerate(zip(ids, values)):
                if tid in d:
                    continue
                d[tid] = Logprob(value, rank if j == 0 else j, self._decode_one(tid))
            rows.append(d)
        return rows

    def _decode_one(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id])

    @staticmethod
    def _make_output(parent: _Parent, finished: bool) -> RequestOutput:
        completions = [
            CompletionOutput(
                index=c.completion.index,
                text=c.completion.text,
                token_ids=list(c.completion.token_ids),
                cumulative_logprob=c.completion.cumulative_logprob,
                logprobs=list(c.completion.logprobs) if c.completion.logprobs is not None else None,
                finish_reason=c.completion.finish_reason,
                stop_reason=c.completion.stop_reason,
                pooled=c.completion.pooled,
            )
            for c in parent.children.values()
        ]
        return RequestOutput(
            parent.request_id,
            parent.prompt,
            parent.prompt_token_ids,
            completions,
            finished,
            list(parent.prompt_logprobs) if parent.prompt_logprobs else None,
            parent.num_cached_tokens,
            parent.engine_spans if finished else None,
        )
