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


def machine_info(load: bool = True) -> dict:
    """CPU (model and the features the engine reads), core count, torch threads, memory
    allocator, GPUs (every device's name) and (load) the load average now, for reports
    begun now. `foveal env` prints it too."""
    import torch

    from foveal.allocator import loaded_allocator
    from foveal.cpu_features import cpu_features

    gpu = (", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
           if torch.cuda.is_available() else None)
    info = {"cpu_model": cpu_model(), "cpu_features": cpu_features().describe(),
            "logical_cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch_version": torch.__version__, "allocator": loaded_allocator(), "gpu": gpu,
            "platform": platform.platform()}
    if load and hasattr(os, "getloadavg"):
        info["load_average_1m"] = round(os.getloadavg()[0], 2)
    return info
