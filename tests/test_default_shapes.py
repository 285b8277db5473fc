"""Each drafter type's own default beam shape per plan (``Plan.shape_for``): the published
settings for GPUs, the measured ones for the CPU, fitted to the drafter, and exact there."""

from __future__ import annotations

import json

import pytest
from support import run_steps, tiny_llama
from support.decoding import take

from redrafter_mlx.backend.plan import CPU_PLAN, GENERIC_PLAN
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.io.demo_drafters import KINDS, write_demo_drafter
from redrafter_mlx.io.field_drafters import create_drafter

PLANS = {"cpu": CPU_PLAN, "generic": GENERIC_PLAN}


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=96, layers=3)


@pytest.fixture(scope="module")
def drafters(target, tmp_path_factory):
    """A random drafter of each field type for ``target``, as its authors lay one out."""
    root = tmp_path_factory.mktemp("drafters")
    config = {"hidden_size": 64, "vocab_size": 96, "num_hidden_layers": 3}
    (root / "config.json").write_text(json.dumps(config))
    return {k: create_drafter(write_demo_drafter(root / k, root, k), target) for k in KINDS}


def test_each_type_has_its_own_default_shape(drafters):
    """On a GPU a DFlash drafter verifies its block as a best-first tree (here block 8: 7
    drafted nodes), EAGLE-3 4 beams of 3; on the CPU DFlash verifies more than 2 nodes too."""
    generic = {k: GENERIC_PLAN.shape_for(d) for k, d in drafters.items()}
    assert generic == {
        "eagle3": BeamShape(width=4, length=4),
        "dflash": BeamShape(width=7, length=8),
        "dflash2": BeamShape(width=4, length=5),  # the 5 rows mlx-vlm verifies it with at most
        "mtp": BeamShape(width=1, length=2),
    }
    assert CPU_PLAN.shape_for(drafters["dflash"]) == BeamShape(width=7, length=5)
    assert CPU_PLAN.shape_for(drafters["eagle3"]) == CPU_PLAN.default_shape
    assert GENERIC_PLAN.shape_for(None) == GENERIC_PLAN.default_shape  # lookup beams alone
    for plan in PLANS.values():
        for drafter in drafters.values():
            drafter.check_shape(plan.shape_for(drafter))  # every default can be drafted


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("kind", KINDS)
def test_each_type_is_exact_at_its_default_shape(target, drafters, kind, plan):
    drafter, plan = drafters[kind], PLANS[plan]
    prompt = [5, 17, 33, 2, 41, 8]
    expected = take(run_steps(target, prompt, plan=plan), 32)[0]
    steps = run_steps(target, prompt, drafter, plan.shape_for(drafter), plan=plan)
    assert take(steps, 32)[0] == expected


def test_generate_says_the_drafter_type_and_uses_its_shape(tmp_path, capsys):
    from redrafter_mlx.cli import main

    model = tmp_path / "demo"
    main(["demo-model", "--out", str(model), "--drafter", "dflash"])
    capsys.readouterr()
    main(["generate", "--model", str(model), "--drafter", f"{model}-dflash", "--prompt", "Hi",
          "--max-tokens", "8", "--json"])  # fmt: skip
    result = json.loads(capsys.readouterr().out)
    assert result["drafter_type"] == "dflash" and result["shape_source"] == "default"
    assert result["beam_width"] > 2 and result["mean_tree_size"] > 2
    main(["generate", "--model", str(model), "--drafter", f"{model}-dflash", "--prompt", "Hi",
          "--max-tokens", "4"])  # fmt: skip
    assert "[DFlash W=" in capsys.readouterr().err
