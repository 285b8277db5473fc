"""`bench --drafter` with a field drafter (EAGLE-3, DFlash, MTP): how a user tells whether a
published drafter helped (docs/drafters.md) runs, rehearsed on the demo model's random one."""

from __future__ import annotations

import json

import pytest

from redrafter_mlx.cli import main
from redrafter_mlx.io.demo import write_demo_model
from redrafter_mlx.io.demo_drafters import write_demo_drafter


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_bench_runs_a_field_drafter_and_leaves_its_draft_cost_untimed(kind, tmp_path, capsys):
    model = write_demo_model(tmp_path / "demo")
    drafter = write_demo_drafter(tmp_path / f"demo-{kind}", model, kind)
    out = tmp_path / "bench"
    main(["bench", "--model", str(model), "--drafter", str(drafter), "--num-prompts", "1",
          "--beam-width", "2", "--beam-length", "3", "--max-tokens", "8", "--repetitions", "1",
          "--timed-prompts", "0", "--this-plan-only", "--out", str(out)])  # fmt: skip
    capsys.readouterr()
    (plan,) = json.loads((out / "bench.json").read_text())["plans"]
    rows = {r["method"]: r for r in plan["results"]}
    (drafted,) = [row for method, row in rows.items() if method.startswith("W2L3")]
    assert drafted["exact"] is True and drafted["tokens_per_step"] >= 1
    # its draft is part of the step (it drafts from its sequence's state), not timed alone
    assert drafted["draft_cost_ratio"] is None and drafted["speedup_bound_with_draft"] is None
    assert drafted["verify_cost_ratio"] > 0
