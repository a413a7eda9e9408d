"""Tensor parallelism's model side: which slice of every weight a rank holds, and the
collectives that join the slices (Megatron-style, as gpt-fast and nano-vllm shard Llama).

Each of N ranks holds:

- whole KV heads (a contiguous range, as even as the count allows) and the query heads of
  their GQA groups: column-parallel Q/K/V rows, row-parallel O columns;
- a range of the MLP's intermediate dimension (in units of 32, a GGUF block, when it allows):
  column-parallel gate/up rows, row-parallel down columns;
- a range of the vocabulary (equal lengths, the last one zero-padded): embedding rows and LM
  head rows.

A rank's model is then the plain model of a smaller config (``ShardPlan.local_config``: fewer
heads, a narrower MLP, a shorter vocabulary) plus one all-reduce after O, one after down, one
after the embedding lookup and an all-gather of the logits. KV heads are never replicated:
``tensor_parallel_size`` may not exceed the KV heads. Heads need not divide evenly (the
default SmolLM2 has 9 query and 3 KV heads: at N = 2 rank 0 holds 2 KV groups, rank 1 one).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

# Which sizes split a model is conveyor.config's rule (torch-free: `conveyor plan` uses it).
from conveyor.config import ModelConfig, check_tensor_parallel, mlp_unit


def split_range(total: int, parts: int, rank: int) -> tuple[int, int]:
    """(start, length) of part ``rank`` of ``total`` units split as evenly as possible
    (the first ``total % parts`` parts hold one more)."""
    base, extra = divmod(total, parts)
    return rank * base + min(rank, extra), base + (rank < extra)


@dataclass(frozen=True)
class Slice:
    """The part of a checkpoint tensor (HF layout ``[out, in]``) that a rank holds."""

    dim: int  # 0: rows (output features, column-parallel), 1: columns (row-parallel)
    start: int
    length: int  # may run past the tensor's end (the vocabulary): zero-padded


@dataclass(frozen=True)
class ShardPlan:
    """Which heads, MLP columns and vocabulary rows rank ``rank`` of ``size`` holds."""

    config: ModelConfig  # the whole model's
    rank: int
    size: int

    def __post_init__(self) -> None:
        check_tensor_parallel(self.config, self.size)

    @property
    def kv_heads(self) -> tuple[int, int]:
        """(first KV head, KV heads) of this rank."""
        return split_range(self.config.num_key_value_heads, self.size, self.rank)

    @property
    def q_heads(self) -> tuple[int, int]:
        """(first query head, query heads): those of this rank's GQA groups."""
        group = self.config.num_attention_heads // self.config.num_key_value_heads
        start, length = self.kv_heads
        return start * group, length * group

    @property
    def intermediate(self) -> tuple[int, int]:
        """(first MLP column, MLP columns) of this rank."""
        unit = mlp_unit(self.config)
        start, length = split_range(self.config.intermediate_size // unit, self.size,
                                    self.rank)
        return start * unit, length * unit

    @property
    def vocab(self) -> tuple[int, int]:
        """(first token id, vocabulary rows incl. padding): equal for every rank, so that
        the logits all-gather takes equal parts."""
        length = -(-self.config.vocab_size // self.size)
        return self.rank * length, length

    @property
    def local_config(self) -> ModelConfig:
        """The config of the plain model that this rank's shard is."""
        return dataclasses.replace(
            self.config, num_attention_heads=self.q_heads[1],
            num_key_value_heads=self.kv_heads[1], intermediate_size=self.intermediate[1],
            vocab_size=self.vocab[1])

    def cache_config(self) -> ModelConfig:
        """The local config of the rank with the most KV heads: it sizes every rank's KV
        cache, which must have the same number of blocks (one block table for all)."""
        most = ShardPlan(self.config, 0, self.size)  # rank 0 holds the most (split_range)
        return most.local_config

    def slice_of(self, name: str) -> Slice | None:
        """This rank's part of the checkpoint tensor ``name`` (HF name); None: all of it."""
        d = self.config.head_dim
        q0, qn = self.q_heads
        k0, kn = self.kv_heads
        i0, i_n = self.intermediate
        v0, vn = self.vocab
        rules = ((".q_proj.", Slice(0, q0 * d, qn * d)), (".k_proj.", Slice(0, k0 * d, kn * d)),
                 (".v_proj.", Slice(0, k0 * d, kn * d)), (".o_proj.", Slice(1, q0 * d, qn * d)),
                 (".gate_proj.", Slice(0, i0, i_n)), (".up_proj.", Slice(0, i0, i_n)),
                 (".down_proj.", Slice(1, i0, i_n)), ("embed_tokens.", Slice(0, v0, vn)),
                 ("lm_head.", Slice(0, v0, vn)))
        return next((s for key, s in rules if key in name), None)


def take(source: Any, shape: tuple[int, ...], part: Slice | None) -> Any:
    """``source[...]`` restricted to ``part`` (anything sliceable: a numpy memmap, a
    safetensors slice), reading only that part; padding is added by ``pad_to``."""
    if part is None:
        return source[:]
    stop = min(part.start + part.length, shape[part.dim])
    return source[part.start:stop] if part.dim == 0 else source[:, part.start:stop]


def pad_to(tensor: torch.Tensor, part: Slice | None) -> torch.Tensor:
    """Zero rows after a vocabulary slice that ran past the end of the tensor (only row
    slices do; ``tensor`` may have more dims, e.g. GGUF blocks ``[rows, blocks, bytes]``)."""
    if part is None or part.dim != 0 or tensor.shape[0] >= part.length:
        return tensor
    missing = (part.length - tensor.shape[0], *tensor.shape[1:])
    return torch.cat([tensor, tensor.new_zeros(missing)])


class TensorParallel:
    """One rank's shard plan and its communication group (``size == 1``: no-ops).

    ``backend`` is a ``torch.distributed`` process group object (gloo on CPU, NCCL on CUDA),
    built directly rather than as the process's default group, so an engine can be made,
    shut down and made again in one process.
    """

    def __init__(self, plan: ShardPlan | None, backend: Any = None) -> None:
        self.plan = plan
        self.backend = backend
        self.rank = plan.rank if plan is not None else 0
        self.size = plan.size if plan is not None else 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (in place)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        self.backend.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` [S, n], concatenated along the last dim: [S, size * n]."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.backend.allgather([parts], [x]).wait()
        return torch.cat(parts, -1)

    def embed(self, embedding: torch.nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: each rank looks up the ids in its range (zeros for
        the others), and the all-reduce adds the one non-zero row to the zeros (exact)."""
        if self.plan is None:
            return embedding(ids)
        start, length = self.plan.vocab
        local = ids - start
        mine = (local >= 0) & (local < length)
        x = embedding(local.clamp(0, length - 1)) * mine.unsqueeze(-1).to(embedding.weight.dtype)
        return self.all_reduce(x)


def connect(store: Any, rank: int, size: int, device: torch.device,
            timeout_s: float) -> Any:
    """A process group over ``store`` for ``size`` ranks: NCCL on CUDA, gloo elsewhere.
    Every collective fails after ``timeout_s`` (a rank that hangs); one whose peer died
    fails as soon as the connection drops."""
    from torch import distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":  # written like the CPU path; not run on this project's CI
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)
