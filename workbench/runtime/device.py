"""What the device this process runs on can hold (the live memory plan's budget), and the
host's available memory."""

from __future__ import annotations

import os
from pathlib import Path

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


#: per cgroup version: its files' folder under the mount, the limit, the usage and the key of
#: ``memory.stat`` holding the reclaimable file cache (the working set leaves it out, as
#: kubelet and cAdvisor count it)
_CGROUP_FILES = {2: ("", "memory.max", "memory.current", "inactive_file"),
                 1: ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes",
                     "total_inactive_file")}


def _cgroup_headroom(base: str = "/sys/fs/cgroup", proc: str = "/proc/self/cgroup"
                     ) -> int | None:
    """Bytes the process's memory cgroups may still use, None without a limit: for the
    process's own cgroup (``proc``: v2's ``0::PATH``, else v1's ``memory`` line) and each one
    above it up to the mount ``base``, its limit − (usage − its inactive file cache), the
    smallest (a parent's limit binds its children; a job's page cache is reclaimable). cgroup
    v2 (``memory.max``, ``memory.current``), else v1 (``memory/memory.limit_in_bytes``,
    ``usage_in_bytes``); a "max" or v1's huge number is no limit."""
    try:
        with open(proc) as f:
            lines = f.read(1 << 16).splitlines()
    except OSError:
        lines = []
    own = {2: "/", 1: "/"}
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[0] == "0" and parts[1] == "":
            own[2] = parts[2]
        elif len(parts) == 3 and "memory" in parts[1].split(","):
            own[1] = parts[2]
    for version in (2, 1):
        sub, limit, usage, cache = _CGROUP_FILES[version]
        top = Path(base, sub)
        if not (top / usage).is_file():
            continue
        here = top / own[version].strip("/")
        if not here.is_dir():  # the path is outside this mount's view: its root only
            here = top
        rooms = []
        while True:
            room = _room(here, limit, usage, cache)
            if room is not None:
                rooms.append(room)
            if here == top or top not in here.parents:
                break
            here = here.parent
        return min(rooms) if rooms else None
    return None


def _room(folder: Path, limit: str, usage: str, cache: str) -> int | None:
    """One cgroup's limit − (usage − inactive file cache); None without a limit or files."""
    try:
        lim = (folder / limit).read_text()[:64].strip()
        used = int((folder / usage).read_text()[:64].strip())
    except (OSError, ValueError):
        return None
    if lim == "max" or not lim.isdigit() or int(lim) >= 1 << 60:  # no limit (v1: huge)
        return None
    inactive = 0
    try:
        for line in (folder / "memory.stat").read_text()[:1 << 16].splitlines():
            key, _, value = line.partition(" ")
            if key == cache and value.strip().isdigit():
                inactive = int(value)
                break
    except OSError:
        pass
    return int(lim) - max(0, used - inactive)
