"""A step's attention metadata as paged-attention kernels read it (Triton, FlashInfer):
one list of sequences, decodes and prefill chunks alike, each with its query rows at the end
of its keys. Torch only (no kernel library), so the backend selector imports it anywhere.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
import torch.nn.functional as F

from conveyor.attention.metadata import AttentionMetadata, HostSequences
from conveyor.ops.transfer import upload

T = TypeVar("T")


@dataclass(frozen=True)
class PagedBatch:
    """The step's sequences: decodes (one query row each) first, then prefill chunks. Sequence
    s's query row i sits at position ``seq_lens[s] - query_len + i`` and sees the keys at
    positions up to its own."""

    # [S + 1] int32: sequence s's query rows are query_start[s] : query_start[s + 1]
    query_start: torch.Tensor
    # [S] int32: keys of sequence s, its cached prefix and its query rows
    seq_lens: torch.Tensor
    # [S, max_blocks] int64 block tables (padding: block 0, never read)
    block_tables: torch.Tensor
    max_query_len: int  # on the host: a kernel's grid, without a device sync

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


def paged_batch(meta: AttentionMetadata, block_size: int) -> PagedBatch:
    """The kernels' view of a step. A chunk given no block table has no prefix: its blocks are
    named by every block_size-th of its slots (positions 0, 1, ..., just written)."""
    device = meta.slot_mapping.device
    nd = meta.num_decodes
    tables: list[torch.Tensor] = []
    lens: list[torch.Tensor] = []
    if nd:
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        tables.append(meta.decode_block_tables)
        lens.append(meta.decode_context_lens)
    # A decode-only step (what CUDA graphs capture) copies nothing from the host: a copy
    # captured in a graph would replay from a host buffer long since reused.
    starts = [torch.arange(nd + 1, dtype=torch.int32, device=device)]
    chunk_ends = []
    for chunk in meta.prefills:
        table = chunk.block_table
        if table is None:
            end = chunk.query_start + chunk.query_len
            table = meta.slot_mapping[chunk.query_start:end:block_size] // block_size
        tables.append(table.view(1, -1))
        chunk_ends.append(chunk.query_start + chunk.query_len)
    if meta.prefills:
        starts.append(upload(chunk_ends, device, torch.int32))
        lens.append(upload([c.num_computed_tokens + c.query_len for c in meta.prefills],
                           device, torch.int64))
    width = max(t.shape[1] for t in tables)
    block_tables = torch.cat([F.pad(t, (0, width - t.shape[1])) for t in tables])
    max_query_len = max([1 if nd else 0] + [c.query_len for c in meta.prefills])
    return PagedBatch(torch.cat(starts),
                      torch.cat(lens).to(torch.int32), block_tables, max_query_len)


@dataclass
class PagePlan:
    """A step's sequences in the CSR form of paged-attention planners (FlashInfer's): query
    rows per sequence (``qo_indptr``), its pages (``kv_indices`` from ``kv_indptr``) and the
    positions used in its last page, as int32 tensors on the host."""

    qo_indptr: torch.Tensor  # [num_seqs + 1]
    kv_indptr: torch.Tensor  # [num_seqs + 1]
    kv_indices: torch.Tensor  # [kv_indptr[-1]]
    last_page_len: torch.Tensor  # [num_seqs]


def host_page_plan(host: HostSequences, block_size: int, pin: bool = False) -> PagePlan:
    """``PagePlan`` of the step from the host's numbers: no copy from the device. ``pin``:
    in pinned memory, so that their copies to a GPU do not wait for it either."""
    num_pages = [-(-n // block_size) for n in host.seq_lens]
    indices = [b for table, n in zip(host.block_tables, num_pages, strict=True)
               for b in table[:n]]

    def int32(values: list[int]) -> torch.Tensor:
        tensor = torch.tensor(values, dtype=torch.int32)
        return tensor.pin_memory() if pin else tensor

    return PagePlan(int32([0, *itertools.accumulate(host.query_lens)]),
                    int32([0, *itertools.accumulate(num_pages)]), int32(indices),
                    int32([n - (p - 1) * block_size
                           for n, p in zip(host.seq_lens, num_pages, strict=True)]))


def device_page_plan(batch: PagedBatch, block_size: int) -> PagePlan:
    """``PagePlan`` of the step from its device tensors (on their device; reading them on
    the host waits for the device, and ``block_tables[used]`` does so by itself)."""
    seq_lens = batch.seq_lens
    num_pages = (seq_lens + block_size - 1) // block_size
    used = (torch.arange(batch.block_tables.shape[1], device=seq_lens.device)[None, :]
            < num_pages[:, None])
    indptr = torch.zeros(batch.num_seqs + 1, dtype=torch.int32, device=seq_lens.device)
    indptr[1:] = torch.cumsum(num_pages, 0)
    return PagePlan(batch.query_start, indptr, batch.block_tables[used].to(torch.int32),
                    (seq_lens - (num_pages - 1) * block_size).to(torch.int32))


class StepMemo(Generic[T]):
    """A value derived from one step's AttentionMetadata, kept for the step: every layer of a
    step is given the same metadata object, so the first layer builds the value (a PagedBatch,
    a FlashInfer plan) and the others reuse it. A weak reference: a finished step's metadata
    is not kept alive."""

    def __init__(self) -> None:
        self._meta: weakref.ref[AttentionMetadata] | None = None
        self._key: object = None
        self._value: T | None = None

    def get(self, meta: AttentionMetadata, key: object, build: Callable[[], T]) -> T:
        """The value for this metadata object and ``key`` (what else it was built from, e.g.
        the cache's block size: a draft model's cache may differ), built if not yet."""
        if (self._value is None or self._meta is None or self._meta() is not meta
                or self._key != key):
            self._value = build()
            self._meta, self._key = weakref.ref(meta), key
        return self._value
