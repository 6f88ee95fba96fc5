"""What the device this process runs on can hold (the live memory plan's budget)."""

from __future__ import annotations

import torch


def device_budget(device: torch.device) -> float:
    """Free memory of a CUDA device plus what the model already holds there; 0 on CPU."""
    if device.type != "cuda":
        return 0.0
    free, _total = torch.cuda.mem_get_info(device)
    return float(free + torch.cuda.memory_allocated(device))
