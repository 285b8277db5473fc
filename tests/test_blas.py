"""The small-row BLAS kernel (csrc/smallrows.c) and how the CLI preloads it (blas.py)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from redrafter_mlx.backend.cpu import blas


@pytest.fixture(scope="module")
def kernel():
    path = blas.smallrows_library()
    if path is None:
        pytest.skip("the small-row kernel cannot be built here (needs Linux x86-64, AVX2, cc)")
    return path


def run_preloaded(kernel, code: str, **extra_env) -> str:
    """Run ``code`` in a fresh Python with the kernel preloaded before the next BLAS."""
    env = dict(os.environ, **extra_env)
    env.pop("LD_PRELOAD", None)
    env.pop(blas.NEXT_ENV, None)
    env = blas.preload_env(env)
    assert env is not None and env["LD_PRELOAD"].split(":")[0] == str(kernel)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


PRODUCTS = """
    import json, numpy as np, mlx.core as mx
    from redrafter_mlx.backend.cpu import blas

    rng = np.random.default_rng(0)
    before = blas.smallrows_counts()
    worst = 0.0
    for rows, out, k in [(1, 3072, 576), (2, 3072, 576), (3, 49152, 64), (8, 576, 1536),
                         (9, 576, 576), (5, 10, 7), (2, 1000, 13), (4, 700, 300)]:
        w = rng.standard_normal((out, k)).astype(np.float32)
        x = rng.standard_normal((rows, k)).astype(np.float32)
        want = x.astype(np.float64) @ w.T.astype(np.float64)
        bias = rng.standard_normal((out,)).astype(np.float32)
        biased = 0.5 * want + 2.0 * bias  # MLX's addmm: a Linear with a bias
        for got, ref in (
            (mx.array(x) @ mx.array(w).T, want),
            ((mx.array(w) @ mx.array(x).T).T, want),
            (mx.addmm(mx.array(bias), mx.array(x), mx.array(w).T, alpha=0.5, beta=2.0), biased),
            (mx.array(x) @ mx.array(np.ascontiguousarray(w.T)), want),  # B untransposed
        ):
            worst = max(worst, float(np.abs(np.array(got) - ref).max() / np.abs(ref).max()))
    mid = blas.smallrows_counts()
    # a row's products do not depend on which rows come with it (one token vs a tree)
    w = mx.array(rng.standard_normal((3072, 576)).astype(np.float32))
    x = mx.array(rng.standard_normal((4, 576)).astype(np.float32))
    wt = mx.array(np.ascontiguousarray(np.array(w).T))
    same = all(
        mx.array_equal((x[i:i + 1] @ w.T)[0], (x @ w.T)[i]).item()
        and mx.array_equal((x[i:i + 1] @ wt)[0], (x @ wt)[i]).item()
        for i in range(4)
    )
    # views with a row stride longer than their rows (lda, ldb > K), as MLX may pass them
    wide_w = mx.array(rng.standard_normal((700, 320)).astype(np.float32))
    wide_x = mx.array(rng.standard_normal((3, 320)).astype(np.float32))
    got = wide_x[:, 5:300] @ wide_w[:, 5:300].T
    want = np.array(wide_x)[:, 5:300].astype(np.float64) @ np.array(wide_w)[:, 5:300].T
    worst = max(worst, float(np.abs(np.array(got) - want).max() / np.abs(want).max()))
    ready = blas.smallrows_counts()
    with blas.smallrows_off():
        mx.eval(x @ w.T)
    after = blas.smallrows_counts()
    print(json.dumps([blas.blas_in_use(), worst, mid[0] - before[0], mid[1] - before[1], same,
                      after[0] - ready[0], after[1] - ready[1]]))
"""


def test_kernel_computes_small_products_and_passes_on_the_rest(kernel):
    out = json.loads(run_preloaded(kernel, PRODUCTS))
    name, worst, mine, passed, same, mine_off, passed_off = out
    assert name.startswith("OpenBLAS" if os.path.exists(blas.OPENBLAS) else "mlx")
    assert name.endswith("+ small-row kernel")
    assert worst < 1e-5  # float32 sums against float64 ones
    assert mine == 28  # 7 shapes with a side of at most 8 rows, four forms each
    assert passed == 4  # 9 rows against 576: the next BLAS's
    assert same is True
    assert mine_off == 0 and passed_off == 1  # switched off: everything passes on


def test_kernel_without_openblas_passes_on_to_mlx_bundled_blas(kernel):
    out = json.loads(run_preloaded(kernel, PRODUCTS, REDRAFTER_NO_OPENBLAS="1"))
    name, worst, mine, passed, *_ = out
    assert name == "mlx built-in + small-row kernel"
    assert worst < 1e-5 and mine == 28 and passed == 4


def test_preload_env_order_idempotence_and_opt_out(kernel, monkeypatch, tmp_path):
    env = blas.preload_env({"PATH": os.environ["PATH"]})
    libs = env["LD_PRELOAD"].split(":")
    assert libs[0] == str(kernel)
    if os.path.exists(blas.OPENBLAS):
        assert libs[1] == blas.OPENBLAS
        # the kernel behind OpenBLAS would never be called: put back in front
        wrong = blas.preload_env({"LD_PRELOAD": f"{blas.OPENBLAS}:{kernel}:/x/other.so"})
        assert wrong["LD_PRELOAD"] == f"{kernel}:{blas.OPENBLAS}:/x/other.so"
    assert blas.preload_env(env) is None  # nothing missing: no second re-exec
    monkeypatch.setenv("REDRAFTER_NO_SMALLROWS", "1")
    openblas = tmp_path / "libopenblas.so.0"  # an OpenBLAS to preload, here or not
    openblas.write_bytes(b"")
    monkeypatch.setattr(blas, "OPENBLAS", str(openblas))
    plain = blas.preload_env({"PATH": os.environ["PATH"], "REDRAFTER_NO_SMALLROWS": "1"})
    assert plain["LD_PRELOAD"] == str(openblas)  # OpenBLAS alone: the kernel opted out
    inherited = blas.preload_env({**env, "REDRAFTER_NO_SMALLROWS": "1"})
    assert str(kernel) not in inherited["LD_PRELOAD"]


def test_kernel_needs_a_blas_behind_it(kernel, monkeypatch):
    """Without OpenBLAS or MLX's bundled BLAS the kernel would have nowhere to pass prompt
    products: it is not preloaded then."""
    monkeypatch.setattr(blas, "OPENBLAS", "/nonexistent/libopenblas.so.0")
    monkeypatch.setattr(blas, "bundled_blas", lambda: None)
    assert blas.preload_env({"PATH": os.environ["PATH"]}) is None


def test_kernel_behind_another_blas_is_not_reported(kernel):
    """The first preloaded ``cblas_sgemm`` is the one MLX calls: a kernel behind OpenBLAS is
    dead code, and the process must not claim (or benchmark) it."""
    if not os.path.exists(blas.OPENBLAS):
        pytest.skip("needs Debian's OpenBLAS")
    code = "from redrafter_mlx.backend.cpu import blas; "
    code += "print(blas.blas_in_use(), blas.smallrows_loaded())"
    env = dict(os.environ, LD_PRELOAD=f"{blas.OPENBLAS}:{kernel}")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.stdout.split() == ["OpenBLAS", "False"], done.stderr


FAILED_BUILD = """
    import os, sys
    from redrafter_mlx.backend.cpu import blas

    blas.OPENBLAS = sys.argv[1]  # a BLAS to preload: the child's environment is returned
    print(blas.smallrows_library())
    print(blas.preload_env({"PATH": os.environ["PATH"]})["REDRAFTER_NO_SMALLROWS"])
"""


@pytest.mark.parametrize("why", ["compiler", "cache-under-a-file"])
def test_failed_build_is_a_note_and_leaves_nothing(kernel, tmp_path, why):
    """A build that fails prints one note, leaves no file, and tells the re-executed process
    not to build again (a process of its own: the failure is remembered process-wide)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.NEXT_ENV)}
    env.pop("REDRAFTER_NO_SMALLROWS", None)
    if why == "compiler":
        env.update(REDRAFTER_CACHE=str(tmp_path), CC="false --flag")
    else:
        (tmp_path / "file").write_text("")
        env["REDRAFTER_CACHE"] = str(tmp_path / "file")
    openblas = tmp_path / "libopenblas.so.0"
    openblas.write_bytes(b"")
    code = textwrap.dedent(FAILED_BUILD)
    done = subprocess.run(
        [sys.executable, "-c", code, str(openblas)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["None", "1"]
    assert "without the small-row BLAS kernel" in done.stderr
    if why == "compiler":
        assert list((tmp_path / "blas").iterdir()) == []


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}, "SkylakeX"),
        ({"avx2", "fma", "avx512f"}, "Haswell"),  # AVX-512 without what SkylakeX's kernels use
        ({"avx2", "fma"}, "Haswell"),
        ({"sse3", "avx"}, None),  # OpenBLAS's own detection stands
    ],
)
def test_openblas_gets_the_kernels_the_flags_allow(monkeypatch, tmp_path, flags, expected):
    """A virtual machine's CPUID can name a 'generic' Xeon that OpenBLAS falls back to SSE3
    kernels for: the preloaded OpenBLAS is told its kernels by the CPU's flags, unless the user
    chose them, and not at all where OpenBLAS is not preloaded."""
    openblas = tmp_path / "libopenblas.so.0"
    openblas.write_bytes(b"")
    monkeypatch.setattr(blas, "OPENBLAS", str(openblas))
    monkeypatch.setattr(blas, "cpu_flags", lambda: flags)
    monkeypatch.setattr(blas.platform, "machine", lambda: "x86_64")
    base = {"PATH": os.environ["PATH"], "REDRAFTER_NO_SMALLROWS": "1"}
    env = blas.preload_env(base)
    assert env.get("OPENBLAS_CORETYPE") == expected
    assert blas.preload_env({**base, "OPENBLAS_CORETYPE": "Zen"}).get("OPENBLAS_CORETYPE") == "Zen"
    assert "OPENBLAS_CORETYPE" not in (
        blas.preload_env({**base, "REDRAFTER_NO_OPENBLAS": "1"}) or {}
    )
    if expected:  # preloaded already, kernels not chosen: re-executed to choose them
        again = blas.preload_env({**base, "LD_PRELOAD": str(openblas)})
        assert again["OPENBLAS_CORETYPE"] == expected
        assert blas.preload_env(env) is None


def test_preloaded_openblas_runs_the_chosen_kernels():
    """The real OpenBLAS, loaded as the CLI's re-exec loads it, reports the chosen core."""
    coretype = blas.openblas_coretype()
    if not os.path.exists(blas.OPENBLAS) or coretype is None:
        pytest.skip("needs Debian's OpenBLAS on x86-64 with AVX2")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    env = blas.preload_env({**env, "REDRAFTER_NO_SMALLROWS": "1", "LD_PRELOAD": ""})
    code = "import ctypes; lib = ctypes.CDLL(None); lib.openblas_get_corename.restype = "
    code += "ctypes.c_char_p; print(lib.openblas_get_corename().decode())"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().lower() == coretype.lower()


def test_preload_env_asks_for_huge_pages(kernel):
    """The re-executed process gets malloc's transparent huge pages, beside a user's own
    tunables, unless opted out; a process that has them is not re-executed again."""
    base = {"PATH": os.environ["PATH"]}
    env = blas.preload_env(base)
    assert env["GLIBC_TUNABLES"] == blas.HUGE_PAGES
    assert blas.preload_env(env) is None
    mine = blas.preload_env({**base, "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert mine["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{blas.HUGE_PAGES}"
    theirs = blas.preload_env({**base, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})
    assert theirs["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=0"
    assert "GLIBC_TUNABLES" not in blas.preload_env({**base, "REDRAFTER_NO_HUGEPAGES": "1"})
