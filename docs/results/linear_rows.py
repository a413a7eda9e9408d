"""Every matmul of the default model once, at 1 to 16 rows (best of 7): what a decode step
(1 row) and a verify of 4 drafts (5 rows) spend in matmuls, and what each row past the first
adds (issue 11).

    PYTHONPATH=src python docs/results/linear_rows.py [DTYPE]
"""

import sys
import time

import torch

from conveyor import LLM
from conveyor.model.layers import PackedLinear

dtype = sys.argv[1] if len(sys.argv) > 1 else "auto"
llm = LLM(dtype=dtype, max_model_len=512, kv_cache_memory="16MiB")
linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, PackedLinear)]
print(f"{len(linears)} matmuls, {sum(m.blocks is not None for m in linears)} on GGUF blocks, "
      f"{llm.engine.dtype}")
for rows in (1, 2, 3, 4, 5, 6, 8, 16):
    xs = [torch.randn(rows, m.in_features).to(m.dtype) for m in linears]
    best = float("inf")
    for _ in range(7):
        start = time.perf_counter()
        for m, x in zip(linears, xs, strict=True):
            m(x)
        best = min(best, time.perf_counter() - start)
    print(f"{rows:3} rows  {best * 1e3:6.2f} ms", flush=True)
