"""Which chip and backend this process runs on: the identity profiles and benchmarks record."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import mlx.core as mx

from redrafter_mlx.backend.cpu.blas import blas_in_use


@cache
def cpu_model() -> str:
    """The CPU's model name: /proc/cpuinfo on Linux, ``machdep.cpu.brand_string`` on macOS
    (e.g. "Apple M2 Pro"), else the platform string."""
    if sys.platform == "darwin":
        name = _command(["sysctl", "-n", "machdep.cpu.brand_string"])
        if name:
            return name
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@cache
def apple_gpu_cores() -> int | None:
    """The Apple GPU's core count from the IORegistry (MLX does not report it); None elsewhere
    or when ``ioreg`` cannot tell. Chips of one name ship with several core counts."""
    if sys.platform != "darwin":
        return None
    found = re.search(r'"gpu-core-count"\s*=\s*(\d+)', _command(["ioreg", "-rc", "AGXAccelerator"]))
    return int(found.group(1)) if found else None


def _command(argv: list[str]) -> str:
    """A short system command's output ('' when it is missing, fails or hangs)."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def backend() -> str:
    """Metal, CUDA or CPU: where MLX runs by default."""
    if mx.default_device() == mx.cpu:
        return "CPU"
    if mx.metal.is_available():
        return "Metal"
    cuda = getattr(mx, "cuda", None)
    return "CUDA" if cuda is not None and cuda.is_available() else "GPU"


def _gpu_info() -> dict:
    return mx.device_info() if hasattr(mx, "device_info") else {}


def device_name() -> str:
    """The chip: the GPU's name from MLX (Metal or CUDA), the CPU model on the CPU backend."""
    if backend() == "CPU":
        return cpu_model()
    info = _gpu_info()
    name = info.get("device_name") or info.get("architecture")
    if backend() == "Metal" and not info.get("device_name"):
        name = cpu_model()  # the SoC's name ("Apple M2 Pro") is the GPU's too
    return str(name or platform.machine())


def chip_info() -> dict:
    """The chip: GPU name, architecture, core count (Apple) and memory; or CPU + BLAS."""
    kind = backend()
    if kind == "CPU":
        return {
            "chip": device_name(),
            "backend": kind,
            "blas": blas_in_use(),
            "cores": os.cpu_count(),
        }
    info = _gpu_info()
    chip = {"chip": device_name(), "backend": kind}
    for name in ("architecture", "memory_size"):
        if name in info:
            chip[name] = str(info[name])
    cores = apple_gpu_cores() if kind == "Metal" else None
    if cores:
        chip["gpu_cores"] = str(cores)
    return chip
