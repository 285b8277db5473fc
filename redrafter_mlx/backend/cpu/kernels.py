"""MLX primitives of our own for the CPU backend, built on first use against the installed MLX.

``csrc/primitives.cpp``: a masked softmax over attention scores, one vectorised pass per row
(MLX's CPU backend computes ``exp`` one element at a time on x86), the attention of a few
query rows (decode steps, trees) reading each cached key and value once, and the MLP's SiLU
gate (its sigmoid's ``exp`` vectorised too). They are C++ MLX
primitives, so they stay in the lazy graph like any MLX op. Their Python binding is built with
nanobind (the version MLX's own binding uses: their type registries must match to pass
``mx.array``) into ``<cache>/kernels/<hash>/``, once per source, MLX and Python version.

``REDRAFTER_NO_CPU_KERNELS=1`` opts out (attention and the gate then run in MLX ops).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx

from redrafter_mlx.backend.cpu import native
from redrafter_mlx.core.paths import cache_dir

SOURCE = Path(__file__).parent / "csrc" / "primitives.cpp"
OPT_OUT_ENV = "REDRAFTER_NO_CPU_KERNELS"
MODULE = "_primitives"  # NB_MODULE's name in the source
# MLX's binding registers its types in nanobind's "mlx" domain: ours must join it
NB_DOMAIN = "mlx"


class CpuKernels(NamedTuple):
    """The extension's primitives (all on the CPU stream, float32).

    ``masked_softmax(scores, visible)``: softmax over the last axis of scores ``(..., R, N)``,
    the last T columns of row r masked by ``visible[r % T]`` (``visible`` (T, T) bool, or
    None) -> probs ``(..., R, N)``.

    ``tree_attention(queries, keys, values, scale, visible)``: queries ``(1, H, T, D)``
    against keys and values ``(1, KV, S + T, D)`` (read in place: cache views need no copy),
    every query seeing the S cached keys and the new T under ``visible`` -> ``(1, H, T, D)``;
    D 64 or 128 and ``H / KV * T <= TREE_ROWS`` (else ValueError).

    ``joint_attention(queries, keys, values, counts, scale, visible)``: a joint forward's
    queries ``(1, H, N, D)`` in segments of ``counts[i]`` rows, each attended over its own
    sequence's ``keys[i]`` and ``values[i]`` ``(1, KV, S_i + T_i, D)`` under ``visible[i]``
    (``(T_i, T_i)`` or None) as ``tree_attention`` attends it alone, to the bit; rows past the
    counts' sum (padding) are 0. One call per layer instead of one per sequence.

    ``swiglu(gate_up)``: ``gate_up (..., 2 I)``, each row its gate's I columns then its up's
    (the fused gate/up product) -> ``silu(gate) * up (..., I)``.
    """

    masked_softmax: Callable[[mx.array, mx.array | None], mx.array]
    tree_attention: Callable[..., mx.array]
    joint_attention: Callable[..., mx.array]
    swiglu: Callable[[mx.array], mx.array]


TREE_ROWS = 32  # MAX_ROWS in the source
TREE_HEAD_SIZES = (64, 128)


def cpu_kernels() -> CpuKernels | None:
    """The kernels, built on first use; None where they cannot run (not Linux x86-64, opted
    out, no compiler or nanobind, a failed build or self-check: those print one note)."""
    module = _module()
    if module is None:
        return None
    return CpuKernels(
        module.masked_softmax, module.tree_attention, module.joint_attention, module.swiglu
    )


@functools.cache
def _module():
    """The built extension (:func:`cpu_kernels`), or None."""
    if os.environ.get(OPT_OUT_ENV) or not sys.platform.startswith("linux"):
        return None
    if platform.machine() != "x86_64":
        return None
    try:
        module = _load(_build())
        _check(module)
    except (OSError, ImportError, RuntimeError, TypeError, ValueError) as e:
        print(f"note: the CPU plan runs without its kernels ({e})", file=sys.stderr)
        return None
    return module


def _nanobind() -> Path:
    """nanobind's source folder (its headers and ``src/nb_combined.cpp``)."""
    spec = importlib.util.find_spec("nanobind")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("nanobind is not installed (pip install 'redrafter-mlx[cpu]')")
    return Path(next(iter(spec.submodule_search_locations)))


def _mlx_root() -> Path:
    return Path(next(iter(importlib.util.find_spec("mlx").submodule_search_locations)))


def _build() -> Path:
    """The built extension's path, building it first where no intact build of these versions
    (source, MLX, nanobind, Python, compiler) is in the cache (into a temporary folder, renamed
    into place when whole)."""
    nanobind, mlx_root = _nanobind(), _mlx_root()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    key = "\n".join(
        [
            hashlib.sha256(SOURCE.read_bytes()).hexdigest(),
            mx.__version__,
            importlib.metadata.version("nanobind"),
            suffix,
            native.compiler_identity(native.compiler("CXX", "c++")),
        ]
    )
    folder = cache_dir() / "kernels" / hashlib.sha256(key.encode()).hexdigest()[:16]
    path = folder / f"{MODULE}{suffix}"
    if native.intact(path):
        return path
    folder.parent.mkdir(parents=True, exist_ok=True)
    native.remove_stale(folder.parent)
    print("note: building the CPU kernels (once, about 20 s)", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=native.build_name()))
    try:
        _compile(tmp, nanobind, mlx_root, path.name)
        for objects in tmp.glob("*.o"):  # only the library and its digest are kept
            objects.unlink()
        native.seal(tmp / path.name)
        shutil.rmtree(folder, ignore_errors=True)  # a damaged build of these versions
        try:
            os.replace(tmp, folder)  # whole, or not at all
        except OSError:
            if not native.intact(path):  # not another process's build landing first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _compile(tmp: Path, nanobind: Path, mlx_root: Path, name: str) -> None:
    """Compile nanobind's runtime and the kernel into ``tmp / name``."""
    compiler = native.compiler("CXX", "c++")
    includes = [
        f"-I{nanobind / 'include'}",
        f"-I{nanobind / 'ext' / 'robin_map' / 'include'}",
        f"-I{sysconfig.get_paths()['include']}",
        f"-DNB_DOMAIN={NB_DOMAIN}",
    ]
    common = [*compiler, "-std=c++20", "-fPIC", "-fvisibility=hidden", "-DNDEBUG", *includes]
    runtime, kernel = tmp / "nanobind.o", tmp / "primitives.o"
    _run([*common, "-O2", "-fno-strict-aliasing", "-DNB_BUILD", "-c",
          str(nanobind / "src" / "nb_combined.cpp"), "-o", str(runtime)])  # fmt: skip
    # fused multiply-adds wherever the clone's ISA has them, in the vector and the scalar exp
    # alike (the same expressions contract the same way), so both still give the same bits
    _run([*common, "-O3", "-ffp-contract=fast", "-Wno-psabi", f"-I{mlx_root / 'include'}",
          "-c", str(SOURCE), "-o", str(kernel)])  # fmt: skip
    lib = mlx_root / "lib"
    _run([*compiler, "-shared", str(kernel), str(runtime), f"-L{lib}", "-lmlx",
          f"-Wl,-rpath,{lib}", "-o", str(tmp / name)])  # fmt: skip


def _run(cmd: list[str]) -> None:
    try:
        done = native.compile_command(cmd, timeout=300)
    except subprocess.SubprocessError as e:
        raise RuntimeError(f"{cmd[0]}: {e}") from e
    if done.returncode != 0:
        errors = [x for x in done.stderr.splitlines() if "error" in x] or ["no output"]
        raise RuntimeError(f"{cmd[0]} failed: {errors[0].strip()}")


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(MODULE, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check(module) -> None:
    """Small calls against MLX's own ops: a binding that cannot take ``mx.array`` (another
    nanobind's registry) raises TypeError here, not in the middle of a forward."""
    scores = mx.arange(40, dtype=mx.float32).reshape(4, 10) / 7.0
    visible = mx.array([[True, False], [True, True]])
    mask = mx.concatenate([mx.ones((2, 8), mx.bool_), visible], axis=1)
    expected = mx.softmax(mx.where(mx.tile(mask, (2, 1)), scores, -mx.inf), axis=-1)
    queries = mx.arange(2 * 2 * 64, dtype=mx.float32).reshape(1, 2, 2, 64) / 300.0
    keys = mx.cos(mx.arange(10 * 64, dtype=mx.float32)).reshape(1, 1, 10, 64)
    values = mx.sin(mx.arange(10 * 64, dtype=mx.float32)).reshape(1, 1, 10, 64)
    attended = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.5, mask=mask)
    gate, up = mx.linspace(-12, 12, 21), mx.linspace(-1, 2, 21)
    alone = module.tree_attention(queries[:, :, :1], keys[:, :, :9], values[:, :, :9], 0.5, None)
    joint = module.joint_attention(
        queries, [keys[:, :, :9], keys], [values[:, :, :9], values], [1, 1], 0.5, [None, None]
    )
    last = module.tree_attention(queries[:, :, 1:], keys, values, 0.5, None)
    checks = [
        (module.masked_softmax(scores, visible), expected),
        (module.tree_attention(queries, keys, values, 0.5, visible), attended),
        (joint, mx.concatenate([alone, last], axis=2)),
        (module.swiglu(mx.concatenate([gate, up])[None]), (gate * mx.sigmoid(gate) * up)[None]),
    ]
    if not all(mx.allclose(got, want, rtol=1e-5, atol=1e-6).item() for got, want in checks):
        raise RuntimeError("its self-check disagrees with MLX's own ops")
