"""A user's path on a hybrid model's folder (a Gated DeltaNet hybrid, tests/support/families.py):
a drafter trained with ``redrafter-mlx train`` (teacher-forced, or on the target's own
answers) decodes exactly through ``generate``, and ``eval-drafter`` runs on the pair."""

from __future__ import annotations

import json

import pytest
from support import shared_data
from support.families import PROMPTS, TOKENIZER, exchanges, model_folder, run_json, train_flags

from redrafter_mlx.cli import main


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "exchanges.jsonl"
    return exchanges(shared_data("sharegpt-tiny/sharegpt_tiny.json"), out)


@pytest.mark.parametrize("source", ["teacher", "self"])
def test_a_drafter_trained_on_a_hybrid_decodes_exactly_from_the_command_line(
    source, conversations, tmp_path, capsys
):
    """train (teacher-forced, or on the target's own answers) -> generate with the drafter,
    equal to --autoregressive -> eval-drafter -> bench (exact against mlx-lm), on a Gated
    DeltaNet hybrid's folder."""
    model = model_folder("qwen3_5", tmp_path / "qwen3_5", shared_data(TOKENIZER))
    flags = train_flags(model, conversations, tmp_path)
    # a smaller budget than the attention families': exactness needs a drafter, not a good one
    flags[flags.index("--max-tokens") + 1] = "1500"
    flags[flags.index("--epochs") + 1] = "2"
    flags += ["--heldout-tokens", "200", "--eval-prompts", "1"]
    if source == "self":
        flags += ["--source", "self", "--gen-tokens", "24", "--gen-batch", "8"]
    main(flags)
    drafter = str(tmp_path / "drafter")
    for prompt in PROMPTS:
        base = ["generate", "--model", str(model), "--prompt", prompt, "--max-tokens", "24"]
        want = run_json(capsys, [*base, "--autoregressive", "--json"])
        shape = ["--beam-width", "3", "--beam-length", "4", "--lookup", "1"]
        got = run_json(capsys, [*base, "--drafter", drafter, *shape, "--json"])
        assert got["mode"] == "redrafter" and want["mode"] == "autoregressive"
        assert got["tokens"] == want["tokens"] and len(want["tokens"]) == 24
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    report = run_json(capsys, [
        "eval-drafter", "--model", str(model), "--drafter", drafter, "--prompts", str(prompts),
        "--max-tokens", "16", "--beam-width", "2", "--beam-length", "3", "--json",
    ])  # fmt: skip
    assert report
    if source == "teacher":  # bench against mlx-lm on the same pair: every row exact
        out = tmp_path / "bench"
        main([
            "bench", "--model", str(model), "--drafter", drafter, "--prompts", str(prompts),
            "--num-prompts", "1", "--max-tokens", "12", "--repetitions", "1",
            "--beam-width", "2", "--beam-length", "3", "--timed-prompts", "0",
        "--this-plan-only", "--out", str(out),
        ])  # fmt: skip
        rows = json.loads((out / "bench.json").read_text())["plans"][0]["results"]
        assert {r["kind"] for r in rows} >= {"mlx-lm", "redrafter"}, rows
        assert all(r["exact"] for r in rows), rows


@pytest.mark.parametrize("family", ["qwen3_5", "lfm2", "nemotron_h", "falcon_h1"])
def test_demo_model_makes_each_verified_hybrid_family_offline(family, tmp_path, capsys):
    """`demo-model --family` writes the hybrid families io/checks.py verifies (Gated DeltaNet,
    short convolutions, Mamba2), with recurrent layers, and `generate` speculates on it exactly
    (lookup beams against --autoregressive)."""
    from redrafter_mlx.io.checks import VERIFIED_RECURRENT
    from redrafter_mlx.io.load import load_target

    out = tmp_path / family
    main(["demo-model", "--out", str(out), "--family", family])
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == family in VERIFIED_RECURRENT
    model, _, _ = load_target(out)
    kinds = {type(c).__name__ for c in model.make_cache()}
    assert "ArraysCache" in kinds or "CacheList" in kinds  # recurrent state, not only K/V
    base = ["generate", "--model", str(out), "--prompt", "Hi there", "--max-tokens", "12"]
    want = run_json(capsys, [*base, "--autoregressive", "--json"])
    got = run_json(capsys, [*base, "--lookup", "2", "--json"])
    assert got["mode"] != "autoregressive" and got["tokens"] == want["tokens"]
