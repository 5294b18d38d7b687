"""Speculative decoding's configuration (vLLM's --speculative-config), part of EngineConfig
(shared/config.py re-exports it)."""

from __future__ import annotations

from typing import Literal

import msgspec

SpecMethod = Literal[
    "ngram", "draft_model", "eagle", "eagle3", "medusa", "suffix", "mtp", "deepseek_mtp"
]

# Methods whose proposer runs in the scheduler over the request's tokens (no model): the
# worker proposes nothing for them (services/scheduler/core/spec_proposers.py).
SCHEDULER_METHODS = ("suffix",)
# Methods whose drafter is the target checkpoint's own multi-token-prediction layer
# (services/worker/spec_decode/mtp.py): "deepseek_mtp" is vLLM's name, "mtp" the short one.
MTP_METHODS = ("mtp", "deepseek_mtp")


class SpeculativeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Speculative decoding (vLLM's --speculative-config / speculative_config).

    Args:
        method: ngram (prompt lookup over the request's own tokens), draft_model (a smaller
            model with the target's vocabulary, or the target's first num_draft_layers
            layers as a self-draft), eagle (EAGLE-1: one decoder layer over the target's
            hidden state and the next token), eagle3 (EAGLE-3: one decoder layer over three
            target layers' hidden states and the next token, its own LM head over a draft
            vocabulary), medusa (residual heads over the last hidden state), suffix
            (suffix decoding over the request's prompt and output and its tenant's recent
            outputs, in the scheduler), or mtp / deepseek_mtp (the target checkpoint's own
            multi-token-prediction layer, DeepSeek-V3's `num_nextn_predict_layers`, run as
            the drafter; no `model`).
        num_speculative_tokens: drafts per step at most (k): at most 16, or 32 for suffix.
        prompt_lookup_min, prompt_lookup_max: ngram: the n-gram lengths matched, longest
            first.
        model: draft_model: the draft's folder or GGUF file (absent: the target itself,
            truncated to num_draft_layers); medusa: the heads' folder; eagle, eagle3: the
            draft head's folder (EAGLE-3: the published layout, config.json with
            architectures ["LlamaForCausalLMEagle3"]).
        num_draft_layers: draft_model: run only the draft's first L layers (then its final
            norm and LM head). Without `model` the draft shares the target's weights and
            KV cache, so it costs no memory and no extra prefill.
        disable_by_batch_size: no speculation in a step with at least this many running
            requests (vLLM's key); None: no such cap.
        adaptive: each request's k follows its measured acceptance, and speculation turns
            itself off when a batch is large enough that extra tokens are not free (the rule
            is in services/scheduler/core/spec_decode.py).
        suffix_decoding_max_tree_depth: suffix: the longest match plus draft, in tokens.
        suffix_decoding_max_cached_requests: suffix: finished requests' outputs kept to
            draft from (per engine, all tenants together; 0: the request's own text only).
        suffix_decoding_max_spec_factor: suffix: a match of n tokens drafts at most
            factor * n tokens.
        suffix_decoding_min_token_prob: suffix: a draft stops where the estimated chance
            of its path (from the match's continuation counts) falls below this.
    """

    method: SpecMethod
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    num_draft_layers: int | None = None
    disable_by_batch_size: int | None = None
    adaptive: bool = True
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        max_k = 32 if self.method == "suffix" else 16
        if not 1 <= self.num_speculative_tokens <= max_k:
            raise ValueError(
                f"num_speculative_tokens must be in [1, {max_k}], got {self.num_speculative_tokens}"
            )
        if self.method == "suffix":
            self._check_suffix()
        if self.method == "ngram":
            low, high = self.ngram_range
            if not 1 <= low <= high:
                raise ValueError(
                    f"ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max, got {low}, {high}"
                )
        elif self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise ValueError("prompt_lookup_min/max apply to the ngram method only")
        if self.method == "draft_model":
            if self.model is None and self.num_draft_layers is None:
                raise ValueError(
                    "draft_model needs a draft `model`, or `num_draft_layers` for a self-draft "
                    "made of the target's first layers"
                )
            if self.num_draft_layers is not None and self.num_draft_layers < 1:
                raise ValueError(f"num_draft_layers must be >= 1, got {self.num_draft_layers}")
        elif self.num_draft_layers is not None:
            raise ValueError("num_draft_layers applies to the draft_model method only")
        if self.method in ("medusa", "eagle", "eagle3") and self.model is None:
            raise ValueError(f"{self.method} needs `model`: the folder of the draft head")
        if self.method in ("ngram", "suffix") and self.model is not None:
            raise ValueError(f"the {self.method} method takes no model")
        if self.method in MTP_METHODS and self.model is not None:
            raise ValueError(
                f"the {self.method} method takes no model: its drafter is the target "
                "checkpoint's own multi-token-prediction layer"
            )

    def _check_suffix(self) -> None:
        if not 2 <= self.suffix_decoding_max_tree_depth <= 256:
            raise ValueError(
                "suffix_decoding_max_tree_depth must be in [2, 256], got "
                f"{self.suffix_decoding_max_tree_depth}"
            )
        if self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("suffix_decoding_max_cached_requests must be >= 0")
        if self.suffix_decoding_max_spec_factor <= 0:
            raise ValueError("suffix_decoding_max_spec_factor must be > 0")
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError("suffix_decoding_min_token_prob must be in [0, 1]")

    @property
    def ngram_range(self) -> tuple[int, int]:
        """(prompt_lookup_min, prompt_lookup_max), each defaulting to the other (vLLM)."""
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            return 5, 5  # vLLM's defaults
        return (low or high or 1), (high or low or 1)

    @property
    def uses_lookahead_slots(self) -> bool:
        """The proposer writes K/V past the verified tokens (a draft model's own steps), so
        the scheduler reserves num_speculative_tokens more slots per request."""
        return self.method in ("draft_model", "eagle", "eagle3", *MTP_METHODS)

    @property
    def proposes_in_scheduler(self) -> bool:
        """The method's proposer runs in the scheduler (the worker's proposes nothing)."""
        return self.method in SCHEDULER_METHODS
