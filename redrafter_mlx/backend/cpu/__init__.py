"""The CPU plan's accelerator: everything only MLX's CPU backend runs, in one room.

Macs and NVIDIA GPUs never run this package; ``REDRAFTER_CPU_TUNING=0`` switches all of it off
(:func:`enabled`), and the CPU then runs the generic plan, the code Metal and CUDA run.

- ``plan.py``: :data:`CPU_PLAN`, what the CPU backend's verify forward and decode loop change;
- ``fused.py``: that plan's forward (fused projections, RoPE tables, grouped attention);
- ``kernels.py`` + ``csrc/primitives.cpp``: attention and SwiGLU primitives (x86-64, built on
  first use, at load time, never at import);
- ``blas.py`` + ``csrc/smallrows.c``: the BLAS MLX multiplies with (OpenBLAS and a small-row
  kernel, preloaded before MLX loads: Linux only).

This module reads only the environment: the console script asks it before MLX is imported.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Mapping
from pathlib import Path

CPU_TUNING_ENV = "REDRAFTER_CPU_TUNING"
CUDA_DISTRIBUTIONS = ("mlx-cuda-13", "mlx-cuda-12", "mlx-cuda")


def enabled(env: Mapping[str, str] = os.environ) -> bool:
    """The one switch: False when ``REDRAFTER_CPU_TUNING=0`` (or ``false``/``off``/``no``) is
    set; then nothing in this package runs (no fused forward, tree padding, kernels or BLAS
    preloading) and this machine runs the code path Metal and CUDA run."""
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
