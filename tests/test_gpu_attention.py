"""The paged-attention kernels on a CUDA device (skipped without one; CI has none): the Triton
kernel compiled (tensor cores, not the interpreter of tests/test_triton_attention.py) and
FlashInfer where it imports, each against the torch reference path on the same CUDA tensors,
and the backend selector's choice."""

from __future__ import annotations

import pytest
import torch

from attention_cases import Seq, check_against_reference, make_step
from conveyor.attention.cuda_backend import cuda_paged_attention_backend, paged_attention_kernel

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# float32 products are exact (input_precision="ieee"); half types round P (and the
# reference's SDPA rounds its own intermediates).
ATOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
# Decodes of lengths 1 to 300, a fresh 77-token prompt, a 100-row chunk on a 250-key prefix
# and a chunk whose last rows recompute generated tokens: several query and key tiles.
STEP = [Seq(0, decode=True), Seq(16, decode=True), Seq(130, decode=True),
        Seq(299, decode=True), Seq(0, 77), Seq(250, 100), Seq(40, 9, generated_rows=3)]
# SmolLM2-135M's heads (9 query heads on 3 KV heads, head_dim 64) and Llama-3-8B's (32 on 8,
# head_dim 128)
SHAPES = [(9, 3, 64), (32, 8, 128)]


def _step(dtype: torch.dtype, shape: tuple[int, int, int], block_size: int):
    heads, kv_heads, head_dim = shape
    return make_step(STEP, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                     block_size=block_size, dtype=dtype, device="cuda", seed=3)


@pytest.mark.parametrize("shape", SHAPES, ids=["smollm2", "llama3-8b"])
@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("dtype", list(ATOL), ids=str)
def test_triton_kernel_on_cuda_matches_reference(dtype: torch.dtype, block_size: int,
                                                 shape: tuple[int, int, int]) -> None:
    from conveyor.attention.triton_paged import interpreted
    assert not interpreted(), "compiled for the GPU, not Triton's interpreter"
    kernel = paged_attention_kernel("triton")
    assert kernel is not None
    check_against_reference(kernel, _step(dtype, shape, block_size), ATOL[dtype])


@pytest.mark.parametrize("shape", SHAPES, ids=["smollm2", "llama3-8b"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_flashinfer_on_cuda_matches_reference(dtype: torch.dtype,
                                              shape: tuple[int, int, int]) -> None:
    pytest.importorskip("flashinfer")
    kernel = paged_attention_kernel("flashinfer")
    assert kernel is not None
    check_against_reference(kernel, _step(dtype, shape, 16), ATOL[dtype])


def test_backend_selector_on_cuda() -> None:
    """bf16 on a GPU FlashInfer runs on (when installed) takes it; float32 never does; an
    int8 cache keeps the torch reference."""
    major, minor = torch.cuda.get_device_capability()
    try:
        import flashinfer  # noqa: F401
        has_flashinfer = True
    except Exception:
        has_flashinfer = False
    expected = "flashinfer" if has_flashinfer and (major, minor) >= (8, 0) else "triton"
    assert cuda_paged_attention_backend(torch.bfloat16) == expected
    assert cuda_paged_attention_backend(torch.float32) == "triton"
    assert cuda_paged_attention_backend(torch.bfloat16, kv_cache_dtype="int8") == "torch"
