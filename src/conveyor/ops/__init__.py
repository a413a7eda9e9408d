"""The hot path's ops behind one typed interface (``backend.OpsBackend``), chosen per device
and dtype by ``select_backend``.

The ops: ``rms_norm``, ``add_rms_norm_``, ``silu_mul``, ``rotary_``, ``write_kv_``,
``read_kv_``, ``decode_attention``, ``write_decode_attention_``, ``prefill_attention`` and
``argmax`` (signatures in ``reference.py``; ``prefill_attention``'s and its tile-layout
twin's references are ``backend.reference_prefill_attention`` and ``_tiles``), plus capability
flags the callers read (``fused_decode``, ``quantized_matmuls``, ``prefill_attention_kernel``,
``prefill_rows_as_decodes``, ``kv_cache_tiles``).

On CPU they are the C++ kernels (``cpu_kernels.py``, the only module that calls
``torch.ops.conveyor``), built from ``csrc/*.cpp`` on first use. Each kernel replaces several
torch ops (norm: 8, RoPE: 6, attention: 2 gathers + mask + SDPA) with one call that does no
extra copies; ``decode_layers`` runs every decoder layer of a decode-only step in one call
(``model/cpu_decode.py``); for bf16 on CPUs with AMX (``amx_available``) ``quantized_linear``
(``csrc/quant_linear.cpp``: decode matmuls that read a GGUF's Q4_0/Q4_1/Q8_0 blocks in place,
bit-identical to oneDNN on the bf16 weights); with AVX512-BF16 and no AMX, or with AMX under
the engine argument ``amx_matmuls=False`` (``dot_kernels_available``) ``dot_linear``, every
matmul at every batch size, on bf16 pair tiles or GGUF blocks (``csrc/dot_linear.cpp``,
``csrc/dot_blocks.cpp``; with AVX512-VNNI (``vnni_blocks_available``) the blocks take int8
inputs, ``csrc/vnni_blocks.cpp``), and for float32 with AVX2 (``f32_kernels_available``)
the same on float32 lane tiles or GGUF blocks (``csrc/f32_linear.cpp``); and
``prefill_attention`` with either (``csrc/prefill_attention.cpp``). If the build fails (no
C++ compiler) the engine logs why and runs the reference. ``CONVEYOR_KERNELS=0`` selects the
reference on CPU too.
"""

from __future__ import annotations

from conveyor.ops.backend import (
    CpuKernelBackend,
    CudaBackend,
    OpsBackend,
    ReferenceBackend,
    select_backend,
)
from conveyor.ops.cpu_kernels import (
    amx_available,
    dot_kernels_available,
    f32_kernels_available,
    load_cpu_kernels,
    prefill_attention_available,
    vnni_blocks_available,
)

__all__ = ["CpuKernelBackend", "CudaBackend", "OpsBackend", "ReferenceBackend",
           "amx_available", "dot_kernels_available", "f32_kernels_available",
           "load_cpu_kernels", "prefill_attention_available", "select_backend",
           "vnni_blocks_available"]
