"""The BLAS that MLX's Linux CPU backend multiplies with, chosen before MLX is imported.

MLX calls ``cblas_sgemm`` for every float32 matmul. On Linux its wheel bundles the reference
BLAS; two libraries preloaded ahead of it (``LD_PRELOAD``, set by :func:`preload_env` when
``cli.main`` or a benchmark script re-executes itself, :func:`reexec_with_blas`) make decoding
faster here (benchmarks/README.md):

- Debian's OpenBLAS (``libopenblas0-pthread``), for every product, with the kernels the CPU's
  flags allow (``OPENBLAS_CORETYPE``, unless set already: :func:`openblas_coretype`);
- ``csrc/smallrows.c``, built on first use with the system C compiler into the cache folder
  and preloaded before OpenBLAS: it takes the products of decode steps (1-8 activation rows
  against a weight matrix, faster there than OpenBLAS on x86-64 with AVX2) and passes every
  other product on.

With them the re-executed process asks glibc's malloc for transparent huge pages
(``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``; ``REDRAFTER_NO_HUGEPAGES=1`` opts out): the
weights and a long context's K/V are read in full every step, and with 4 KB pages a page-table
walk comes every 4 KB of them.

``REDRAFTER_NO_OPENBLAS=1`` and ``REDRAFTER_NO_SMALLROWS=1`` opt out of either;
``REDRAFTER_CPU_TUNING=0`` out of both, and so does an installed CUDA backend with an NVIDIA
driver (MLX then multiplies on the GPU). This module must not import MLX.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import importlib.util
import os
import platform
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from redrafter_mlx.backend.cpu import cuda_backend_installed, enabled, native
from redrafter_mlx.core.paths import cache_dir

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
SMALLROWS_SOURCE = Path(__file__).parent / "csrc" / "smallrows.c"
# When no BLAS is preloaded after the kernel, it finds the one to pass products on to here.
NEXT_ENV = "REDRAFTER_SMALLROWS_NEXT"
CORETYPE_ENV = "OPENBLAS_CORETYPE"  # OpenBLAS reads it when it loads
TUNABLES_ENV, HUGE_PAGES = "GLIBC_TUNABLES", "glibc.malloc.hugetlb=1"  # read at process start


# OpenBLAS's kernels for what the CPU's flags say it runs, best first: where its own detection
# fails (a virtual machine's CPUID naming a "generic" Xeon, as here) it falls back to Prescott's
# SSE3 kernels, several times slower on prompt-sized products
CORETYPES = (
    ("SkylakeX", {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}),
    ("Haswell", {"avx2", "fma"}),
)


def cpu_flags() -> set[str]:
    """The CPU's flags as /proc/cpuinfo lists them ("avx2", "avx512f", ...); empty where there
    is none."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return set()
    line = next((x for x in cpuinfo.splitlines() if x.startswith("flags")), "")
    return set(line.split())


def _cpu_has_avx2_fma() -> bool:
    return {"avx2", "fma"} <= cpu_flags()


def openblas_coretype() -> str | None:
    """The OpenBLAS kernels (``OPENBLAS_CORETYPE``) for this CPU's flags, or None (not
    x86-64, or no AVX2: OpenBLAS's own detection stands)."""
    if platform.machine() != "x86_64":
        return None
    flags = cpu_flags()
    return next((name for name, needs in CORETYPES if needs <= flags), None)


def smallrows_library(build: bool = True) -> Path | None:
    """The small-row kernel's shared library, built once per source version (atomically, into
    ``<cache>/blas``, rebuilt where the cached copy is damaged: :mod:`.native`); None where it
    cannot run (not Linux x86-64 with AVX2 + FMA, opted out, no C compiler, a failed build or
    an unusable cache folder: those print one note) or, with ``build=False``, is not built."""
    if os.environ.get("REDRAFTER_NO_SMALLROWS") or not sys.platform.startswith("linux"):
        return None
    if platform.machine() != "x86_64" or not _cpu_has_avx2_fma():
        return None
    key = SMALLROWS_SOURCE.read_bytes() + native.compiler_identity(_cc()).encode()
    path = cache_dir() / "blas" / f"smallrows-{hashlib.sha256(key).hexdigest()[:16]}.so"
    if any(c in str(path) for c in " :"):  # LD_PRELOAD splits on both
        return _note(f"{path.parent}: a space or ':' in the path cannot be preloaded")
    if native.intact(path):
        return path
    return _build_smallrows(path) if build else None


def _build_smallrows(path: Path) -> Path | None:
    """Compile ``csrc/smallrows.c`` into ``path`` (a damaged copy there is replaced)."""
    compiler = _cc()
    tmp = path.with_name(native.build_name(path.name))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        native.remove_stale(path.parent)
        native.discard(path)
        cmd = [*compiler, "-O3", "-shared", "-fPIC", "-o", str(tmp), str(SMALLROWS_SOURCE)]
        done = native.compile_command([*cmd, "-ldl", "-lpthread"], timeout=60)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return _note(f"{compiler[0]} failed: {last}")
        native.seal(tmp)
        os.replace(native.digest_path(tmp), native.digest_path(path))
        os.replace(tmp, path)
    except (OSError, subprocess.SubprocessError) as e:
        return _note(str(e))
    finally:
        for leftover in (tmp, native.digest_path(tmp)):
            with contextlib.suppress(OSError):
                leftover.unlink(missing_ok=True)
    return path


@functools.cache
def prepare() -> None:
    """Build the small-row kernel where it is missing, for the next process's preload (a
    process loads its BLAS before MLX, so a library import cannot use it at once)."""
    if enabled() and not cuda_backend_installed():
        smallrows_library()


def _cc() -> list[str]:
    return native.compiler("CC", "cc")


_failed = False  # a build failed in this process: the re-executed one should not try again


def _note(why: str) -> None:
    global _failed
    _failed = True
    print(f"note: decode steps run without the small-row BLAS kernel ({why})", file=sys.stderr)
    return None


def bundled_blas() -> str | None:
    """The reference BLAS inside mlx's Linux wheel (``mlx_cpu.libs``), found without importing
    MLX."""
    spec = importlib.util.find_spec("mlx")
    for root in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(Path(root).parent.glob("mlx_cpu.libs/libblas*.so*"))
        if found:
            return str(found[0])
    return None


def preload_env(env: dict[str, str], *, build: bool = True) -> dict[str, str] | None:
    """``env`` with ``LD_PRELOAD`` listing the kernel, then OpenBLAS, then whatever it held
    (the first library that defines ``cblas_sgemm`` is the one MLX calls); None when that is
    what it holds already. The kernel comes only with a BLAS to pass other products on to, and
    with ``build=False`` only when it is built already."""
    if not sys.platform.startswith("linux"):
        return None
    if not enabled(env) or cuda_backend_installed():
        env = {**env, "REDRAFTER_NO_SMALLROWS": "1", "REDRAFTER_NO_OPENBLAS": "1"}
    current = _preload_list(env)
    kept = current
    if env.get("REDRAFTER_NO_SMALLROWS"):  # also when inherited from a parent that had it
        kept = [p for p in current if "smallrows" not in Path(p).name]
    ours = []
    kernel = None if env.get("REDRAFTER_NO_SMALLROWS") else smallrows_library(build)
    openblas = not env.get("REDRAFTER_NO_OPENBLAS") and os.path.exists(OPENBLAS)
    bundled = None if openblas else env.get(NEXT_ENV) or bundled_blas()
    if kernel and (openblas or bundled):
        ours.append(str(kernel))
    if openblas:
        ours.append(OPENBLAS)
    names = {Path(p).name for p in ours}
    wanted = ours + [p for p in kept if Path(p).name not in names]
    next_blas = bundled if str(kernel) in wanted and not openblas else env.get(NEXT_ENV)
    coretype = None  # a user's OPENBLAS_CORETYPE stands
    if openblas and CORETYPE_ENV not in env:
        coretype = openblas_coretype()
    tunables = _with_huge_pages(env) if wanted else env.get(TUNABLES_ENV)
    unchanged = next_blas == env.get(NEXT_ENV) and tunables == env.get(TUNABLES_ENV)
    if wanted == current and unchanged and coretype is None:
        return None
    env = dict(env, LD_PRELOAD=":".join(wanted))
    if tunables:
        env[TUNABLES_ENV] = tunables
    if coretype:
        env[CORETYPE_ENV] = coretype
    if next_blas:
        env[NEXT_ENV] = next_blas
    if _failed:
        env["REDRAFTER_NO_SMALLROWS"] = "1"  # noted once: no second build in the child
    return env


def _with_huge_pages(env: dict[str, str]) -> str | None:
    """``GLIBC_TUNABLES`` of ``env`` with malloc's huge pages on, unless opted out or set by
    the user (either way)."""
    tunables = env.get(TUNABLES_ENV)
    if env.get("REDRAFTER_NO_HUGEPAGES") or "glibc.malloc.hugetlb" in (tunables or ""):
        return tunables
    return f"{tunables}:{HUGE_PAGES}" if tunables else HUGE_PAGES


def reexec_with_blas() -> None:
    """Re-execute this process (same interpreter flags and arguments, ``sys.orig_argv``) with
    :func:`preload_env`'s libraries preloaded, unless MLX is already imported (too late) or
    nothing is missing."""
    if "mlx" in sys.modules:
        return
    env = preload_env(dict(os.environ))
    if env is not None:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


_LOADED: list[str] = []  # libraries :func:`preload_in_process` loaded into this process

TOO_LATE = (
    "MLX was imported before redrafter_mlx, so its CPU backend runs without {missing}: import "
    "redrafter_mlx first, or start Python with LD_PRELOAD={libraries}"
)


def preload_in_process() -> str | None:
    """Load :func:`preload_env`'s libraries into this process (``RTLD_GLOBAL``, kernel first)
    so that MLX, imported afterwards, multiplies with them: what the console script's re-exec
    does, for a library import, but compiling nothing (the kernel comes where a command or
    :func:`prepare` built it). None when done or nothing is missing; a one-line note with the
    fix when MLX is already loaded (a process cannot change its BLAS after that)."""
    env = preload_env(dict(os.environ), build=False)
    if env is None:
        return None
    present = set(_preload_list(os.environ)) | set(_LOADED)
    wanted = [p for p in _preload_list(env) if p not in present]
    if not wanted:
        return None
    if "mlx" in sys.modules:
        kernel_only = all("smallrows" in Path(p).name for p in wanted)
        missing = "the small-row decode kernel" if kernel_only else "OpenBLAS (much slower)"
        return TOO_LATE.format(missing=missing, libraries=":".join(_preload_list(env)))
    # dlopen's RTLD_NEXT does not see libraries loaded after the kernel: tell it by name
    # where to pass products on (it reads this on its first product)
    after = [p for p in _preload_list(env) if "smallrows" not in Path(p).name]
    if env.get(NEXT_ENV) or after:
        os.environ[NEXT_ENV] = env.get(NEXT_ENV) or after[0]
    if env.get(CORETYPE_ENV):  # read when OpenBLAS loads, just below
        os.environ[CORETYPE_ENV] = env[CORETYPE_ENV]
    for path in wanted:
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            break  # keep what loaded: the kernel needs the BLAS after it, which comes next
        _LOADED.append(path)
    return None


def _preload_list(env) -> list[str]:
    """``LD_PRELOAD``'s entries (ld.so splits it on spaces and colons)."""
    return [p for p in env.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p]


def _preloaded(marker: str) -> str | None:
    paths = _preload_list(os.environ) + _LOADED
    return next((p for p in paths if marker in Path(p).name), None)


def blas_in_use() -> str:
    """Which BLAS this process runs with (Linux CPU backend); 'Accelerate' on macOS."""
    if sys.platform == "darwin":
        return "Accelerate"
    base = "OpenBLAS" if _preloaded("openblas") else "mlx built-in"
    return f"{base} + small-row kernel" if _smallrows() else base


@functools.cache
def _smallrows() -> ctypes.CDLL | None:
    """The preloaded small-row kernel (the same loaded copy) when it is the ``cblas_sgemm`` the
    process calls (preloaded before any other BLAS), or None."""
    path = _preloaded("smallrows")
    try:
        lib = ctypes.CDLL(path) if path else None
        resolved = ctypes.CDLL(None).cblas_sgemm  # the process-wide lookup MLX's calls get
    except (OSError, AttributeError):
        return None
    address = ctypes.cast(resolved, ctypes.c_void_p).value
    return lib if lib and address == ctypes.cast(lib.cblas_sgemm, ctypes.c_void_p).value else None


def smallrows_loaded() -> bool:
    return _smallrows() is not None


@contextmanager
def smallrows_off():
    """Within the block every product goes to the next BLAS (a stock baseline, same process).
    A process-wide switch: not for use from several threads at once."""
    lib = _smallrows()
    previous = lib.redrafter_smallrows_enable(0) if lib else None
    try:
        yield
    finally:
        if lib:
            lib.redrafter_smallrows_enable(previous)


def smallrows_counts() -> tuple[int, int] | None:
    """(products computed by the kernel, products passed on) in this process, or None."""
    lib = _smallrows()
    if lib is None:
        return None
    mine, passed = ctypes.c_long(), ctypes.c_long()
    lib.redrafter_smallrows_counts(ctypes.byref(mine), ctypes.byref(passed))
    return mine.value, passed.value
