"""CUDA graphs for decode-only steps: capture per batch-size bucket at start, pad, replay.

A decode step of a small model launches hundreds of small kernels; launched one by one from
Python they cost more than their math (docs/benchmarks.md: ~21 ms a step on an H200 at every
batch size). A CUDA graph records the launches of one forward pass once and replays them
with one call. A graph replays fixed shapes on fixed memory, so:

- it is captured for a few batch sizes (``graph_batch_sizes``: 1, 2, 4, 8, then multiples
  of 8 up to the first that holds ``max_num_seqs``), and a step of B decodes runs the
  smallest bucket >= B (``bucket_for``), its last rows padding;
- its inputs are static buffers, allocated once for the largest bucket and sliced per bucket
  (every graph reads the same memory): a step copies its inputs into them and replays;
- block tables are as wide as ``max_model_len`` needs (``max_blocks_per_seq``): entries past
  a row's context length are masked out by its ``context_lens`` and never read unmasked;
- padded rows write their K/V to a scratch block the KV cache manager never hands out
  (``scratch_block``, one block past its blocks) and attend to it alone; their outputs are
  dropped.

Only decode-only steps replay (``CudaGraphRunner.eligible``): decodes, and verifications of
drafts whose rows run as decodes (``ModelRunner._is_decode``: every cache but int8), when the
largest bucket holds their rows. A step with a prefill chunk (mixed prefill + decode) has a
token count and a chunk layout no bucket holds, and runs eagerly. ``enforce_eager=True``
(vLLM's name) turns graphs off.

On a device other than CUDA, ``capture`` records no graph: ``run`` then runs the same padded
forward on the same static buffers eagerly. The engine never does that (it makes a
``CudaGraphSpec`` on CUDA only); the tests on CPU do, to check the padding, the scratch
block and the buffer reuse that a graph replays.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from conveyor.attention.metadata import AttentionMetadata
from conveyor.model.llama import CausalLM

# Buckets double up to this size, then grow by it: most steps of a busy engine are large,
# and a graph per multiple of 8 pads a step by fewer than 8 rows.
GRAPH_BATCH_STEP = 8
# Blocks allocated past the KV cache manager's blocks: the scratch block of padded rows.
SCRATCH_BLOCKS = 1


def graph_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The captured batch sizes: 1, 2, 4, 8, then multiples of 8, up to the first size that
    holds ``max_num_seqs`` decodes (a step of one token a request never has more; a verify
    step past the largest runs eagerly)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [1]
    while sizes[-1] < max_num_seqs:
        last = sizes[-1]
        sizes.append(last * 2 if last < GRAPH_BATCH_STEP else last + GRAPH_BATCH_STEP)
    return tuple(sizes)


def bucket_for(num_decodes: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest captured size that holds ``num_decodes`` rows; None past the largest."""
    i = bisect.bisect_left(sizes, num_decodes)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True)
class CudaGraphSpec:
    """What to capture: the buckets and the width of the static block tables."""

    batch_sizes: tuple[int, ...]  # ascending; the last holds max_num_seqs decodes
    max_blocks_per_seq: int  # blocks of a max_model_len sequence

    @classmethod
    def for_engine(cls, device: torch.device, enforce_eager: bool, max_num_seqs: int,
                   max_model_len: int, block_size: int) -> CudaGraphSpec | None:
        """The spec for an engine on ``device``; None (eager steps) off CUDA or with
        ``enforce_eager``."""
        if device.type != "cuda" or enforce_eager:
            return None
        return cls(graph_batch_sizes(max_num_seqs), -(-max_model_len // block_size))


class CudaGraphRunner:
    """The decode-only forward pass of ``model``, one captured graph per bucket."""

    def __init__(self, model: CausalLM, kv_caches: torch.Tensor, spec: CudaGraphSpec,
                 scratch_block: int, block_size: int) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.spec = spec
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * block_size  # every padded row writes here
        device, rows = kv_caches.device, spec.batch_sizes[-1]
        self.device = device

        def buffer(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int64, device=device)

        # The static inputs, [rows] or [rows, max_blocks]; a bucket of B reads rows [:B].
        self.input_ids = buffer(rows)
        self.positions = buffer(rows)
        self.slot_mapping = buffer(rows)
        self.block_tables = buffer(rows, spec.max_blocks_per_seq)
        self.context_lens = buffer(rows)
        # bucket -> a call that replays its graph and returns its output [B, hidden]
        self._replays: dict[int, Callable[[], torch.Tensor]] = {}
        self._pool: Any = None  # the graphs' shared memory pool (torch's opaque handle)
        self.replays = 0  # steps run through a graph

    @property
    def max_batch_size(self) -> int:
        return self.spec.batch_sizes[-1]

    def eligible(self, meta: AttentionMetadata) -> bool:
        """A decode-only step that a bucket holds (else the step runs eagerly)."""
        return not meta.prefills and 0 < meta.num_decodes <= self.max_batch_size

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket (again, after the model's ops changed), largest first so
        that the smaller graphs reuse its memory. Every row is padding meanwhile: capturing
        writes K/V to the scratch block alone."""
        self._replays.clear()
        self._pad(0, self.max_batch_size)
        with no_collection_inside():
            for size in reversed(self.spec.batch_sizes):
                self._replays[size] = self._capture_one(size)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
            ) -> torch.Tensor:
        """The eligible step's hidden states [num_decodes, hidden]: its inputs copied into
        the static buffers, its bucket's padding reset, its graph replayed. The result is
        the graph's output memory: read it before the next ``run``."""
        assert self.eligible(meta) and meta.decode_block_tables is not None \
            and meta.decode_context_lens is not None
        n = meta.num_decodes
        size = bucket_for(n, self.spec.batch_sizes)
        assert size is not None
        width = meta.decode_block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.decode_block_tables, non_blocking=True)
        self.context_lens[:n].copy_(meta.decode_context_lens, non_blocking=True)
        self._pad(n, size)
        self.replays += 1
        return self._replays[size]()[:n]

    def _pad(self, start: int, stop: int) -> None:
        """Rows [start, stop) become padding: token 0 at position 0, written to the scratch
        slot, attending to that slot alone."""
        self.input_ids[start:stop] = 0
        self.positions[start:stop] = 0
        self.slot_mapping[start:stop] = self.scratch_slot
        self.block_tables[start:stop] = self.scratch_block
        self.context_lens[start:stop] = 1

    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(self.slot_mapping[:size], size, self.block_tables[:size],
                                 self.context_lens[:size], [])
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)

    def _capture_one(self, size: int) -> Callable[[], torch.Tensor]:
        if self.device.type != "cuda":  # no graph: the same padded forward, eagerly
            return lambda: self._forward(size)
        self._forward(size)  # warm-up outside the graph: lazy set-up, library workspaces
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._forward(size)
        self._pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


@contextlib.contextmanager
def no_collection_inside() -> Iterator[None]:
    """Python's cycle collector collected once, then held off until the block ends. A
    collection inside a capture frees whatever dead objects it finds, a dead engine's pinned
    buffers among them, and freeing one records a CUDA event on the stream that last used it,
    outside the capture: the capture is invalidated ("operation failed due to a previous error
    during capture": on an H200, an engine built in a test process where earlier engines had
    died). torch's own ``graph`` collects first only under ``force_cudagraph_gc``."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()

