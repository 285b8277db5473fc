"""The Python API: the README's example runs as written, and importing it loads the fast BLAS."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support import readme_python_example

from redrafter_mlx.backend.cpu.blas import OPENBLAS

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.slow
def test_the_readme_python_example_runs_as_written():
    done = subprocess.run(
        [sys.executable, "-c", readme_python_example()], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout and "tokens/step" in done.stdout
    assert "Prompt:" in done.stdout and "Generation:" in done.stdout  # verbose, as mlx-lm's


@pytest.mark.skipif(not Path(OPENBLAS).exists(), reason="no Debian OpenBLAS on this machine")
def test_importing_the_api_before_mlx_loads_openblas_in_process():
    """Without LD_PRELOAD, ``import redrafter_mlx.api`` (first) makes MLX multiply with
    OpenBLAS; importing MLX first leaves it too late, said in one warning with the fix."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    for name in ("REDRAFTER_SMALLROWS_NEXT", "REDRAFTER_CPU_TUNING", "REDRAFTER_NO_OPENBLAS"):
        env.pop(name, None)  # as a user starts Python (the generic plan's pass sets one)
    first = "import redrafter_mlx.api; from redrafter_mlx.backend.cpu.blas import blas_in_use; "
    first += "print(blas_in_use())"
    done = subprocess.run([sys.executable, "-c", first], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("OpenBLAS") and "MLX was imported" not in done.stderr
    late = "import mlx.core; import warnings; warnings.simplefilter('always'); "
    late += "import redrafter_mlx.api"
    done = subprocess.run([sys.executable, "-c", late], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "MLX was imported before redrafter_mlx" in done.stderr
    assert "LD_PRELOAD=" in done.stderr


def test_the_package_exports_the_api_lazily():
    """``import redrafter_mlx`` (what the console script does first) must not import MLX."""
    code = "import sys, redrafter_mlx; print('mlx' in sys.modules); "
    code += "print(callable(redrafter_mlx.stream_generate), 'mlx' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True", "True"]


def test_dir_lists_the_public_api_without_importing_it():
    """``dir(redrafter_mlx)`` names ``load``, ``generate``... while MLX stays unimported."""
    code = "import sys, redrafter_mlx; names = dir(redrafter_mlx); "
    code += "print(sorted(set(redrafter_mlx.__all__) - set(names)), 'mlx' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]", "False"]


@pytest.mark.slow
def test_load_says_which_drafter_it_chose(caplog):
    """As the command line says it on stderr: a logger line and ``model.drafter_source``."""
    from redrafter_mlx import load
    from redrafter_mlx.io.drafters import DrafterChoice

    with caplog.at_level("INFO", logger="redrafter_mlx"):
        model, _ = load()
    choice = model.runtime.drafter_choice
    assert isinstance(choice, DrafterChoice) and choice.path is not None
    assert model.drafter_source == choice.describe()
    assert model.drafter_source.startswith(f"drafter: {choice.path} (")
    said = [r.getMessage() for r in caplog.records if r.name.startswith("redrafter_mlx")]
    assert said == [model.drafter_source]


def readme_batch_example() -> str:
    """The README's ``batch_generate`` block (the "Python API" section's second)."""
    section = README.read_text().split("## Python API", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    return next(b for b in blocks if "batch_generate" in b)


@pytest.mark.slow
def test_the_readme_batch_generate_example_runs_as_written():
    done = subprocess.run(
        [sys.executable, "-c", readme_batch_example()], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("drafter: ")  # model.drafter_source
    assert "[batch_generate] Generation:" in done.stdout  # verbose, as mlx-lm's
    answer = next(line for line in lines if line.startswith("What is the capital of France? ->"))
    assert "Paris" in answer
