"""Every matmul of the default model once, at 1 to 16 rows (best of 7): what a decode step
(1 row) and a verify of 4 drafts (5 rows) spend in matmuls, and what each row past the first
adds (issue 11); with ``--rows``, at any rows (a prefill's 2,048: the int8-input matmuls'
rate on CPUs without AMX, issue 15), on ``--threads`` threads (default: torch's).

    PYTHONPATH=src python docs/results/linear_rows.py [DTYPE] [--rows N ...] [--threads N]
"""

import argparse
import time

import torch

from conveyor import LLM
from conveyor.model.layers import PackedLinear

parser = argparse.ArgumentParser()
parser.add_argument("dtype", nargs="?", default="auto")
parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8, 16])
parser.add_argument("--threads", type=int, default=None)
args = parser.parse_args()
if args.threads:
    torch.set_num_threads(args.threads)
llm = LLM(dtype=args.dtype, max_model_len=512, kv_cache_memory="16MiB")
linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, PackedLinear)]
print(f"{len(linears)} matmuls, {sum(m.blocks is not None for m in linears)} on GGUF blocks, "
      f"{llm.engine.dtype}, {torch.get_num_threads()} threads")
for rows in args.rows:
    xs = [torch.randn(rows, m.in_features).to(m.dtype) for m in linears]
    macs = rows * sum(m.in_features * m.out_features for m in linears)
    best = float("inf")
    for _ in range(7):
        start = time.perf_counter()
        for m, x in zip(linears, xs, strict=True):
            m(x)
        best = min(best, time.perf_counter() - start)
    print(f"{rows:5} rows  {best * 1e3:8.2f} ms  {macs / best / 1e9:6.1f} G multiply-adds/s",
          flush=True)
