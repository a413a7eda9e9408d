"""Matmuls on Q4_K_M files' block types against the same weights dequantized: in bf16 with int8
inputs (``--kernel int8``, the default on CPUs with AVX512-VNNI and no AMX), with bf16 inputs
(``--kernel bf16``, ``--no-int8-activations``), or in float32 (``--kernel float32``: the
kernels of CPUs with AVX2 only; with AVX-512 on 16-lane registers).

30 weights of 1536 x 768 (the default model's gate/up shape, inputs a multiple of 256),
random blocks, read in turn so that they come from memory as a model's layers do: Q6_K's own
records, Q4_K's, Q6_K in the records a fused Q4_K + Q6_K matmul takes (``k_mixed``), and the
Q6_K weights dequantized (bf16 pair tiles or float32 lane tiles: what such a matmul read
before its blocks were). All interleaved, per batch size; prints medians and the ratios to
the dequantized weights.

    python docs/results/k_quant_matmuls.py [--reps 12] [--kernel int8|bf16|float32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from block_helpers import random_q4k_blocks, random_q6k_blocks  # noqa: E402
from conveyor.ops import cpu_kernels  # noqa: E402

LAYERS, ROWS, COLS = 30, 1536, 768
BATCHES = (1, 4, 13, 64, 512)


def weights(kernel: str) -> dict[str, list[torch.Tensor]]:
    dtype = torch.float32 if kernel == "float32" else torch.bfloat16
    q6k = [random_q6k_blocks(ROWS, COLS, seed) for seed in range(LAYERS)]
    q4k = [random_q4k_blocks(ROWS, COLS, seed) for seed in range(LAYERS)]
    dense = [torch.from_numpy(dequantize(raw.reshape(ROWS, -1), GGMLQuantizationType.Q6_K).copy())
             for raw in q6k]

    def pack(raw, qtype: int, k_mixed: bool = False) -> torch.Tensor:
        if kernel == "int8":
            return cpu_kernels.pack_vnni_blocks(torch.from_numpy(raw), qtype, k_mixed)
        return cpu_kernels.pack_dot_blocks(torch.from_numpy(raw), qtype, dtype, k_mixed)

    return {
        "dequantized": [cpu_kernels.pack_dot_weight(w.to(dtype)) for w in dense],
        "Q6_K": [pack(r, 14) for r in q6k],
        "Q4_K": [pack(r, 12) for r in q4k],
        "Q6_K k_mixed": [pack(r, 14, k_mixed=True) for r in q6k],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--kernel", choices=["int8", "bf16", "float32"], default="int8")
    args = parser.parse_args()
    dtype = torch.float32 if args.kernel == "float32" else torch.bfloat16
    if args.kernel == "float32" and not cpu_kernels.f32_kernels_available():
        sys.exit("the float32 kernels need the C++ kernels on a CPU with AVX2 and FMA")
    if args.kernel == "bf16" and not cpu_kernels.dot_kernels_available():
        sys.exit("bf16 block matmuls need the C++ kernels on a CPU with AVX512-BF16 and no AMX")
    if args.kernel == "int8" and not cpu_kernels.vnni_blocks_available():
        sys.exit("int8 inputs need the C++ kernels on a CPU with AVX512-VNNI and no AMX")
    kinds = weights(args.kernel)
    times: dict[tuple[int, str], list[float]] = {(m, k): [] for m in BATCHES for k in kinds}
    for _ in range(args.reps):
        for m in BATCHES:
            x = torch.randn(m, COLS).to(dtype)
            for kind, ws in kinds.items():
                start = time.perf_counter()
                for w in ws:
                    cpu_kernels.dot_linear(x, w, None)
                times[(m, kind)].append(time.perf_counter() - start)
    for m in BATCHES:
        base = statistics.median(times[(m, "dequantized")])
        cells = [f"{kind} {statistics.median(times[(m, kind)]) * 1e3:.2f} ms "
                 f"({base / statistics.median(times[(m, kind)]):.2f}x)" for kind in kinds]
        print(f"{m:4d} rows: " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
