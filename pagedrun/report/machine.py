"""The machine a run ran on, as the report and the bench record it: CPU model, cores, threads,
memory, the device, and the GPU's name where there is one."""
from __future__ import annotations

import os
import platform
from pathlib import Path


def machine_info(device: str, threads: int) -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "threads": threads, "device": device,
            "load_average_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")}
    if device == "cuda":
        import torch

        info["gpu"] = torch.cuda.get_device_name()
    return info
