"""The ops backend: one typed interface (``OpsBackend``) to the hot path's ops and what the
device can do, three implementations, chosen in one place (``select_backend``).

- ``ReferenceBackend``: the torch ops of ``reference.py``, on any device; the oracle the
  kernels are tested against, and what runs where no kernel is built.
- ``CpuKernelBackend``: the C++ kernels (``cpu_kernels``), with the fused decode loop,
  matmuls on GGUF blocks and, in bf16, the prefill attention kernel, as this CPU has them;
  with AMX or AVX512-BF16, a bf16 KV cache in the tile layout (``kv_cache_tiles``).
- ``CudaBackend``: the torch reference ops on CUDA tensors, with RMSNorm (and its residual
  add), SiLU-and-multiply and RoPE as one Triton kernel each (``triton_ops.py``), and as
  ``step_attention`` the paged-attention kernel ``attention/cuda_backend.py`` picks
  (FlashInfer, else Triton), which reads the blocks in place; without either, SDPA over
  gathered blocks.

Callers read the capability flags; they never test which backend they hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from conveyor.ops import cpu_kernels, reference

if TYPE_CHECKING:
    from conveyor.attention.cuda_backend import PagedAttentionFn


class OpsBackend(Protocol):
    """The ops the model, paged attention and the sampler call (signatures and in-place
    behaviour as in ``reference.py``, the prefill attention's as in
    ``reference_prefill_attention`` here), and the device's capabilities."""

    @property
    def name(self) -> str:
        """"reference", "cpu" or "cuda" (logs, benchmarks)."""

    @property
    def fused_decode(self) -> bool:
        """A decode-only step may run every decoder layer in one call
        (``model/cpu_decode.py``, ``cpu_kernels.decode_layers``)."""

    @property
    def quantized_matmuls(self) -> bool:
        """Matmuls may read a GGUF checkpoint's blocks in place (``PackedLinear.use_blocks``)
        in the model's dtype."""

    @property
    def prefill_attention_kernel(self) -> bool:
        """Prefill chunks attend through ``prefill_attention`` in the model's dtype (else
        SDPA, the prefix gathered)."""

    @property
    def prefill_rows_as_decodes(self) -> bool:
        """Every row of a prefill chunk attends as a decode (``decode_attention`` over its
        context), so a row's result never depends on its chunk."""

    @property
    def kv_cache_tiles(self) -> bool:
        """A cache in the model's dtype may take the tile layout (``reference.is_tiles``:
        stored as the AMX products and vdpbf16ps read it), which every op here reads and
        writes."""

    @property
    def step_attention(self) -> PagedAttentionFn | None:
        """A kernel that runs a whole step's paged attention (the K/V writes, decodes and
        prefill chunks, reading the blocks in place) in place of ``attention/paged.py``'s
        composition of the ops below: on CUDA, FlashInfer or the Triton kernel; None: the
        ops compose it."""

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm_(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                      eps: float) -> None: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def rotary_(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                num_heads: int, head_dim: int) -> None: ...

    def write_kv_(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None: ...

    def read_kv_(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None: ...

    def decode_attention(self, q: torch.Tensor, kv_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor,
                         scale: float) -> torch.Tensor: ...

    def write_decode_attention_(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                                slot_mapping: torch.Tensor, q: torch.Tensor,
                                block_tables: torch.Tensor, context_lens: torch.Tensor,
                                scale: float) -> torch.Tensor: ...

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int,
                          scale: float) -> torch.Tensor: ...

    def prefill_attention_tiles(self, q: torch.Tensor, kv_cache: torch.Tensor,
                                block_table: torch.Tensor, offset: int,
                                scale: float) -> torch.Tensor:
        """``prefill_attention`` over the chunk's keys and prefix as a tile-layout cache holds
        them (positions 0 ... offset + L - 1 of ``block_table``), read in place."""
        ...

    def argmax(self, logits: torch.Tensor) -> torch.Tensor: ...


def reference_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int,
                                scale: float) -> torch.Tensor:
    """q [L, H, D] at positions offset..offset+L-1; k, v [offset + L, KVH, D] -> [L, H, D]:
    each query attends to the keys at positions up to its own (the contract of
    ``cpu_kernels.prefill_attention``), through SDPA."""
    q_pos = torch.arange(q.shape[0], device=q.device) + offset
    mask = torch.arange(k.shape[0], device=q.device)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                         v.transpose(0, 1), attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out.transpose(0, 1)


def reference_prefill_attention_tiles(q: torch.Tensor, kv_cache: torch.Tensor,
                                      block_table: torch.Tensor, offset: int,
                                      scale: float) -> torch.Tensor:
    """The keys gathered out of the cache, then ``reference_prefill_attention``."""
    keys = offset + q.shape[0]
    k, v = (x[0, :, :keys].transpose(0, 1)
            for x in reference.gather_kv(kv_cache, block_table.unsqueeze(0), q.shape[-1],
                                         q.dtype))
    return reference_prefill_attention(q, k, v, offset, scale)


class ReferenceBackend:
    """The torch reference ops, on any device: no fused loop, no kernels."""

    name = "reference"
    fused_decode = False
    quantized_matmuls = False
    prefill_attention_kernel = False
    prefill_rows_as_decodes = False
    kv_cache_tiles = False  # the reference reads and writes it, but nothing gains from it
    step_attention: PagedAttentionFn | None = None

    rms_norm = staticmethod(reference.rms_norm)
    add_rms_norm_ = staticmethod(reference.add_rms_norm_)
    silu_mul = staticmethod(reference.silu_mul)
    rotary_ = staticmethod(reference.rotary_)
    write_kv_ = staticmethod(reference.write_kv_)
    read_kv_ = staticmethod(reference.read_kv_)
    decode_attention = staticmethod(reference.decode_attention)
    write_decode_attention_ = staticmethod(reference.write_decode_attention_)
    prefill_attention = staticmethod(reference_prefill_attention)
    prefill_attention_tiles = staticmethod(reference_prefill_attention_tiles)
    argmax = staticmethod(reference.argmax)


class CudaBackend(ReferenceBackend):
    """The CUDA path: the torch reference ops on CUDA tensors (the elementwise ones as Triton
    kernels, ``triton_ops.py``, where Triton imports), and for attention the kernel
    ``attention/cuda_backend.py`` picks for the model's dtype and this GPU (FlashInfer, else
    the Triton kernel: ``step_attention``, blocks read in place); where neither runs, SDPA
    over gathered blocks. CUDA graphs wrap the model from the runner
    (``runner/cuda_graphs.py``), not through this interface."""

    name = "cuda"

    def __init__(self, dtype: torch.dtype) -> None:
        from conveyor.attention.cuda_backend import (
            cuda_paged_attention_backend,
            paged_attention_kernel,
            triton_runs,
        )

        self.attention = cuda_paged_attention_backend(dtype)
        self.step_attention = paged_attention_kernel(self.attention)
        if not triton_runs():  # one kernel per op where Triton runs (torch's CUDA wheels bring it)
            return
        from conveyor.ops import triton_ops

        self.rms_norm = triton_ops.rms_norm
        self.add_rms_norm_ = triton_ops.add_rms_norm_
        self.silu_mul = triton_ops.silu_mul
        self.rotary_ = triton_ops.rotary_


class CpuKernelBackend:
    """The C++ kernels (built: ``cpu_kernels.load_cpu_kernels()``), for a model in ``dtype``."""

    name = "cpu"
    fused_decode = True
    step_attention: PagedAttentionFn | None = None  # the ops below compose it

    def __init__(self, dtype: torch.dtype) -> None:
        if dtype == torch.float32:
            self.quantized_matmuls = cpu_kernels.f32_kernels_available()
        else:
            self.quantized_matmuls = dtype == torch.bfloat16 and (
                cpu_kernels.amx_available()
                or cpu_kernels.dot_kernels_available(amx_matmuls=False))  # either family
        self.prefill_attention_kernel = (dtype == torch.bfloat16
                                         and cpu_kernels.prefill_attention_available())
        # float32 has no prefill attention kernel, and SDPA's blocking makes a query's result
        # depend on its chunk: every row attends as its decode would (docs/benchmarks.md).
        self.prefill_rows_as_decodes = dtype == torch.float32
        # Decode attention reads a bf16 cache stored for its products (AMX tiles, or
        # vdpbf16ps without AMX): no step repacks the K/V, a verify's rows share each read
        # (docs/benchmarks.md, issues 11 and 15), and no horizontal sums.
        self.kv_cache_tiles = (dtype == torch.bfloat16
                               and cpu_kernels.prefill_attention_available())

    rms_norm = staticmethod(cpu_kernels.rms_norm)
    add_rms_norm_ = staticmethod(cpu_kernels.add_rms_norm_)
    silu_mul = staticmethod(cpu_kernels.silu_mul)
    rotary_ = staticmethod(cpu_kernels.rotary_)
    write_kv_ = staticmethod(cpu_kernels.write_kv_)
    read_kv_ = staticmethod(cpu_kernels.read_kv_)
    decode_attention = staticmethod(cpu_kernels.decode_attention)
    write_decode_attention_ = staticmethod(cpu_kernels.write_decode_attention_)
    prefill_attention = staticmethod(cpu_kernels.prefill_attention)
    prefill_attention_tiles = staticmethod(cpu_kernels.prefill_attention_tiles)
    argmax = staticmethod(cpu_kernels.argmax)

    # The fused decode loop (``fused_decode``): CPU only, so not part of ``OpsBackend``.
    decode_layers = staticmethod(cpu_kernels.decode_layers)


# mypy proves that each backend implements the protocol.
BACKENDS: tuple[type[OpsBackend], ...] = (ReferenceBackend, CpuKernelBackend, CudaBackend)


def select_backend(device: torch.device, dtype: torch.dtype) -> OpsBackend:
    """The backend for a model in ``dtype`` on ``device``: the C++ kernels on CPU where they
    build (and ``CONVEYOR_KERNELS`` is not 0), the CUDA backend on CUDA, else the reference."""
    if device.type == "cpu" and cpu_kernels.load_cpu_kernels():
        return CpuKernelBackend(dtype)
    if device.type == "cuda":
        return CudaBackend(dtype)
    return ReferenceBackend()
