"""``benchmarks/context_verify_cost.py`` with run 123's tree-attention kernel (built without
contraction as it was then) or the working tree's (run 124). The old source is in git only;
put it beside this file first:

    git show 6639106:benchmarks/results/kernels/attention_run123.cpp \\
        > benchmarks/lab/kernels/attention_run123.cpp
    PYTHONPATH=. .venv/bin/python benchmarks/lab/kernels/kernel_ab.py old --contexts 8000 \\
        --sizes 1,3 --variants cpu --out /tmp/old.json

Each build lands in the kernel cache under its own source's hash, so the two alternate freely.
"""

import runpy
import sys
from pathlib import Path

from redrafter_mlx.backend.cpu.blas import reexec_with_blas

reexec_with_blas()  # before MLX loads (the re-exec keeps these arguments)

from redrafter_mlx.backend.cpu import kernels  # noqa: E402

if sys.argv.pop(1) == "old":
    kernels.SOURCE = Path(__file__).with_name("attention_run123.cpp")
    run, off = kernels._run, "-ffp-contract=off"
    kernels._run = lambda cmd: run([off if c == "-ffp-contract=fast" else c for c in cmd])
sys.argv[0] = "benchmarks/context_verify_cost.py"
runpy.run_path(sys.argv[0], run_name="__main__")
