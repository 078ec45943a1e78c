"""Host-to-device copies of a step's plan that do not wait for the device.

A copy from pageable host memory synchronizes the stream in torch (``copy_`` waits for it to finish), so the host
would wait for every step already queued before it could queue the next one.  Through pinned memory and a
non-blocking copy the host goes on at once; torch's pinned-memory cache keeps each block until its copy is done.
"""

from __future__ import annotations

import numpy as np
import torch


def upload(host: torch.Tensor | np.ndarray, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor or array) on ``device``, copied asynchronously on CUDA."""
    if isinstance(host, np.ndarray):
        host = torch.from_numpy(host)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
