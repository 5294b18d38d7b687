"""Token embedding and LM head, both split by vocabulary rows across TP ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve import kernels
from kvserve.kernels.gemm import LinearWeights, native_linear
from kvserve.services.worker.layers.linear import divide, set_weight_loader
from kvserve.services.worker.parallel_state import (
    get_tp_rank,
    get_tp_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows [vocab_start, vocab_end) live on this rank.

    Args:
        num_embeddings: full vocabulary size (must divide by the TP size).
        embedding_dim: hidden size.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.num_embeddings = num_embeddings
        self.num_embeddings_per_partition = divide(num_embeddings, self.tp_size)
        self.vocab_start_idx = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_idx = self.vocab_start_idx + self.num_embeddings_per_partition
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim), requires_grad=False
        )
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        assert shard_id is None, "the embedding has no shards"
        if loaded_weight.shape[0] != self.num_embeddings:
            raise ValueError(
                f"checkpoint vocab {loaded_weight.shape[0]} != config vocab {self.num_embeddings}"
            )
        rows = self.num_embeddings_per_partition
        param.data.copy_(loaded_weight.narrow(0, self.vocab_start_idx, rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        # Tokens of other ranks look up row 0 and are zeroed; the all-reduce fills them in.
        in_range = (input_ids >= self.vocab_start_idx) & (input_ids < self.vocab_end_idx)
        local_ids = (input_ids - self.vocab_start_idx) * in_range
        y = F.embedding(local_ids, self.weight) * in_range.unsqueeze(-1).to(self.weight.dtype)
        return tensor_model_parallel_all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> logits over the full vocabulary (each rank computes its vocab slice).

    Args:
        num_embeddings: full vocabulary size.
        embedding_dim: hidden size.
    """

    gemm: LinearWeights | None = None  # set after loading (worker/cpu_tuning.py: prepare_gemm)
    # Steps of up to this many rows run the native decode stack's GEMV (set by
    # models/native_decode.py when it binds the stack): each row's logits are then the same
    # whatever else shares the step, as the stack's hidden states are.
    native_rows: int = 0
    # Those steps run csrc/w8a8.c's AMX-BF16 linear instead (bfloat16 on a CPU with AMX; set
    # with native_rows): one fixed sum per output as well, 3x faster than the GEMV at 32 rows.
    native_amx: bool = False

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.shape[0] <= self.native_rows and self.native_amx:
            from kvserve.kernels import w8a8

            logits = w8a8.linear_amx_bf16(hidden_states, self.weight)
        elif hidden_states.shape[0] <= self.native_rows:
            logits = native_linear(hidden_states, self.weight, None)
        else:
            logits = kernels.linear(hidden_states, self.weight, None, self.gemm)
        return tensor_model_parallel_all_gather(logits, dim=-1)
