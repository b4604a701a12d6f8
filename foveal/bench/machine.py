"""What machine a benchmark ran on, for its JSON report: numbers from a shared
2-core VM and from a GPU box are not comparable without it."""
from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's marketing name ("AMD EPYC 7B13"), from /proc/cpuinfo where there is one."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine_info() -> dict:
    """CPU, core count, torch threads, accelerator and load average at the start."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"cpu_model": cpu_model(), "logical_cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch_version": torch.__version__,
            "gpu": gpu, "platform": platform.platform(),
            "load_average_1m": round(load[0], 2) if load else None}
