"""Building blocks of Llama-family decoders: RMSNorm and rotary position embeddings."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from conveyor.ops import cpu_kernels, reference

# The dot kernels' block matmul against the bf16 weight's, relative to its largest output: they
# differ by the weights' rounding to bf16 (~0.4 % each); a wrong layout differs by ~100 %.
BLOCKS_TOLERANCE = 0.02
# With int8 inputs the error is the inputs' rounding to 8 bits per 32 (1-2 % of the largest
# output on random inputs for the default model's weights): the check is for a wrong layout.
INT8_BLOCKS_TOLERANCE = 0.05
# GGML's Q4_K and Q6_K (llama.cpp's Q4_K_M files): 256 weights per block (the other block types
# here hold 32); the dot kernels read them (repacked per 32: csrc/vnni_blocks.cpp,
# dot_blocks.cpp, f32_linear.cpp), the AMX ones do not.
Q4_K, Q6_K = 12, 14
K_QUANTS = (Q4_K, Q6_K)


def weights_per_block(qtype: int) -> int:
    return 256 if qtype in K_QUANTS else 32


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with W laid out once for the CPU's matmul kernel (CPU only).

    - CPUs with AVX512-BF16 but no AMX (or with it and ``amx_matmuls`` off), bf16 weights:
      pair tiles for ``ops.dot_linear``
      (``csrc/dot_linear.cpp``), one kernel for every batch size, so a row's result never
      depends on the batch; with ``use_blocks`` it reads the weight's GGUF blocks instead, at
      every batch size (``csrc/dot_blocks.cpp``: the exact GGUF weights). float32 weights on
      CPUs with AVX2: the same, on lane tiles and blocks of their own (``csrc/f32_linear.cpp``).
    - Elsewhere: oneDNN's blocked layout. torch's plain ``F.linear`` re-reads the ``[out, in]``
      weight in its stored layout every call; the pre-packed weight is what oneDNN's GEMM
      wants, which makes the small-batch matmuls of a decode step ~1.4x faster with
      bit-identical bf16 results. With ``use_blocks`` (AMX), batches of up to
      ``quantized_linear_max_rows`` rows read the GGUF blocks (``ops.quantized_linear``), which
      gives every row the bits oneDNN gives it alone, from a third to half of the bytes, and
      never pays oneDNN's first call at a new row count. Larger batches run oneDNN in one
      call where that gives each row the bits of smaller calls, else in halves: oneDNN's
      algorithm, and with it a row's last bits, changes with the number of rows (checked per
      row count at its first call, ``linear`` in ``csrc/cpu_ops.cpp``).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 amx_matmuls: bool = True) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.dot = dot_matmuls(weight, amx_matmuls)
        self.kernels = self.dot or cpu_kernels.load_cpu_kernels()
        weight = weight.detach()
        bias = None if bias is None else bias.detach()
        # float32 lane tiles hold 8 rows: an LM head of another vocabulary size gets zero rows
        # (and bias), cut from its outputs.
        self.padding = -self.out_features % 8 if self.dot and self.dtype == torch.float32 else 0
        if self.padding:
            weight = torch.cat([weight, weight.new_zeros(self.padding, self.in_features)])
            bias = None if bias is None else torch.cat([bias, bias.new_zeros(self.padding)])
        # Either layout is opaque to torch (pair tiles, or mkldnn): a plain attribute, not a
        # parameter. C++ `linear` picks the kernel by it.
        self.packed = (cpu_kernels.pack_dot_weight(weight) if self.dot
                       else torch.ops.mkldnn._reorder_linear_weight(weight, 1))
        self.bias = bias
        self.blocks: torch.Tensor | None = None  # ops.pack_block_weights or pack_dot_blocks
        self.int8_inputs = False  # the blocks are pack_vnni_blocks': inputs quantized to int8

    @classmethod
    def from_linear(cls, linear: nn.Linear, amx_matmuls: bool = True) -> PackedLinear:
        return cls(linear.weight, linear.bias, amx_matmuls)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels:  # C++ picks the kernel, the weight's form and how to split rows
            return self._cut(cpu_kernels.linear(x, self.packed, self.blocks, self.bias))
        return self.dense(x)

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """The matmul on the bf16 (or float) weight, whatever the batch size."""
        if self.dot:
            return self._cut(cpu_kernels.dot_linear(x, self.packed, self.bias))
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def _cut(self, y: torch.Tensor) -> torch.Tensor:
        return y[:, :self.out_features].contiguous() if self.padding else y

    def decode_weight_bytes(self) -> int:
        """Bytes a small batch reads: the blocks when there are, else the weight."""
        if self.blocks is not None:
            return self.blocks.numel()
        return self.out_features * self.in_features * self.dtype.itemsize

    def use_blocks(self, raw: torch.Tensor, qtype: int, int8_activations: bool = False) -> bool:
        """Read this weight's GGUF blocks (uint8 ``[out, in / weights_per_block, block
        bytes]`` of GGML type ``qtype``) where the kernels can, if they hold this weight:
        checked here on random inputs. False (and unchanged) otherwise.

        - AMX: batches of up to ``quantized_linear_max_rows`` rows, bit-identical to oneDNN
          on the bf16 weight (checked at 1, 13 and ``onednn_small_rows`` rows: above that
          oneDNN's own bits for a row change with the batch, and the kernel's do not).
        - Dot kernels (bf16 or float32): every batch, on the exact GGUF weights, so the results
          differ from the dense weight's in the last bits (checked close, at 1 and 5 rows).
          With ``int8_activations`` and AVX512-VNNI, bf16 inputs are quantized to int8 per
          block of 32 (``pack_vnni_blocks``): further from the dense results, as llama.cpp's
          (checked close the same way). Q4_K and Q6_K with the dot kernels only (not AMX).
        """
        return self.use_block_parts([(qtype, raw)], int8_activations)

    def use_block_parts(self, parts: list[tuple[int, torch.Tensor]],
                        int8_activations: bool = False) -> bool:
        """``use_blocks`` for a weight fused from parts (rows in order: q, k, v), each (GGML
        type, blocks). Parts of one type are one weight; Q4_K and Q6_K parts (a Q4_K_M file's
        q, k and v) are read by the dot kernels, repacked to records of one kind."""
        types = {qtype for qtype, _ in parts}
        # (self.dot: the dot kernels run here, whether or not the CPU has AMX)
        int8 = (self.dot and int8_activations and self.dtype == torch.bfloat16
                and cpu_kernels.vnni_blocks_available(amx_matmuls=False))
        if not self.dot and self.dtype != torch.bfloat16:  # the AMX kernels are bf16 only
            return False
        if types & set(K_QUANTS) and not self.dot:
            return False

        def pack(raw: torch.Tensor, qtype: int, k_mixed: bool = False) -> torch.Tensor:
            if int8:
                return cpu_kernels.pack_vnni_blocks(raw, qtype, k_mixed)
            return cpu_kernels.pack_dot_blocks(raw, qtype, self.dtype, k_mixed)

        if len(types) > 1:  # Q4_K and Q6_K only; records of 16 rows, whole ones per part
            if not types <= set(K_QUANTS) or any(raw.shape[0] % 16 for _, raw in parts):
                return False
            return self._take_blocks(torch.cat([pack(raw, qtype, k_mixed=True)
                                                for qtype, raw in parts]), int8)
        raw, qtype = torch.cat([raw for _, raw in parts]), types.pop()
        if self.dot:
            return self._take_blocks(pack(raw, qtype), int8)
        blocks = cpu_kernels.pack_block_weights(raw, qtype)
        gen = torch.Generator().manual_seed(0)
        for rows in (1, 13, cpu_kernels.onednn_small_rows()):
            x = torch.randn(rows, self.in_features, generator=gen).to(self.dtype)
            got = cpu_kernels.quantized_linear(x, blocks, self.bias)
            if not torch.equal(got, self.dense(x)):
                return False
        self.blocks, self.int8_inputs = blocks, False
        return True

    def _take_blocks(self, blocks: torch.Tensor, int8: bool) -> bool:
        """Keep the dot kernels' ``blocks`` if they hold this weight (close to the dense
        results at 1 and 5 rows: both of the kernels' paths, up to 3 tokens and more)."""
        gen = torch.Generator().manual_seed(0)
        for rows in (1, 5):
            x = torch.randn(rows, self.in_features, generator=gen).to(self.dtype)
            got = cpu_kernels.dot_linear(x, blocks, self.bias).float()
            want = self.dense(x).float()
            tolerance = INT8_BLOCKS_TOLERANCE if int8 else BLOCKS_TOLERANCE
            if not (got - want).abs().max() <= tolerance * want.abs().max():
                return False
        self.blocks, self.int8_inputs = blocks, int8
        return True


def dot_matmuls(weight: torch.Tensor, amx_matmuls: bool = True) -> bool:
    """Whether this weight's matmuls run the dot kernels (``ops.dot_linear``, one kernel for
    every batch size):

    - a bf16 weight with rows a multiple of 16 and an even number of inputs, on a CPU whose
      kernels were built with AVX512-BF16 and that has no AMX, or with ``amx_matmuls`` off
      (AMX keeps oneDNN, with which its block kernels agree bit for bit);
    - a float32 weight, on a CPU with AVX2 and FMA (``PackedLinear`` pads its rows to a
      multiple of 8).
    """
    out_features, in_features = weight.shape
    if weight.device.type != "cpu":
        return False
    if weight.dtype == torch.float32:
        return cpu_kernels.f32_kernels_available()
    return (weight.dtype == torch.bfloat16 and out_features % 16 == 0 and in_features % 2 == 0
            and cpu_kernels.dot_kernels_available(amx_matmuls))


def matmul_kernels(dtype: torch.dtype, amx_matmuls: bool = True) -> str:
    """The CPU matmul family a model in ``dtype`` takes here, in words (for the load log; a
    weight of a shape the dot kernels do not take, e.g. a vocabulary not a multiple of 16,
    keeps oneDNN)."""
    if dtype == torch.float32 and cpu_kernels.f32_kernels_available():
        return "the float32 dot kernels"
    if dtype != torch.bfloat16:
        return "oneDNN"
    if cpu_kernels.dot_kernels_available(amx_matmuls):
        return "the AVX512-BF16 dot kernels" + (
            " (amx_matmuls off)" if cpu_kernels.amx_available() else "")
    return "AMX tiles and oneDNN" if cpu_kernels.amx_available() else "oneDNN"


def can_pack_linears(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this device's matmuls in this dtype take packed weights: on CPU, with oneDNN,
    whose half-precision packing needs AVX-512 (CPUs with AVX2 only run bf16 and fp16 on
    plain weights: slow, but they run)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Over the last dim of any shape (the decoder's hot path calls conveyor.ops)."""
        return reference.rms_norm(x, self.weight, self.eps)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent RoPE scaling (``rope_type: llama3``)."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style ("rotate half") RoPE with a precomputed cos/sin table over positions."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None) -> None:
        super().__init__()
        # float32 throughout, as the reference implementation computes it (greedy parity).
        # On the host even inside a meta-device context (CausalLM built on meta): cos/sin on
        # meta tensors import torch._dynamo (~3 s at every start).
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64,
                                                device="cpu").float() / head_dim)
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling or {})
        elif rope_type == "linear":
            inv_freq = inv_freq / (scaling or {})["factor"]
        elif rope_type not in (None, "default"):
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported "
                             "(supported: default, linear, llama3)")
        if factors := (scaling or {}).get("freq_factors"):  # a GGUF's rope_freqs tensor
            if len(factors) != len(inv_freq):
                raise ValueError(f"rope_freqs has {len(factors)} factors for "
                                 f"{len(inv_freq)} rotary frequencies")
            inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32, device="cpu")
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device="cpu"),
                            inv_freq)
        # cos_sin: [max_positions, head_dim] = cos | sin halves
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], -1).float(),
                             persistent=False)
