"""Per-step attention metadata, built once by the runner and passed to every layer.

The batch is flattened and unpadded: decode rows first (one query token each), then prefill
chunks (many query tokens each). Layers never read global state: everything a layer needs to
find a token's KV is here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillChunk:
    """One request computing several tokens this step."""

    query_start: int  # offset of its first token in the flattened batch
    query_len: int  # tokens computed this step
    num_computed_tokens: int  # tokens already in the cache before this step (its prefix)
    # [num_blocks] int64 block table covering the prefix and the chunk; None if no prefix and
    # no generated rows (then the chunk attends to its own fresh K/V only).
    block_table: torch.Tensor | None
    # The chunk's last rows that are generated tokens, recomputed after a recompute
    # preemption: they attend as decodes (the decode kernel over the cache), as when they
    # were first computed, so preemption does not change their outputs.
    generated_rows: int = 0


@dataclass
class HostSequences:
    """The step's sequences as the host built them, decode rows then prefill chunks: what a
    kernel library's planner reads on the host (FlashInfer's ``plan``), so that it need not
    copy them back from the device (a copy that waits for the step before)."""

    seq_lens: list[int]  # keys each sequence attends to (its own rows included)
    block_tables: list[list[int]]  # its first ceil(seq_len / block_size) blocks
    query_lens: list[int]  # its rows this step (1 per decode row)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot written by each token
    # The first num_decodes tokens are decode rows: one per decoding request, 1 + its drafts
    # per verifying one (consecutive positions; every K/V row is written before any is read)
    num_decodes: int
    # [num_decodes, max_blocks] int64 block tables of the decodes (padding -> block 0)
    decode_block_tables: torch.Tensor | None
    # [num_decodes] int64: cached positions each decode attends to (its own token included)
    decode_context_lens: torch.Tensor | None
    prefills: list[PrefillChunk]
    host: HostSequences | None = None  # set by the runner over FlashInfer
