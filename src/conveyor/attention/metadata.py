"""Per-step attention metadata, built once by the runner and passed to every layer.

The batch is flattened and unpadded: decodes first (one query token each), then prefill
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
    context_slots: torch.Tensor | None  # [num_computed + query_len] cache slots; None if no prefix


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot written by each token
    num_decodes: int  # the first num_decodes tokens are decodes, one per request
    # [num_decodes, max_context] int64 flat slots of each decode's context (padding -> slot 0)
    decode_context_slots: torch.Tensor | None
    # [num_decodes, 1, 1, max_context] bool: True where the context position is real
    decode_mask: torch.Tensor | None
    prefills: list[PrefillChunk]
