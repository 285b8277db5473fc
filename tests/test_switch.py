"""``REDRAFTER_CPU_TUNING=0``: this machine runs exactly the path Metal and CUDA run."""

from __future__ import annotations

import os

import numpy as np
import pytest
from support import run_steps, tiny_llama

from redrafter_mlx.backend.cpu import blas
from redrafter_mlx.backend.cpu.fused import FusedForward
from redrafter_mlx.backend.plan import CPU_PLAN, GENERIC_PLAN, plan_for
from redrafter_mlx.core.decode import llm
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.drafters.beam_search import BeamDrafter
from redrafter_mlx.core.drafters.redrafter import random_drafter


@pytest.fixture
def calls(monkeypatch):
    """How often each forward path ran (both still run)."""
    counts = {"llama": 0, "generic": 0}

    def counted(name: str, real):
        def counting(*args):
            counts[name] += 1
            return real(*args)

        return counting

    monkeypatch.setattr(FusedForward, "run", counted("llama", FusedForward.run))
    monkeypatch.setattr(llm.Forward, "run", counted("generic", llm.Forward.run))
    return counts


def decode(plan, steps: int = 12):
    model = tiny_llama(seed=3, vocab=16)
    drafter = BeamDrafter(random_drafter(64, 16, seed=4), model.model.embed_tokens)
    shape = BeamShape(3, 4, min_prob=0.05)
    out = []
    for i, step in enumerate(run_steps(model, [3, 5, 7, 2], drafter, shape, plan=plan)):
        out.append(step)
        if i == steps:
            return out


@pytest.mark.parametrize("setting", ["1", "0"])
def test_the_switch_picks_the_plan_and_the_branches(setting, monkeypatch, calls):
    monkeypatch.setenv("REDRAFTER_CPU_TUNING", setting)
    plan = plan_for()
    assert plan is (CPU_PLAN if setting == "1" else GENERIC_PLAN)
    steps = decode(plan)
    if setting == "1":  # the fused Llama forward, early-stopped drafting (extra reads)
        assert calls["llama"] > 0 and calls["generic"] == 0
        assert max(s.syncs for s in steps) > 1
    else:  # mlx-lm's modules only, one host read per step
        assert calls["llama"] == 0 and calls["generic"] > 0
        assert {s.syncs for s in steps[1:]} == {1}
    cpu = BeamShape(1, 2, lookup=1)
    assert plan.default_shape == (cpu if setting == "1" else BeamShape(2, 4))


def test_both_plans_emit_the_same_tokens():
    tokens = [[s.tokens for s in decode(plan, 30)] for plan in (CPU_PLAN, GENERIC_PLAN)]
    assert sum(len(t) for t in tokens[0][1:]) > 30  # drafts were accepted
    assert np.array_equal(np.concatenate(tokens[0]), np.concatenate(tokens[1]))


def test_switch_off_preloads_neither_the_kernel_nor_openblas(monkeypatch):
    base = {"PATH": os.environ["PATH"]}
    assert blas.preload_env({**base, "REDRAFTER_CPU_TUNING": "0"}) is None
    inherited = {**base, "LD_PRELOAD": "/x/smallrows-abc.so", "REDRAFTER_CPU_TUNING": "0"}
    stripped = blas.preload_env(inherited)
    assert stripped is not None and "smallrows" not in stripped["LD_PRELOAD"]
    monkeypatch.setattr(blas, "cuda_backend_installed", lambda: True)  # MLX on an NVIDIA GPU
    assert blas.preload_env(base) is None
