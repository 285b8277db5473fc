"""Chip identity for autotune profiles: macOS names and GPU core counts, from system tools."""

from __future__ import annotations

import subprocess

import pytest

from redrafter_mlx.tuning import device

IOREG = """+-o AGXAcceleratorG14X  <class AGXAcceleratorG14X, id 0x1000004ba>
    {
      "gpu-core-count" = 19
      "model" = "Apple M2 Pro"
    }"""


@pytest.fixture
def mac(monkeypatch):
    outputs = {"sysctl": "Apple M2 Pro", "ioreg": IOREG}
    monkeypatch.setattr(device.sys, "platform", "darwin")

    def run(argv, **_):  # the system tools, as macOS answers them
        return subprocess.CompletedProcess(argv, 0, stdout=outputs[argv[0]], stderr="")

    monkeypatch.setattr(device.subprocess, "run", run)
    for cached in (device.cpu_model, device.apple_gpu_cores):
        cached.cache_clear()
    yield outputs
    for cached in (device.cpu_model, device.apple_gpu_cores):
        cached.cache_clear()


def test_macos_names_the_chip_and_its_gpu_cores(mac):
    assert device.cpu_model() == "Apple M2 Pro"  # not platform.processor()'s "arm"
    assert device.apple_gpu_cores() == 19


def test_gpu_cores_are_unknown_without_ioreg(mac):
    mac["ioreg"] = ""
    assert device.apple_gpu_cores() is None


def test_the_cpu_backend_keys_by_cpu_and_blas():
    info = device.chip_info()  # this machine: MLX's CPU backend
    assert info["backend"] == "CPU" and info["chip"] == device.cpu_model()
    assert {"blas", "cores"} <= info.keys()
