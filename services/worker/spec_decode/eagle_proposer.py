"""The EAGLE proposer (EAGLE-1, EAGLE-3 and MTP): the runner's glue around the draft head
(`EagleHead` in eagle.py, `Eagle3Head` in eagle3.py, `MtpHead` in mtp.py).

Every target step, the head first catches up on the step's verified positions: for each
request, the pairs (f_p, x_{p+1}) of the positions whose next token is known now (a prompt
chunk's positions; for a request that sampled, its last token's position and the accepted
drafts', each paired with the token that follows it). Their K/V go into the head's own
paged cache under the target's block ids (its rejected positions are rewritten later, as
the target's are). Then, for the requests asked for drafts, the head's output at their last
pair gives the first guess, and each further guess is one single-token step whose input is
(the head's own previous output, the previous guess). The scheduler reserved lookahead slots
for those steps (SpeculativeConfig.uses_lookahead_slots). Guesses are greedy.

The heads differ in what they read and how they guess, nothing else here (`DraftHead`):
EAGLE-1 reads the target's final hidden state f_p and guesses with the target's LM head;
EAGLE-3 reads fc of three target layers' states (the target keeps them for it) and guesses
with its own norm and LM head over its draft vocabulary, mapped to target ids through d2t;
MTP (DeepSeek-V3's multi-token-prediction layer, from the target's own checkpoint) reads f_p
as EAGLE-1 does and guesses with its own norm and LM head (`shared_head`).

One approximation: a block reused from the prefix cache holds, at its last slot, the pair
built with the token that followed it in the request that computed it; a request that
diverges right at the block boundary reads that pair. It only changes guesses, never output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.services.worker.layers.attention import (
    Attention,
    AttentionMetadata,
    bind_kv_caches,
    kv_cache_bytes_per_block,
)
from kvserve.services.worker.parallel_state import broadcast_from_driver, get_pp_size
from kvserve.services.worker.spec_decode.draft_head import DraftLMHead
from kvserve.services.worker.spec_decode.eagle import load_eagle
from kvserve.services.worker.spec_decode.eagle3 import load_eagle3
from kvserve.shared.config import SpeculativeConfig
from kvserve.shared.logging import init_logger

logger = init_logger(__name__)


@dataclass
class DraftHead:
    """A one-layer draft head the proposer runs, with what it reads and how it guesses.

    Args:
        module: forward(input_ids [T], features [T, H], positions [T], metadata) -> h [T, H],
            its K/V written into the paged caches of its `attention_layers`.
        guess: h [N, H] -> guessed token ids [N].
        features: (the target's final hidden states, rows [N]) -> the head's first input
            [N, H] at those rows.
        source: where it was loaded from (for the log).
    """

    module: torch.nn.Module
    guess: Callable[[torch.Tensor], torch.Tensor]
    features: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    source: str


def load_draft_head(
    config: SpeculativeConfig,
    target_model: torch.nn.Module,
    dtype: torch.dtype,
    device: torch.device | str,
) -> DraftHead:
    """The EAGLE-1 or EAGLE-3 head of config.model (method eagle or eagle3)."""
    assert config.model is not None, "SpeculativeConfig checks eagle has a model"
    if config.method == "eagle3":
        head3 = load_eagle3(config.model, target_model, dtype, device)
        return DraftHead(head3, head3.guess, head3.target_features, config.model)
    head = load_eagle(config.model, target_model, dtype, device)
    return DraftHead(head, DraftLMHead(target_model).argmax, rows_of, config.model)


class EagleProposer:
    """
    Args:
        draft: the head (load_draft_head, or mtp.py's MTP layer).
        method: the speculative method's name (for the log).
        dtype, device: the target's.
        block_size: the KV cache's block size.
    """

    def __init__(
        self,
        draft: DraftHead,
        method: str,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
    ):
        if get_pp_size() > 1:
            raise ValueError(f"{method} speculation does not run with pipeline parallelism")
        self.head = draft.module
        self.guess = draft.guess  # head outputs [N, H] -> ids [N]
        self.features = draft.features  # (hidden, rows) -> [N, H]
        self.dtype = dtype
        self.device = device
        self.block_size = block_size
        self.attention_layers = [m for m in self.head.modules() if isinstance(m, Attention)]
        logger.info("%s head from %s", method.upper(), draft.source)

    def kv_cache_bytes_per_block(self) -> int:
        return kv_cache_bytes_per_block(self.attention_layers, self.block_size, self.dtype)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        bind_kv_caches(self.attention_layers, num_blocks, self.block_size, self.dtype, self.device)

    def _metadata(self, query_lens, seq_lens, slot_mapping, block_table) -> AttentionMetadata:
        dev = self.device
        query_start_loc = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start_loc[1:])
        max_seq_len = int(seq_lens.max())
        num_blocks = -(-max_seq_len // self.block_size)
        return AttentionMetadata(
            query_start_loc=torch.from_numpy(query_start_loc).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_table=torch.from_numpy(np.ascontiguousarray(block_table[:, :num_blocks])).to(dev),
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            max_query_len=int(query_lens.max()),
            max_seq_len=max_seq_len,
        )

    @torch.inference_mode()
    def step(
        self,
        rows: np.ndarray,
        token_ids: np.ndarray,
        block_table: np.ndarray,
        num_blocks: np.ndarray,
        num_computed: np.ndarray,
        num_verified: np.ndarray,
        hidden_rows: np.ndarray,
        hidden: torch.Tensor,
        num_drafts: np.ndarray,
    ) -> list[list[int]]:
        """Catch up on this step's verified pairs, then guess (every TP rank runs it).

        Args:
            rows: [B] the step's requests' rows of the arrays below.
            token_ids: [R, L] each row's tokens (this step's emitted ones appended).
            block_table: [R, W] each row's block ids.
            num_blocks: [R] blocks each row holds (bounds the guesses' slots).
            num_computed: [B] each request's computed tokens before the step.
            num_verified: [B] positions from num_computed whose next token is known now.
            hidden_rows: [sum(num_verified)] the target's hidden row of each such position.
            hidden: the target's final hidden states of the step.
            num_drafts: [B] guesses wanted (0: catch up only).
        """
        num_reqs = len(num_computed)
        active = np.flatnonzero(num_verified > 0)
        if not len(active):
            return [[] for _ in range(num_reqs)]
        lens = num_verified[active]
        h = self._catch_up(
            rows, token_ids, block_table, num_computed, active, lens, hidden_rows, hidden
        )
        # Guesses, from each asking request's last pair on.
        ends = np.cumsum(lens) - 1
        asking = [(j, int(i)) for j, i in enumerate(active) if num_drafts[i] > 0]
        if not asking:
            return [[] for _ in range(num_reqs)]
        reqs = np.array([i for _, i in asking])
        last_rows = torch.from_numpy(ends[[j for j, _ in asking]]).to(self.device)
        return self._guess(
            h[last_rows], reqs, rows, block_table, num_blocks, num_computed, num_verified,
            num_drafts,
        )  # fmt: skip

    def _catch_up(
        self,
        rows: np.ndarray,
        token_ids: np.ndarray,
        block_table: np.ndarray,
        num_computed: np.ndarray,
        active: np.ndarray,
        lens: np.ndarray,
        hidden_rows: np.ndarray,
        hidden: torch.Tensor,
    ) -> torch.Tensor:
        """Run the head over the verified pairs of the `active` requests (`lens` each), writing
        their K/V; returns its hidden rows, the requests' pairs end to end."""
        bs = self.block_size
        req_of = np.repeat(active, lens)
        offsets = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
        positions = num_computed[req_of] + offsets
        row_of = rows[req_of]
        input_ids = token_ids[row_of, positions + 1]
        slot_mapping = block_table[row_of, positions // bs].astype(np.int64) * bs + positions % bs
        metadata = self._metadata(
            lens, num_computed[active] + lens, slot_mapping, block_table[rows[active]]
        )
        dev = self.device
        features = self.features(hidden, torch.from_numpy(hidden_rows).to(dev))
        return self.head(
            torch.from_numpy(input_ids).to(dev),
            features,
            torch.from_numpy(positions).to(dev),
            metadata,
        )

    def _guess(
        self,
        feature: torch.Tensor,
        reqs: np.ndarray,
        rows: np.ndarray,
        block_table: np.ndarray,
        num_blocks: np.ndarray,
        num_computed: np.ndarray,
        num_verified: np.ndarray,
        num_drafts: np.ndarray,
    ) -> list[list[int]]:
        """Up to num_drafts guesses for each of `reqs`, one head step per guess from the
        head's hidden row (`feature`) of each one's last pair; every request's list."""
        bs = self.block_size
        dev = self.device
        num_reqs = len(num_computed)
        out = np.zeros((num_reqs, int(num_drafts.max(initial=0))), dtype=np.int64)
        pos = num_computed[reqs] + num_verified[reqs] - 1  # the last pair's position
        # Never past the slots a request holds (the lookahead slots included): guess s + 1
        # writes its pair at position pos + s.
        wanted = np.minimum(num_drafts[reqs], num_blocks[rows[reqs]] * bs - pos)
        limit = np.zeros(num_reqs, dtype=np.int64)
        limit[reqs] = np.maximum(wanted, 0)
        for step in range(out.shape[1]):
            guesses = broadcast_from_driver(self.guess(feature))
            out[reqs, step] = guesses.cpu().numpy()
            keep = np.flatnonzero(wanted > step + 1)
            if not len(keep):
                break
            reqs, pos, wanted = reqs[keep], pos[keep] + 1, wanted[keep]
            ids = torch.from_numpy(out[reqs, step]).to(dev)
            table = block_table[rows[reqs]]
            slots = table[np.arange(len(reqs)), pos // bs].astype(np.int64) * bs + pos % bs
            metadata = self._metadata(np.ones(len(reqs), np.int64), pos + 1, slots, table)
            feature = self.head(
                ids,
                feature[torch.from_numpy(keep).to(dev)],
                torch.from_numpy(pos).to(dev),
                metadata,
            )
        return [out[i, : int(limit[i])].tolist() for i in range(num_reqs)]


def rows_of(hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """EAGLE-1's (and MTP's) features: the target's final hidden states themselves."""
    return hidden[rows]
