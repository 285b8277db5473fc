"""What the environment says about the device, read without importing MLX (the BLAS re-exec
decides before MLX loads)."""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Mapping
from pathlib import Path

CPU_TUNING_ENV = "REDRAFTER_CPU_TUNING"
CUDA_DISTRIBUTIONS = ("mlx-cuda-13", "mlx-cuda-12", "mlx-cuda")


def cpu_tuning_enabled(env: Mapping[str, str] = os.environ) -> bool:
    """False when ``REDRAFTER_CPU_TUNING=0`` (or ``false``/``off``) is set: then no CPU-only
    specialisation runs (the fused forward, tree padding, the small-row kernel, the OpenBLAS
    re-exec), and this machine runs the code path Metal and CUDA run."""
    value = env.get(CPU_TUNING_ENV, "1").strip().lower()
    return value not in ("0", "false", "off", "no")


def cuda_backend_installed() -> bool:
    """Whether MLX's CUDA backend is installed and an NVIDIA driver is loaded: MLX then runs on
    the GPU, and the CPU's BLAS preloading is of no use."""
    for name in CUDA_DISTRIBUTIONS:
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return Path("/proc/driver/nvidia/version").exists() or Path("/dev/nvidiactl").exists()
    return False
