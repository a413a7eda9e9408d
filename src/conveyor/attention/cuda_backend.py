"""Which paged-attention kernel a CUDA device runs: FlashInfer where it imports and the GPU
supports it, else the project's Triton kernel, else the torch reference (gathers blocks, then
SDPA). Kernel libraries are imported here only, behind guards, so a machine without them (CI,
a CPU) imports conveyor as before.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable
from typing import Literal

import torch

from conveyor.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

AttentionBackendName = Literal["flashinfer", "triton", "torch"]
# q, k, v, kv_cache, metadata, scale -> out: conveyor.attention.paged.paged_attention less ops
PagedAttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                             AttentionMetadata, float], torch.Tensor]

# FlashInfer's prebuilt and JIT kernels for bf16 need Ampere (sm_80) or newer; Triton's tl.dot
# needs Volta (sm_70) tensor cores or newer.
FLASHINFER_MIN_CAPABILITY = (8, 0)
TRITON_MIN_CAPABILITY = (7, 0)


@functools.cache
def _imports(module: str) -> bool:
    """Whether ``module`` is installed and imports (a broken install logs why it is passed
    over)."""
    if importlib.util.find_spec(module) is None:
        return False
    try:
        importlib.import_module(module)
    except Exception as exc:  # a library built for another CUDA/torch fails in many ways
        logger.warning("%s is installed but does not import (%s): not used", module, exc)
        return False
    return True


def triton_runs(device: int | None = None) -> bool:
    """Whether Triton kernels run on CUDA device ``device``: sm_70+ and ``triton`` imports
    (the paged-attention kernel's test, and ``CudaBackend``'s for its Triton ops)."""
    return (torch.cuda.is_available()
            and torch.cuda.get_device_capability(device) >= TRITON_MIN_CAPABILITY
            and _imports("triton"))


def cuda_paged_attention_backend(dtype: torch.dtype = torch.bfloat16,
                                 kv_cache_dtype: str = "auto",
                                 device: int | None = None) -> AttentionBackendName:
    """The paged-attention kernel for a model of ``dtype`` on CUDA device ``device``:
    "flashinfer" (float16/bfloat16, sm_80+, ``flashinfer`` imports), else "triton" (sm_70+,
    ``triton`` imports), else "torch". An int8 KV cache (laid out for the CPU kernel) and a
    machine without CUDA take "torch"."""
    if kv_cache_dtype == "int8" or not torch.cuda.is_available():
        return "torch"
    capability = torch.cuda.get_device_capability(device)
    if (dtype in (torch.float16, torch.bfloat16) and capability >= FLASHINFER_MIN_CAPABILITY
            and _imports("flashinfer")):
        return "flashinfer"
    return "triton" if triton_runs(device) else "torch"


def paged_attention_kernel(name: AttentionBackendName) -> PagedAttentionFn | None:
    """The entry point of a kernel backend (None for "torch": the caller keeps
    ``conveyor.attention.paged.paged_attention`` with the reference ops)."""
    if name == "flashinfer":
        from conveyor.attention.flashinfer_paged import flashinfer_paged_attention
        return flashinfer_paged_attention
    if name == "triton":
        from conveyor.attention.triton_paged import triton_paged_attention
        return triton_paged_attention
    return None
