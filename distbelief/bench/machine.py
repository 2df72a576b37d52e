"""What a benchmark ran on: recorded next to every result so that numbers are never read out of context."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
import time
from typing import Any


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """Cores, CPU model, memory, library versions, date and load: everything a ratio depends on."""
    import numpy
    import torch

    try:  # the installed package's metadata: the engine itself is imported only in distbelief/runtime/
        ray_version = importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - ray is a dependency
        ray_version = None
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        mem_gib = None
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cores": os.cpu_count(),
        "cpu_model": cpu_model(),
        "machine": platform.machine(),
        "memory_gib": round(mem_gib, 1) if mem_gib else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray_version,
        "numpy": numpy.__version__,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
    }
