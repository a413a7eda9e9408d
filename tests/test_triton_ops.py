"""The CUDA path's Triton elementwise ops (conveyor/ops/triton_ops.py) against the torch
reference ops, on CPU in Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest.py where
there is no CUDA); a compile for sm_90 and sm_80 checks what the interpreter does not.

float32 matches the reference to float32 rounding (the reductions' order differs). bf16 and
fp16 round where the reference rounds; on a GPU each rounding is to nearest even, as torch's,
but the interpreter truncates float32 to bf16, so here bf16 results may sit an ulp or two
below the reference's (the tolerances below take that).
"""

from __future__ import annotations

import os

import pytest
import torch

from attention_cases import assert_generates_as_reference, compile_in_subprocess
from conftest import TINY_KV_MEMORY
from conveyor import LLM, SamplingParams
from conveyor.ops import ReferenceBackend, reference
from conveyor.ops.triton_ops import add_rms_norm_, rms_norm, rotary_, silu_mul

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton compiles here (CUDA): tests/test_gpu.py runs the ops in the engine")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Largest difference from the reference: float32 rounding; an fp16 unit; for bf16 two truncations of the interpreter's (2 ulps: 1.6 %, 0.03 at |x| < 4) where a GPU rounds
# to nearest.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
       torch.float16: dict(atol=4e-3, rtol=1e-3)}


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Within the dtype's tolerance; float16 bit for bit (the interpreter rounds it as torch
    does): a rounding step the reference takes and a kernel skips shows there."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if dtype == torch.float16:
        assert torch.equal(actual, expected)
    torch.testing.assert_close(actual, expected, **TOL[dtype])


# hidden sizes: SmolLM2's 576 (not a power of two), a small one, Llama-3-8B's 4096
@pytest.mark.parametrize("hidden", [64, 576, 4096])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_and_fused_residual_add_match_reference(dtype: torch.dtype,
                                                         hidden: int) -> None:
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(5, hidden, generator=gen) * 3).to(dtype)
    residual = torch.randn(5, hidden, generator=gen).to(dtype)
    w = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    close(rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), dtype)
    x_ref, residual_ref = x.clone(), residual.clone()
    reference.add_rms_norm_(x_ref, residual_ref, w, 1e-5)
    add_rms_norm_(x, residual, w, 1e-5)
    close(residual, residual_ref, dtype)
    if dtype == torch.float32:  # one rounding, as torch's add_
        assert torch.equal(residual, residual_ref)
    close(x, x_ref, dtype)


def test_rms_norm_of_a_3d_view_and_of_no_rows() -> None:
    """Qwen3's q/k norms normalise [T, heads, head_dim] views; a step may have no rows."""
    x = torch.randn(3, 4, 32)
    w = torch.rand(32) + 0.5
    close(rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), torch.float32)
    assert rms_norm(x[:0], w, 1e-6).shape == (0, 4, 32)
    add_rms_norm_(x[:0, 0], x[:0, 1], w, 1e-6)  # nothing to do, nothing raised


# intermediate sizes: one program per row (64), several with a ragged last one (1536 + 8)
@pytest.mark.parametrize("inter", [64, 1544])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_matches_reference(dtype: torch.dtype, inter: int) -> None:
    gate_up = (torch.randn(4, 2 * inter, generator=torch.Generator().manual_seed(inter))
               * 4).to(dtype)
    close(silu_mul(gate_up), reference.silu_mul(gate_up), dtype)


# (q heads + kv heads, head_dim): SmolLM2's 9 + 3 at 64, Llama-3's 32 + 8 at 128, a tiny 4 + 2
@pytest.mark.parametrize("heads,head_dim", [(12, 64), (40, 128), (6, 8)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_in_place_matches_reference(dtype: torch.dtype, heads: int,
                                           head_dim: int) -> None:
    """x is a view of a wider qkv row (V after the rotated heads, left as it is)."""
    gen = torch.Generator().manual_seed(heads)
    qkv = torch.randn(6, (heads + 2) * head_dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 1, 7, 100, 511, 3])
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.arange(512).float()[:, None] * inv_freq[None, :]
    cos_sin = torch.cat([angles.cos(), angles.sin()], -1)
    expected = qkv.clone()
    reference.rotary_(expected, positions, cos_sin, heads, head_dim)
    rotary_(qkv, positions, cos_sin, heads, head_dim)
    close(qkv, expected, dtype)
    assert torch.equal(qkv[:, heads * head_dim:], expected[:, heads * head_dim:])


def test_bad_layouts_raise_value_errors() -> None:
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="unit stride"):
        add_rms_norm_(x.t(), x.t(), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="even head_dim"):
        rotary_(torch.randn(2, 14), torch.zeros(2, dtype=torch.long), torch.randn(4, 7), 2, 7)
    with pytest.raises(ValueError, match=r"cos_sin \[positions, head_dim\]"):
        rotary_(torch.randn(2, 16), torch.zeros(2, dtype=torch.long), torch.randn(4, 16), 2, 8)


def test_strided_weights_and_positions_read_as_the_reference() -> None:
    """A weight or positions tensor that is a strided view is read element by element."""
    x = torch.randn(3, 64)
    w = torch.rand(128)[::2] + 0.5
    close(rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), torch.float32)
    positions = torch.tensor([5, 0, 9, 0, 2, 0])[::2]
    angles = torch.arange(16).float()[:, None] * torch.rand(4)[None, :]
    cos_sin = torch.cat([angles.cos(), angles.sin()], -1)
    qk = torch.randn(3, 16)
    expected = qk.clone()
    reference.rotary_(expected, positions, cos_sin, 2, 8)
    rotary_(qk, positions, cos_sin, 2, 8)
    close(qk, expected, torch.float32)


class _TritonOpsBackend(ReferenceBackend):
    """CudaBackend's elementwise ops, on CPU tensors in the interpreter."""

    name = "triton-ops-interpreted"
    rms_norm = staticmethod(rms_norm)
    add_rms_norm_ = staticmethod(add_rms_norm_)
    silu_mul = staticmethod(silu_mul)
    rotary_ = staticmethod(rotary_)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_an_engine_on_the_triton_ops_generates_as_the_reference(arch, tiny_model_factory,
                                                                kv_free) -> None:
    """The whole forward pass (prefill chunks, decodes; GQA) on the Triton ops: the same
    greedy tokens as the reference ops, logprobs to float32 rounding."""
    folder = tiny_model_factory(f"triton-ops-{arch}", arch, num_key_value_heads=2)
    llm = LLM(model=str(folder), dtype="float32",
              kv_cache_memory=TINY_KV_MEMORY, max_model_len=256, max_num_batched_tokens=24)
    prompts = [list(range(40, 77)), list(range(200, 205)), list(range(300, 331))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    assert_generates_as_reference(llm, _TritonOpsBackend(), prompts, params, kv_free)


COMPILE = """
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from conveyor.ops import triton_ops as t
bf = "*bf16"
kernels = [
    (t._rms_norm_kernel, dict(x_ptr=bf, residual_ptr=bf, w_ptr=bf, out_ptr=bf, stride_x="i32",
     stride_residual="i32", stride_out="i32", n="i32", eps="fp32"),
     dict(HAS_RESIDUAL=True, BLOCK=1024)),
    (t._silu_mul_kernel, dict(gate_up_ptr=bf, out_ptr=bf, stride_in="i32", stride_out="i32",
     n="i32"), dict(BLOCK=1024)),
    (t._rotary_kernel, dict(x_ptr=bf, positions_ptr="*i64", cos_sin_ptr="*fp32",
     stride_x="i32", stride_cos_sin="i32", num_heads="i32"),
     dict(HALF=32, HALF_P=32, HEADS_P=16)),
]
for capability in (90, 80):
    for kernel, signature, constants in kernels:
        signature.update(dict.fromkeys(constants, "constexpr"))
        compiled = triton.compile(ASTSource(kernel, signature, constants),
                                  target=GPUTarget("cuda", capability, 32))
        print(capability, kernel.fn.__name__, len(compiled.asm["cubin"]))
"""


def test_kernels_compile_for_gpus(tmp_path) -> None:
    """What the interpreter does not check: that Triton compiles each kernel to a cubin for
    sm_90 (the H200) and sm_80. In a process of its own: here triton was imported to
    interpret."""
    lines = compile_in_subprocess(COMPILE, tmp_path)
    assert len(lines) == 6 and all(int(size) > 0 for *_, size in lines)
