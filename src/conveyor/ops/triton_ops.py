"""The CUDA path's elementwise ops as Triton kernels, one launch each: RMSNorm (with the
residual add fused in), SiLU-and-multiply, and rotary embedding in place.

The torch reference ops (``reference.py``) spend 5 to 12 kernels on each of these; a decode
step of a small model on a GPU is a sequence of such kernels, each a few microseconds even
replayed from a CUDA graph: SmolLM2-135M's decode step at batch 1 took ~2.6 ms on an H200
(~1,500 kernels) where its weights take 0.06 ms to read (docs/benchmarks.md). Each kernel here
computes in float32 and rounds to the tensor's dtype where the reference op rounds (after the
residual add, the normalised row, the SiLU, each rotary product). In Triton's interpreter
float16 results equal the reference's bit for bit; on a GPU they may differ in the last place
where float32 differs (the norm's reduction order, Triton's fast sqrt, division and exp, a
fused multiply-add in RoPE).

Under ``TRITON_INTERPRET=1`` (CI, no GPU) the same kernels run on CPU tensors in Triton's
interpreter (tests/test_triton_ops.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, w_ptr, out_ptr, stride_x, stride_residual,
                     stride_out, n, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # residual += x (rounded as torch's add_), then the norm of residual
        r = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(r.dtype)
        tl.store(residual_ptr + row * stride_residual + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
    y = (xf * inv).to(x.dtype)  # normalised in float32, rounded to x's dtype (as HF)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * y.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + n + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # F.silu's result, in the dtype
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(up.dtype), mask=mask)


@triton.jit
def _rotary_kernel(x_ptr, positions_ptr, cos_sin_ptr, stride_x, stride_cos_sin, num_heads,
                   HALF: tl.constexpr, HALF_P: tl.constexpr, HEADS_P: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    d = tl.arange(0, HALF_P)
    d_ok = d < HALF
    heads = tl.arange(0, HEADS_P)
    mask = (heads < num_heads)[:, None] & d_ok[None, :]
    first = x_ptr + token * stride_x + heads[:, None] * (2 * HALF) + d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    # The float32 table rounded to x's dtype, then each product and each sum rounded to it:
    # [x1 cos - x2 sin, x2 cos + x1 sin], as the reference's "rotate half" computes it.
    cos = tl.load(cos_sin_ptr + pos * stride_cos_sin + d, mask=d_ok, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cos_sin + HALF + d, mask=d_ok, other=0.0)
    c = cos.to(dtype).to(tl.float32)[None, :]
    s = sin.to(dtype).to(tl.float32)[None, :]
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    out1 = (a1 * c).to(dtype).to(tl.float32) + (a2 * -s).to(dtype).to(tl.float32)
    out2 = (a2 * c).to(dtype).to(tl.float32) + (a1 * s).to(dtype).to(tl.float32)
    tl.store(first, out1.to(dtype), mask=mask)
    tl.store(first + HALF, out2.to(dtype), mask=mask)


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, n] with unit stride along n (a view where it can be)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``reference.rms_norm`` in one kernel: x [..., n] -> w * normalised x."""
    rows = _rows(x)
    n = rows.shape[1]
    w = w.contiguous()
    out = torch.empty(rows.shape, dtype=torch.result_type(x, w), device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows.shape[0],)](rows, rows, w, out, rows.stride(0), 0,
                                           out.stride(0), n, eps, HAS_RESIDUAL=False,
                                           BLOCK=block, num_warps=_warps(block))
    return out.view(x.shape)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                  eps: float) -> None:
    """``reference.add_rms_norm_`` in one kernel: residual += x, then x = the norm of it;
    x and residual are [T, n] with unit stride along n (both written in place)."""
    if x.stride(-1) != 1 or residual.stride(-1) != 1 or x.dim() != 2 or residual.dim() != 2:
        raise ValueError("add_rms_norm_ needs 2-D x and residual with unit stride along n")
    n, w = x.shape[1], w.contiguous()
    if x.shape[0]:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(x.shape[0],)](x, residual, w, x, x.stride(0), residual.stride(0),
                                        x.stride(0), n, eps, HAS_RESIDUAL=True, BLOCK=block,
                                        num_warps=_warps(block))


# Columns of the intermediate size per program of silu_mul.
SILU_BLOCK = 1024


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``reference.silu_mul`` in one kernel: [T, 2I] -> [T, I]."""
    rows = _rows(gate_up)
    n = rows.shape[1] // 2
    out = torch.empty((rows.shape[0], n), dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0]:
        block = min(SILU_BLOCK, triton.next_power_of_2(n))
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(n, block))](
            rows, out, rows.stride(0), out.stride(0), n, BLOCK=block)
    return out.view(*gate_up.shape[:-1], n)


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
            num_heads: int, head_dim: int) -> None:
    """``reference.rotary_`` in one kernel: the first ``num_heads`` heads of each row of
    x [T, >= num_heads * head_dim] (unit stride along a row) rotated in place."""
    if x.dim() != 2 or x.stride(-1) != 1 or head_dim % 2 or cos_sin.shape[-1] != head_dim:
        raise ValueError("rotary_ needs x [T, width] with unit stride along a row, an even "
                         "head_dim and cos_sin [positions, head_dim]")
    if x.shape[0]:
        half = head_dim // 2
        positions, cos_sin = positions.contiguous(), cos_sin.contiguous()
        _rotary_kernel[(x.shape[0],)](x, positions, cos_sin, x.stride(0), cos_sin.stride(0),
                                      num_heads, HALF=half, HALF_P=triton.next_power_of_2(half),
                                      HEADS_P=triton.next_power_of_2(num_heads))
