"""Native libraries in the cache (backend/cpu/native.py): built whole, checked before every use,
rebuilt when damaged, and no build left behind by a dead process."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap
import time

import pytest

from redrafter_mlx.backend.cpu import blas, kernels, native

LINUX_X86 = sys.platform.startswith("linux") and platform.machine() == "x86_64"


def test_a_library_is_intact_only_with_its_own_digest(tmp_path):
    library = tmp_path / "lib.so"
    library.write_bytes(b"\x7fELF" + bytes(100))
    assert not native.intact(library)  # never sealed: an older cache, or a copied file
    native.seal(library)
    assert native.intact(library)
    library.write_bytes(b"\x7fELF" + bytes(50))  # truncated
    assert not native.intact(library)
    native.discard(library)
    assert not library.exists() and not native.digest_path(library).exists()


def test_builds_of_dead_processes_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    (tmp_path / f"{native.BUILD_PREFIX}{dead}-abc").mkdir()
    (tmp_path / f"{native.BUILD_PREFIX}{dead}-lib.so").write_bytes(b"x")
    mine = tmp_path / native.build_name("xyz")
    mine.mkdir()
    kept = tmp_path / "0123456789abcdef"
    kept.mkdir()
    native.remove_stale(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, kept.name])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux")
def test_a_compiler_dies_with_the_process_that_started_it(tmp_path):
    """A build killed mid-way leaves no compiler running (here ``sleep`` stands in for it)."""
    marker = f"{time.time() % 1000:.6f}"
    code = textwrap.dedent(f"""
        from redrafter_mlx.backend.cpu import native
        native.compile_command(["sleep", "30.{marker.replace(".", "")}"], timeout=60)
    """)
    child = subprocess.Popen([sys.executable, "-c", code])
    pattern = f"sleep 30.{marker.replace('.', '')}"
    for _ in range(100):
        if subprocess.run(["pgrep", "-f", pattern], capture_output=True).returncode == 0:
            break
        time.sleep(0.1)
    else:
        child.kill()
        pytest.fail("the stand-in compiler never started")
    child.kill()
    child.wait()
    for _ in range(50):
        if subprocess.run(["pgrep", "-f", pattern], capture_output=True).returncode != 0:
            return
        time.sleep(0.1)
    subprocess.run(["pkill", "-f", pattern])
    pytest.fail("the compiler outlived the process that started it")


@pytest.mark.skipif(not LINUX_X86, reason="the small-row kernel is built on Linux x86-64 only")
@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_a_damaged_small_row_kernel_is_rebuilt_not_preloaded(tmp_path, monkeypatch, damage):
    """A truncated shared object would kill every process that preloads it (SIGBUS)."""
    monkeypatch.setenv("REDRAFTER_CACHE", str(tmp_path))
    monkeypatch.delenv("REDRAFTER_NO_SMALLROWS", raising=False)
    path = blas.smallrows_library()
    if path is None:
        pytest.skip("no C compiler or no AVX2 here")
    whole = path.read_bytes()
    damaged = {"truncated": whole[: len(whole) // 3], "empty": b"", "garbage": b"x" * 999}
    path.write_bytes(damaged[damage])
    assert blas.smallrows_library(build=False) is None  # an import never preloads it
    assert blas.smallrows_library() == path and native.intact(path)
    assert len(path.read_bytes()) == len(whole)
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name, path.name + ".sha256"]


@pytest.mark.skipif(not LINUX_X86, reason="the CPU kernels are built on Linux x86-64 only")
def test_kernels_keep_only_their_library_and_rebuild_a_damaged_one(tmp_path, monkeypatch):
    """The build's object files are not kept; a damaged library is built again."""
    builds = []

    def fake_compile(tmp, nanobind, mlx_root, name):
        builds.append(name)
        (tmp / "primitives.o").write_bytes(b"object")
        (tmp / name).write_bytes(b"library" * 100)

    monkeypatch.setattr(kernels, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(kernels, "_compile", fake_compile)
    monkeypatch.setattr(kernels, "_nanobind", lambda: tmp_path)
    path = kernels._build()
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name, path.name + ".sha256"]
    assert kernels._build() == path and len(builds) == 1  # cached
    path.write_bytes(b"library")  # truncated by an interrupted copy
    assert kernels._build() == path and len(builds) == 2
    assert native.intact(path)
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [path.parent.name]


def test_importing_the_api_compiles_nothing(tmp_path):
    """``import redrafter_mlx.api`` with an empty cache builds nothing and runs no compiler."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.NEXT_ENV)}
    env.update(REDRAFTER_CACHE=str(tmp_path), CC="false", CXX="false")
    env.pop("REDRAFTER_CPU_TUNING", None)
    done = subprocess.run(
        [sys.executable, "-c", "import redrafter_mlx.api"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "note:" not in done.stderr  # a failed compiler would have said so
    assert list(tmp_path.iterdir()) == []
