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
    """Host memory available to new allocations now, in bytes: the kernel's estimate
    (MemAvailable on Linux, through psutil; else the free pages ``sysconf`` reports), and no
    more than the headroom of the process's memory cgroup when it has a limit (a container or
    a batch job's: the host's figure does not see it); 0 when nothing answers."""
    try:
        import psutil

        avail = int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 — no psutil, or no answer on this platform
        try:
            avail = int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            return 0
    room = _cgroup_headroom()
    return avail if room is None else max(0, min(avail, room))


def _cgroup_headroom(base: str = "/sys/fs/cgroup") -> int | None:
    """Bytes the process's memory cgroup may still use (limit − usage), None without a
    limit: cgroup v2 (``memory.max``, ``memory.current``), else v1 (``limit_in_bytes``,
    ``usage_in_bytes``), of the cgroup mounted at ``base``."""
    for limit, usage in (("memory.max", "memory.current"),
                         ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            with open(f"{base}/{limit}") as f:
                lim = f.read(64).strip()
            with open(f"{base}/{usage}") as f:
                used = int(f.read(64).strip())
        except (OSError, ValueError):
            continue
        if lim == "max" or not lim.isdigit() or int(lim) >= 1 << 60:  # no limit (v1: huge)
            return None
        return int(lim) - used
    return None
