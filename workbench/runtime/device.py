"""What the device this process runs on can hold (the live memory plan's budget), and the
host's available memory."""

from __future__ import annotations

import os

import torch


def device_budget(device: torch.device) -> float:
    """Free memory of a CUDA device plus what the model already holds there; 0 on CPU."""
    if device.type != "cuda":
        return 0.0
    free, _total = torch.cuda.mem_get_info(device)
    return float(free + torch.cuda.memory_allocated(device))


def host_available_bytes() -> int:
    """Host memory available to new allocations now, in bytes (the kernel's estimate,
    MemAvailable on Linux, through psutil, which dask's ``distributed`` brings; else the free
    pages ``sysconf`` reports; 0 when neither answers)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 — no psutil, or no answer on this platform
        try:
            return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            return 0
