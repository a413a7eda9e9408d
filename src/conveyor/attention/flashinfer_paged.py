"""Paged attention through FlashInfer (``flashinfer-python``, CUDA only), the kernel library
vLLM and SGLang use: one ``BatchPrefillWithPagedKVCacheWrapper`` per device serves decodes and
prefill chunks alike (its causal mask is aligned to the end of each sequence's keys: query row
i of a chunk sees its prefix and the chunk's rows up to i), reading the cache's K and V planes
in place. The cache ``[2, blocks, block_size, KVH, D]`` is FlashInfer's "NHD" layout once
split into its planes ``kv_cache[0]``, ``kv_cache[1]`` (``[pages, page_size, KVH, D]``).

The wrapper is planned once per step (by the first layer, ``StepMemo``): FlashInfer's
``plan`` reads the page counts on the host and picks its work partition. float16 and bfloat16
only (``cuda_paged_attention_backend`` sends float32 to Triton). Imported only where
``flashinfer`` imports (``conveyor.attention.cuda_backend``).
"""

from __future__ import annotations

import functools

import flashinfer
import torch

from conveyor.attention.metadata import AttentionMetadata
from conveyor.attention.paged_batch import (
    PagedBatch,
    StepMemo,
    device_page_plan,
    host_page_plan,
    paged_batch,
)
from conveyor.ops.reference import write_kv_

# FlashInfer's scratch space for its split-KV partial results (the size its examples use).
WORKSPACE_BYTES = 128 << 20


class FlashInferAttention:
    """The wrapper and its workspace for one device, planned once per step."""

    def __init__(self, device: torch.device) -> None:
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self._planned: StepMemo[PagedBatch] = StepMemo()

    def plan(self, batch: PagedBatch, q: torch.Tensor, kv_cache: torch.Tensor,
             scale: float, meta: AttentionMetadata) -> None:
        """FlashInfer's CSR page lists: each sequence's first ceil(seq_len / block_size)
        blocks, and how many positions of its last one are used. From the host's numbers
        when the runner gave them (``meta.host``; as vLLM does: the plan reads them on the
        host), else from the device's (which waits for the step before)."""
        _, _, block_size, kvh, d = kv_cache.shape
        plan = (host_page_plan(meta.host, block_size, pin=True) if meta.host is not None
                else device_page_plan(batch, block_size))
        indices = plan.kv_indices.to(q.device, non_blocking=True)  # (pinned, or there)
        self.wrapper.plan(plan.qo_indptr, plan.kv_indptr, indices, plan.last_page_len,
                          q.shape[1], kvh, d, block_size, causal=True, sm_scale=scale,
                          q_data_type=q.dtype, kv_data_type=kv_cache.dtype)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float) -> torch.Tensor:
        write_kv_(k, v, kv_cache, meta.slot_mapping)

        def build() -> PagedBatch:
            batch = paged_batch(meta, kv_cache.shape[2])
            self.plan(batch, q, kv_cache, scale, meta)
            return batch

        self._planned.get(meta, (kv_cache.shape, q.dtype), build)
        return self.wrapper.run(q.contiguous(), (kv_cache[0], kv_cache[1]))


@functools.cache
def _for_device(device: torch.device) -> FlashInferAttention:
    return FlashInferAttention(device)


def flashinfer_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               kv_cache: torch.Tensor, meta: AttentionMetadata,
                               scale: float) -> torch.Tensor:
    """The FlashInfer path of ``conveyor.attention.paged.paged_attention`` (same inputs and
    output, less ``ops``): q [T, H, D]; k, v [T, KVH, D] written into their slots first;
    kv_cache [2, blocks, block_size, KVH, D] float16/bfloat16 on CUDA -> [T, H, D]."""
    return _for_device(q.device)(q, k, v, kv_cache, meta, scale)
