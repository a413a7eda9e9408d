"""Host values to a device without waiting for it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def upload(values: np.ndarray | Sequence[Any], device: torch.device,
           dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` as a tensor on ``device``. On CUDA through pinned memory, copied
    asynchronously: a copy from pageable memory would wait for the work queued before it
    (the forward pass), and the host goes on building the step meanwhile (torch's pinned
    memory cache keeps the buffer until its copy has run)."""
    tensor = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
