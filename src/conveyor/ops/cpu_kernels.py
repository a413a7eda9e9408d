"""The C++ CPU kernels (``csrc/*.cpp``): their build, what this CPU runs, and every call
into ``torch.ops.conveyor`` as a typed function (the one module that reaches that namespace).

Built by ``torch.utils.cpp_extension`` on first use (~40 s with g++ and ninja on 2 cores;
cached under ``~/.cache/torch_extensions``, or ``$TORCH_EXTENSIONS_DIR``), keyed by this
CPU's features (``-march=native``). If the build fails (no C++ compiler) the engine logs why
and runs the torch reference; ``CONVEYOR_KERNELS=0`` selects the reference on CPU too.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# Two translation units (kernels.cpp includes the matmul and attention files).
_SOURCES = [Path(__file__).parent / "csrc" / name for name in ("cpu_ops.cpp", "kernels.cpp")]
# -fopenmp: at::parallel_for is inlined from ATen headers and runs serially without it.
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
# A load that took longer than this built (or rebuilt) the kernels: say when they are ready.
_REPORTED_BUILD_S = 2.0


def _cpu_tag() -> str:
    """Kernels are compiled for this CPU (-march=native): key the build by its features."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


@functools.cache
def load_cpu_kernels() -> bool:
    """Build (once per machine) and load the C++ kernels; False, with a warning, if that
    fails."""
    if os.environ.get("CONVEYOR_KERNELS", "1") == "0":
        return False
    from torch.utils import cpp_extension

    name = f"conveyor_cpu_ops_{_cpu_tag()}"
    try:
        build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
        with _build_lock(build_dir):
            if not any(build_dir.glob(f"{name}*.so")):
                logger.info("building the C++ kernels for this CPU in %s (first start: ~40 s "
                            "on 2 cores, then cached)", build_dir)
            start = time.perf_counter()
            cpp_extension.load(name=name, sources=[str(p) for p in _SOURCES],
                               extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"],
                               is_python_module=False, verbose=False)
            if time.perf_counter() - start > _REPORTED_BUILD_S:
                logger.info("C++ kernels ready in %.0f s", time.perf_counter() - start)
    except Exception as exc:  # no compiler, no ninja, a build error: run the reference
        logger.warning("C++ kernels unavailable, using the torch reference ops: %s", exc)
        return False
    return True


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Hold an flock on the build folder while building or loading the kernels.

    torch guards a build with a plain ``lock`` file that its builder deletes when done; a
    build killed midway leaves it behind, and every later start then waits for it forever.
    The flock is released by the kernel when its holder dies, so whoever holds it knows that
    no other conveyor process is building here: a ``lock`` file found then is stale.
    """
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "conveyor.flock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process building the C++ kernels in %s", build_dir)
            fcntl.flock(f, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            logger.warning("removing %s, left by a kernel build that was killed", stale)
            stale.unlink(missing_ok=True)
        yield


@functools.cache
def amx_available() -> bool:
    """Whether the AMX kernels (``quantized_linear``, and ``prefill_attention``'s tile
    products) can run: the C++ kernels are built, with AMX-BF16, and the OS grants the tile
    registers."""
    return load_cpu_kernels() and bool(torch.ops.conveyor.amx_available())


@functools.cache
def prefill_attention_available() -> bool:
    """Whether ``prefill_attention`` can run: the C++ kernels are built with AVX512-BF16 (it
    uses AMX tiles where the CPU grants them)."""
    return load_cpu_kernels() and bool(torch.ops.conveyor.prefill_attention_available())


@functools.cache
def dot_kernels_available(amx_matmuls: bool = True) -> bool:
    """Whether bf16 matmuls take the AVX512-BF16 dot kernels (``dot_linear``, one kernel for
    every batch size): the C++ kernels are built with AVX512-BF16, and the CPU has no AMX or
    ``amx_matmuls`` (the engine argument) is off; otherwise AMX's own kernels
    (``quantized_linear`` beside oneDNN) run."""
    return (load_cpu_kernels() and bool(torch.ops.conveyor.dot_linear_available())
            and not (amx_matmuls and amx_available()))


@functools.cache
def vnni_blocks_available(amx_matmuls: bool = True) -> bool:
    """Whether bf16 matmuls on GGUF blocks can quantize their inputs to int8
    (``pack_vnni_blocks``, ``csrc/vnni_blocks.cpp``): the dot kernels run here (as
    ``dot_kernels_available``) and were built with AVX512-VNNI."""
    return (dot_kernels_available(amx_matmuls)
            and bool(torch.ops.conveyor.vnni_blocks_available()))


@functools.cache
def f32_kernels_available() -> bool:
    """Whether float32 matmuls take the AVX2 dot kernels (``dot_linear`` on float32: one
    kernel for every batch size; ``csrc/f32_linear.cpp``, on 16-lane registers with AVX-512):
    the C++ kernels are built with AVX2 and FMA. Every CPU that runs float32 by default (no
    bf16 matrix units) has them."""
    return load_cpu_kernels() and bool(torch.ops.conveyor.f32_linear_available())


def f32_vector_lanes(lanes: int = 0) -> int:
    """Outputs per register of the float32 kernels (16 with AVX-512, else 8: the same bits
    either way), as it was before the call; ``lanes`` > 0 sets it (8, or this CPU's widest:
    for comparisons)."""
    return int(torch.ops.conveyor.f32_vector_lanes(lanes))


# ---------------------------------------------------------------- the kernels, typed
# Signatures and in-place behaviour as in reference.py, where the op has a reference.

def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.conveyor.rms_norm(x, w, eps)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                  eps: float) -> None:
    torch.ops.conveyor.add_rms_norm_(x, residual, w, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return torch.ops.conveyor.silu_mul(gate_up)


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
            num_heads: int, head_dim: int) -> None:
    torch.ops.conveyor.rotary_(x, positions, cos_sin, num_heads, head_dim)


def write_kv_(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
    torch.ops.conveyor.write_kv_(k, v, kv_cache, slot_mapping)


def read_kv_(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    torch.ops.conveyor.read_kv_(k, v, kv_cache, slot_mapping)


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.ops.conveyor.decode_attention(q, kv_cache, block_tables, context_lens, scale)


def write_decode_attention_(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                            slot_mapping: torch.Tensor, q: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor,
                            scale: float) -> torch.Tensor:
    return torch.ops.conveyor.write_decode_attention_(k, v, kv_cache, slot_mapping, q,
                                                      block_tables, context_lens, scale)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int,
                      scale: float) -> torch.Tensor:
    """bf16, AMX tiles or AVX512-BF16 (``prefill_attention_available``), head_dim a multiple
    of 32 up to 256."""
    return torch.ops.conveyor.prefill_attention(q, k, v, offset, scale)


def prefill_attention_tiles(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                            offset: int, scale: float) -> torch.Tensor:
    """``prefill_attention`` over a tile-layout cache (``reference.is_tiles``) that holds the
    chunk's keys and its prefix at positions 0 ... offset + L - 1 of ``block_table`` [n]."""
    return torch.ops.conveyor.prefill_attention_tiles(q, kv_cache, block_table, offset, scale)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.ops.conveyor.argmax(logits)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
                         ) -> None:
    """-inf for every token of ``logits[rows[i]]`` whose bit in ``bitmask[i]`` is clear."""
    torch.ops.conveyor.apply_token_bitmask_(logits, bitmask, rows)


# ---------------------------------------------------------------- matmuls (PackedLinear)

def linear(x: torch.Tensor, packed: torch.Tensor, blocks: torch.Tensor | None,
           bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T + b: the kernel picked by the weight's layout (pair or lane tiles: the dot
    kernels; oneDNN-packed: oneDNN, or the GGUF ``blocks`` for small batches with AMX)."""
    return torch.ops.conveyor.linear(x, packed, blocks, bias)


def dot_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.conveyor.dot_linear(x, w, bias)


def pack_dot_weight(w: torch.Tensor) -> torch.Tensor:
    """A bf16 (pair tiles) or float32 (lane tiles) weight laid out for ``dot_linear``."""
    return torch.ops.conveyor.pack_dot_weight(w)


def pack_dot_blocks(raw: torch.Tensor, qtype: int, dtype: torch.dtype,
                    k_mixed: bool = False) -> torch.Tensor:
    """GGUF blocks (uint8 ``[out, in / 32, block bytes]`` of GGML type ``qtype``; Q4_K and
    Q6_K ``[out, in / 256, ...]``) for ``dot_linear`` in ``dtype``. ``k_mixed``: as
    ``pack_vnni_blocks``'s."""
    return torch.ops.conveyor.pack_dot_blocks(raw, qtype, dtype, k_mixed)


def pack_vnni_blocks(raw: torch.Tensor, qtype: int, k_mixed: bool = False) -> torch.Tensor:
    """GGUF blocks (Q4_0, Q4_1, Q8_0; Q4_K ``[out, in / 256, 144]`` and Q6_K ``[out, in / 256,
    210]``, repacked per 32) for ``dot_linear`` on bf16 inputs quantized to int8 per block of
    32 (int8 records: ``csrc/vnni_blocks.cpp``). ``k_mixed`` (Q4_K, Q6_K): records of one
    kind for both, so that the parts of a matmul fused from the two types concatenate."""
    return torch.ops.conveyor.pack_vnni_blocks(raw, qtype, k_mixed)


def pack_block_weights(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    """GGUF blocks repacked for ``quantized_linear`` (AMX)."""
    return torch.ops.conveyor.pack_block_weights(raw, qtype)


def quantized_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None
                     ) -> torch.Tensor:
    return torch.ops.conveyor.quantized_linear(x, w, bias)


def quantized_linear_max_rows() -> int:
    """The most rows ``linear`` sends to ``quantized_linear`` (larger batches: oneDNN)."""
    return int(torch.ops.conveyor.quantized_linear_max_rows())


def onednn_small_rows() -> int:
    """The most rows of a call for which oneDNN gives every row its bits alone (and
    ``quantized_linear`` matches it)."""
    return int(torch.ops.conveyor.onednn_small_rows())


# ---------------------------------------------------------------- the fused decode loop

@dataclass(frozen=True, slots=True)
class DecodeLayersWeights:
    """What ``decode_layers`` reads of the model, one entry per decoder layer (in the op's
    argument order): packed matmul weights (oneDNN or dot tiles), with their GGUF blocks
    where the matmul reads them."""

    input_norms: Sequence[torch.Tensor]
    post_norms: Sequence[torch.Tensor]
    qkv: Sequence[torch.Tensor]
    qkv_bias: Sequence[torch.Tensor | None]
    o: Sequence[torch.Tensor]
    gate_up: Sequence[torch.Tensor]
    down: Sequence[torch.Tensor]
    qkv_blocks: Sequence[torch.Tensor | None]
    o_blocks: Sequence[torch.Tensor | None]
    gate_up_blocks: Sequence[torch.Tensor | None]
    down_blocks: Sequence[torch.Tensor | None]
    final_norm: torch.Tensor


@dataclass(frozen=True, slots=True)
class DecodeShape:
    """The attention shape and norm epsilon ``decode_layers`` runs with."""

    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int


def decode_layers(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                  kv_caches: torch.Tensor, slot_mapping: torch.Tensor,
                  block_tables: torch.Tensor, context_lens: torch.Tensor,
                  weights: DecodeLayersWeights, shape: DecodeShape) -> torch.Tensor:
    """Every decoder layer of a decode-only batch and the final norm, in one call: x [B,
    hidden] (the embeddings) -> [B, hidden]; the same ops in the same order as the model's
    Python loop (bit-identical)."""
    w = weights
    return torch.ops.conveyor.decode_layers(
        x, positions, cos_sin, kv_caches, slot_mapping, block_tables, context_lens,
        w.input_norms, w.post_norms, w.qkv, w.qkv_bias, w.o, w.gate_up, w.down, w.qkv_blocks,
        w.o_blocks, w.gate_up_blocks, w.down_blocks, w.final_norm, shape.eps, shape.num_heads,
        shape.num_kv_heads, shape.head_dim)
