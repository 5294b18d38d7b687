"""The LM head a proposer guesses with: the target's, read in bfloat16 on a CPU.

A guess needs only the argmax of the logits, and on a CPU the LM head's GEMV is bound by
the bytes of its weight (SmolLM2-135M: 49152 x 576, 113 MB in float32, about a fifth of a
decode step), paid once per draft step. A bfloat16 copy halves those bytes; rounding can
change a near-tie argmax, which only changes a guess: the target verifies every draft with
its own float32 head, so output is unchanged. Elsewhere (a GPU, a bfloat16 target, TP > 1,
weights held quantized) the target's own head is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F

from kvserve.services.worker.parallel_state import get_tp_size

if TYPE_CHECKING:
    from kvserve.services.worker.models.llama import LlamaForCausalLM


class DraftLMHead:
    """argmax over the target's vocabulary, the cheap way where there is one.

    Args:
        target_model: the target (`.lm_head.weight`, `.compute_logits`).
    """

    def __init__(self, target_model: torch.nn.Module):
        self.target_model = target_model
        self.weight: torch.Tensor | None = None
        lm_head = getattr(target_model, "lm_head", None)
        weight = getattr(lm_head, "weight", None)
        if (
            weight is not None
            and weight.device.type == "cpu"
            and weight.dtype == torch.float32
            and get_tp_size() == 1
        ):
            self.weight = weight.detach().to(torch.bfloat16)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, V] scores whose argmax is the guess (not calibrated logits)."""
        if self.weight is None:
            # Every target is a LlamaForCausalLM (or a subclass); the seam types it nn.Module.
            return cast("LlamaForCausalLM", self.target_model).compute_logits(hidden)
        return F.linear(hidden.to(torch.bfloat16), self.weight)

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden).argmax(dim=-1)
