"""Which chip and backend this process runs on: the identity profiles and benchmarks record."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import mlx.core as mx

from redrafter_mlx.backend.blas import blas_in_use


def cpu_model() -> str:
    """CPU model name from /proc/cpuinfo (Linux) or the platform string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def backend() -> str:
    """Metal, CUDA or CPU: where MLX runs by default."""
    if mx.default_device() == mx.cpu:
        return "CPU"
    if mx.metal.is_available():
        return "Metal"
    cuda = getattr(mx, "cuda", None)
    return "CUDA" if cuda is not None and cuda.is_available() else "GPU"


def device_name() -> str:
    """The chip: Apple/CUDA device name from MLX, the CPU model on the CPU backend."""
    if backend() == "CPU":
        return cpu_model()
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    return str(info.get("device_name") or info.get("architecture") or platform.machine())


def chip_info() -> dict:
    """The chip: Apple device name/architecture/GPU cores, CUDA device name, or CPU + BLAS."""
    import mlx.core as mx

    kind = backend()
    if kind == "CPU":
        return {
            "chip": device_name(),
            "backend": kind,
            "blas": blas_in_use(),
            "cores": os.cpu_count(),
        }
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    chip = {"chip": device_name(), "backend": kind}
    for name in ("architecture", "gpu_cores", "num_gpu_cores", "memory_size"):
        if name in info:
            chip[name] = str(info[name])
    return chip
