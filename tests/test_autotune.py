"""Autotune: the search on a synthetic noisy cost model, profile keys, the store, resolve_shape."""

from __future__ import annotations

import argparse
import io
import json
import math
import os
from dataclasses import replace

import numpy as np
import pytest
from rich.console import Console
from support import make_runtime, toy_tokenizer

from redrafter_mlx.backend.plan import plan_for
from redrafter_mlx.cli import autotune
from redrafter_mlx.cli.flags import shape_overrides
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.drafters.beam_search import BeamDrafter
from redrafter_mlx.io import runtime as rt
from redrafter_mlx.tuning import profiles, search
from redrafter_mlx.tuning.search import Observation

SHAPES = [BeamShape(w, n) for w in range(1, 9) for n in range(2, 7)]


def accepted(shape: BeamShape, acceptance: float) -> float:
    """Synthetic tokens/step: more beams raise the per-token acceptance, saturating."""
    p = 1 - (1 - acceptance) ** math.sqrt(shape.width)
    return sum(p**k for k in range(shape.length))


def tree(shape: BeamShape) -> float:
    return 1 + 0.8 * shape.width * (shape.length - 1)


def step_seconds(shape: BeamShape) -> float:
    """Synthetic cost, deliberately not in the search's model family (power, a jump at 16)."""
    t = tree(shape)
    cost = 1.15 + 0.05 * t**1.1 + 0.04 * shape.width * (shape.length - 1)
    return 0.1 * cost * (1.08 if shape.width * shape.length >= 16 else 1.0)


def noisy_measure(acceptance: float, rng: np.random.Generator):
    """Runs with +-25% uniform timing noise, a slow drift, and per-prompt acceptance."""
    calls = [0]

    def measure(shape: BeamShape, prompt: int) -> Observation:
        calls[0] += 1
        drift = 1 + 0.1 * math.sin(calls[0] / 7)
        a = accepted(shape, min(acceptance * (1 + 0.2 * math.sin(3 * prompt)), 0.95))
        seconds = step_seconds(shape) * rng.uniform(0.75, 1.25) * drift
        return Observation(shape, prompt, a, seconds, tree(shape))

    return measure


def true_tps(shape: BeamShape, acceptance: float) -> float:
    return accepted(shape, acceptance) / step_seconds(shape)


@pytest.mark.parametrize("acceptance", [0.1, 0.55, 0.8])
def test_search_finds_the_optimum_under_noise(acceptance):
    best = max(true_tps(s, acceptance) for s in SHAPES)
    hits, runs = 0, []
    for seed in range(50):
        rng = np.random.default_rng(1000 + seed)
        result = search.successive_halving(
            SHAPES, noisy_measure(acceptance, rng), num_prompts=4, seed=seed
        )
        hits += true_tps(result.best, acceptance) >= 0.95 * best
        runs.append(len(result.observations))
    assert hits >= 45  # >= 90% of 50 seeded trials within 5% of the true optimum
    assert max(runs) <= 0.4 * len(SHAPES) * 4 * 2  # vs a 4-prompt x 2-repetition grid


def test_full_grid_runs_everything_and_picks_the_median_best():
    rng = np.random.default_rng(0)
    shapes = SHAPES[:6]
    result = search.full_grid(shapes, noisy_measure(0.5, rng), num_prompts=2, repetitions=2)
    assert len(result.observations) == 6 * 2 * 2
    assert result.best == max(shapes, key=lambda s: search.grid_tps(result.observations, s))


def test_search_with_a_single_shape():
    rng = np.random.default_rng(0)
    result = search.successive_halving([BeamShape(2, 4)], noisy_measure(0.5, rng), num_prompts=2)
    assert result.best == BeamShape(2, 4)


def chip(name="Apple M2 Ultra", backend="Metal", blas=None):
    return {"chip": name, "backend": backend} | ({"blas": blas} if blas else {})


def test_profile_keys_separate_what_matters():
    base = profiles.profile_key(chip(), "m", "d", "float16", None)
    assert base == profiles.profile_key(chip(), "m", "d", "float16", None)
    others = [
        profiles.profile_key(chip("Apple M1 Max"), "m", "d", "float16", None),
        profiles.profile_key(chip(backend="CPU"), "m", "d", "float16", None),
        profiles.profile_key(chip("AMD EPYC", "CPU", "OpenBLAS"), "m", "d", "float16", None),
        profiles.profile_key(chip("AMD EPYC", "CPU", "mlx built-in"), "m", "d", "float16", None),
        profiles.profile_key(chip(), "m2", "d", "float16", None),
        profiles.profile_key(chip(), "m", "d2", "float16", None),
        profiles.profile_key(chip(), "m", "d", "float32", None),
        profiles.profile_key(chip(), "m", "d", "float16", {"bits": 4, "group_size": 64}),
    ]
    assert len({base, *others}) == len(others) + 1


def test_store_round_trip_and_atomic_write(tmp_path):
    path = tmp_path / "profiles.json"
    profiles.save_profile("k", {"shape": [3, 5], "fingerprint": "f"}, path)
    profiles.save_profile("k2", {"shape": [1, 4, 0.3], "fingerprint": "g"}, path)
    assert profiles.find_profile("k", "f", path) == BeamShape(3, 5)  # older two-field shape
    assert profiles.find_profile("k2", "g", path) == BeamShape(1, 4, 0.3)
    assert profiles.find_profile("other", "f", path) is None
    assert sorted(os.listdir(tmp_path)) == ["profiles.json"]  # no temp files left


def test_failed_write_leaves_the_previous_store(tmp_path, monkeypatch):
    path = tmp_path / "profiles.json"
    profiles.save_profile("k", {"shape": [3, 5], "fingerprint": "f"}, path)
    before = path.read_text()

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)  # what the atomic write renames with
    with pytest.raises(KeyboardInterrupt):
        profiles.save_profile("k", {"shape": [1, 2], "fingerprint": "f"}, path)
    assert path.read_text() == before
    assert sorted(os.listdir(tmp_path)) == ["profiles.json"]


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        '{"profiles": []}',
        "[]",
        '{"version": 1, "profiles": {"k": {"shape": "x"}}}',
        '{"version": 1, "profiles": {"k": {"shape": [0, 1], "fingerprint": "f"}}}',
        '{"version": 1, "profiles": {"k": {"shape": [1, 3, 2.0], "fingerprint": "f"}}}',
    ],
)
def test_corrupt_store_is_ignored_with_a_warning(tmp_path, capsys, content):
    path = tmp_path / "profiles.json"
    path.write_text(content)
    assert profiles.find_profile("k", "f", path) is None
    assert "warning" in capsys.readouterr().err
    profiles.save_profile("k", {"shape": [2, 3], "fingerprint": "f"}, path)  # replaces it
    assert profiles.find_profile("k", "f", path) == BeamShape(2, 3)


def test_stale_profile_is_ignored_with_a_warning(tmp_path, capsys):
    path = tmp_path / "profiles.json"
    profiles.save_profile("k", {"shape": [3, 5], "fingerprint": "old"}, path)
    assert profiles.find_profile("k", "new", path) is None
    assert "stale" in capsys.readouterr().err
    data = json.loads(path.read_text())
    data["version"] = 0
    path.write_text(json.dumps(data))
    assert profiles.find_profile("k", "old", path) is None


@pytest.fixture
def runtime(target, drafter, tmp_path, monkeypatch):
    monkeypatch.setenv("REDRAFTER_CACHE", str(tmp_path / "cache"))
    (tmp_path / "model").mkdir()
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "model.safetensors").write_bytes(b"weights")
    return make_runtime(
        target,
        None,
        {},
        BeamDrafter(drafter, target.model.embed_tokens),
        str(tmp_path / "model"),
        str(tmp_path / "drafter"),
    )


def shape_args(width=None, length=None, min_prob=None, search_width=None, lookup=None):
    return argparse.Namespace(
        beam_width=width,
        beam_length=length,
        min_prob=min_prob,
        search_width=search_width,
        lookup=lookup,
    )


def resolve(args, runtime):
    """The command's shape resolution: its flags (``args``) over the profile."""
    return profiles.resolve_shape(
        runtime, overrides=shape_overrides(args), temp=getattr(args, "temp", 0)
    )


def test_resolve_shape_uses_the_stored_profile(runtime, tmp_path):
    assert resolve(shape_args(), runtime) == (plan_for().default_shape, "default")
    key, fp = profiles.runtime_identity(runtime)
    profiles.save_profile(key, {"shape": [3, 5], "fingerprint": fp})
    assert (tmp_path / "cache" / "profiles.json").exists()
    assert resolve(shape_args(), runtime) == (BeamShape(3, 5), "autotune profile")
    full = shape_args(1, 2, 0.0, 0, 0)
    assert resolve(full, runtime) == (BeamShape(1, 2), "flags")
    # each flag overrides its own field; the others stay the profile's ("default: profile")
    assert resolve(shape_args(1, 2), runtime) == (
        BeamShape(1, 2),
        "flags + autotune profile",
    )
    assert resolve(shape_args(min_prob=0.3), runtime) == (
        BeamShape(3, 5, 0.3),
        "flags + autotune profile",
    )
    profiles.save_profile(key, {"shape": [3, 5, 0.2, 8], "fingerprint": fp})
    assert resolve(shape_args(length=4), runtime) == (
        BeamShape(3, 4, 0.2, 8),
        "flags + autotune profile",
    )


def test_sampling_uses_the_sampling_profile_else_the_greedy_one(runtime):
    key, fp = profiles.runtime_identity(runtime)
    sampled = argparse.Namespace(**vars(shape_args()), temp=0.7)
    assert resolve(sampled, runtime) == (plan_for().default_shape, "default")
    profiles.save_profile(key, {"shape": [3, 5, 0.3, 0], "fingerprint": fp})
    assert resolve(sampled, runtime) == (BeamShape(3, 5, 0.3), "autotune profile")
    profiles.save_profile(key + profiles.SAMPLING, {"shape": [1, 2], "fingerprint": fp})
    assert resolve(sampled, runtime) == (BeamShape(1, 2), "autotune profile, sampling")
    greedy = argparse.Namespace(**vars(shape_args()), temp=0.0)
    assert resolve(greedy, runtime) == (BeamShape(3, 5, 0.3), "autotune profile")
    sampled.beam_length = 3  # a flag overrides its field of the sampling profile
    assert resolve(sampled, runtime) == (
        BeamShape(1, 3),
        "flags + autotune profile, sampling",
    )


def test_shape_flags_without_a_profile_fill_in_the_default_shape(runtime):
    d = plan_for().default_shape
    assert resolve(shape_args(search_width=8), runtime) == (
        replace(d, search_width=8),
        "flags + default",
    )
    assert resolve(shape_args(lookup=3), runtime) == (replace(d, lookup=3), "flags + default")


def test_profiles_store_the_search_width_and_older_ones_still_load(tmp_path):
    path = tmp_path / "profiles.json"
    for stored, shape in (
        ([2, 4, 0.0, 0, 4], BeamShape(2, 4, lookup=4)),  # K lookup beams
        ([4, 5, 0.0, 16], BeamShape(4, 5, 0.0, 16)),
        ([4, 5, 0.2, 4], BeamShape(4, 5, 0.2)),  # S <= W: the plain search
        ([3, 5, 0.2], BeamShape(3, 5, 0.2)),
        ([3, 5], BeamShape(3, 5)),
    ):
        profiles.save_profile("k", {"shape": stored, "fingerprint": "f"}, path)
        assert profiles.find_profile("k", "f", path) == shape


def test_retrained_drafter_makes_the_profile_stale(runtime, tmp_path, capsys):
    key, fp = profiles.runtime_identity(runtime)
    profiles.save_profile(key, {"shape": [3, 5], "fingerprint": fp})
    (tmp_path / "drafter" / "model.safetensors").write_bytes(b"retrained weights")
    assert resolve(shape_args(), runtime) == (plan_for().default_shape, "default")
    assert "stale" in capsys.readouterr().err


def test_corrupt_store_never_breaks_resolve_shape(runtime, tmp_path, capsys):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "profiles.json").write_bytes(b"\xff\x00garbage")
    assert resolve(shape_args(), runtime) == (plan_for().default_shape, "default")
    assert "warning" in capsys.readouterr().err


def test_autotune_runs_again_over_its_stored_profile(runtime, monkeypatch, capsys):
    """The command end to end, twice on one machine: the second run finds the store file
    already there and replaces the profile (it once refused: 'profiles.json is a file')."""
    runtime.tokenizer = toy_tokenizer()
    monkeypatch.setattr(rt, "load_runtime", lambda *args, **kwargs: runtime)
    flags = ["--beam-width", "1", "--beam-length", "2,3", "--max-tokens", "8"]
    for _ in range(2):
        autotune.main(autotune.setup_arg_parser().parse_args([*flags, "--num-prompts", "1"]))
    assert capsys.readouterr().out.count("best: W=1") == 2
    data = profiles.read_store()
    (entry,) = data["profiles"].values()
    assert entry["max_tokens"] == 8 and entry["shape"][0] == 1
    assert all(list(row) == list(autotune.TABLE_COLUMNS) for row in entry["table"])  # printed


def test_autotune_tunes_on_a_users_prompt_file(runtime, monkeypatch, capsys, tmp_path):
    runtime.tokenizer = toy_tokenizer()
    monkeypatch.setattr(rt, "load_runtime", lambda *args, **kwargs: runtime)
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text('{"prompt": "w5 w6 w7"}\n{"turns": ["w8 w9", "later"]}\n')
    flags = ["--beam-width", "1", "--beam-length", "2", "--max-tokens", "8"]
    parse = autotune.setup_arg_parser().parse_args
    with pytest.raises(SystemExit):
        autotune.main(parse([*flags, "--prompts", str(prompts), "--num-prompts", "3"]))
    assert f"--num-prompts must be 1..2 ({prompts})" in capsys.readouterr().err
    autotune.main(parse([*flags, "--prompts", str(prompts), "--num-prompts", "2"]))
    (entry,) = profiles.read_store()["profiles"].values()
    assert entry["prompts"] == str(prompts) and entry["shape"][:2] == [1, 2]


def test_show_skips_malformed_profiles(runtime, capsys):
    """``--show`` lists the readable profiles and warns about the rest, like generation does."""
    good = {"shape": [2, 3, 0.3], "method": "grid", "tokens_per_second": 9.0}
    bad = {"empty": {}, "text": "oops", "zero": {"shape": [0, 1]}}
    profiles.write_store({"version": profiles.PROFILE_VERSION, "profiles": {"ok": good, **bad}})
    console = Console(file=io.StringIO(), width=200)
    autotune.show(console)
    assert "W=2 L=3 min-prob 0.3" in console.file.getvalue()
    err = capsys.readouterr().err
    assert all(f"malformed profile {key!r}" in err for key in bad)


def test_autotune_refuses_a_store_that_is_a_folder(runtime, monkeypatch, capsys):
    profiles.store_path().mkdir(parents=True)
    monkeypatch.setattr(rt, "load_runtime", lambda *args, **kwargs: pytest.fail("loaded"))
    with pytest.raises(SystemExit) as e:
        autotune.main(autotune.setup_arg_parser().parse_args(["--beam-width", "1"]))
    assert e.value.code == 1 and "is a folder" in capsys.readouterr().err


def test_a_profile_wider_than_the_draft_vocabulary_is_ignored_with_a_warning(runtime, capsys):
    """Like every other bad profile it warns and falls back (generate used to exit)."""
    key, fp = profiles.runtime_identity(runtime)
    vocab = runtime.drafter.drafter.args.draft_vocab
    profiles.save_profile(key, {"shape": [vocab + 1, 3], "fingerprint": fp})
    assert resolve(shape_args(), runtime) == (plan_for().default_shape, "default")
    assert f"{vocab + 1} beams exceed the drafter's vocabulary" in capsys.readouterr().err
    wider = replace(plan_for().default_shape, width=2)
    assert resolve(shape_args(width=2), runtime) == (wider, "flags + default")


@pytest.mark.parametrize("acceptance", [0.1, 0.55, 0.8])
def test_the_tables_first_row_is_the_searchs_best(acceptance):
    """Halving kept an eliminated shape's older, higher estimate, so its table could rank
    another shape first than the one it named best (W1 L2 named, W2 L2 K4 atop the table)."""
    for seed in range(20):
        rng = np.random.default_rng(1000 + seed)
        result = search.successive_halving(
            SHAPES, noisy_measure(acceptance, rng), num_prompts=4, seed=seed
        )
        first = search.table(result)[0]
        shape = (first["beam_width"], first["beam_length"], first["min_prob"], first["lookup"])
        best = result.best
        assert shape == (best.width, best.length, best.min_prob, best.lookup), seed


def test_autotunes_best_line_names_the_whole_shape_of_the_tables_first_row(
    runtime, monkeypatch, capsys
):
    runtime.tokenizer = toy_tokenizer()
    monkeypatch.setattr(rt, "load_runtime", lambda *args, **kwargs: runtime)
    flags = ["--beam-width", "1", "--beam-length", "2", "--lookup", "0,2", "--max-tokens", "8"]
    autotune.main(autotune.setup_arg_parser().parse_args([*flags, "--num-prompts", "1"]))
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("best: ")]
    (entry,) = profiles.read_store()["profiles"].values()
    top = entry["table"][0]
    assert entry["shape"] == [1, 2, 0.0, 1, top["lookup"]]
    assert line.startswith(
        f"best: W=1 L=2 lookup K={top['lookup']} min-prob p=0 search S=1 (= W: no wider search), "
        f"{top['estimated_tps']:g} tok/s estimated"
    )


@pytest.mark.parametrize("count", [1, 2, 3, 4, 9, 13, 40])
def test_halving_runs_is_the_number_of_runs_the_search_makes(count):
    """The searching phase's total (its ETA needs one; halving had none and showed no ETA)."""
    rng = np.random.default_rng(count)
    result = search.successive_halving(SHAPES[:count], noisy_measure(0.5, rng), num_prompts=4)
    assert search.halving_runs(count) == len(result.observations)


def test_autotune_says_its_duration_first_and_its_gain_over_plain_decoding_last(
    runtime, monkeypatch, capsys
):
    """The first line says what runs and for about how long; the chip is text, not a dict;
    the result says what the best shape gives over plain decoding, and "plain" means plain
    decoding only."""
    runtime.tokenizer = toy_tokenizer()
    monkeypatch.setattr(rt, "load_runtime", lambda *args, **kwargs: runtime)
    flags = ["--beam-width", "1,2", "--beam-length", "2", "--lookup", "0", "--max-tokens", "8"]
    autotune.main(autotune.setup_arg_parser().parse_args([*flags, "--num-prompts", "2"]))
    captured = capsys.readouterr()
    said_by_loading = ("loading ", "drafter")
    err = [line for line in captured.err.splitlines() if not line.startswith(said_by_loading)]
    assert err[0].startswith("autotune: expected about ")
    assert "2 shapes warmed up, 8 runs of 8 tokens (successive halving)" in err[0]
    (chip,) = [line for line in err if line.startswith("chip: ")]
    assert "{" not in chip and "'" not in chip
    (entry,) = profiles.read_store()["profiles"].values()
    gain = entry["gain_over_plain_decoding"]
    assert gain > 0
    (line,) = [x for x in captured.out.splitlines() if x.startswith("gain over plain decoding")]
    assert line.startswith(f"gain over plain decoding: {gain:.2f}x (measured after the search")
    said = captured.out + captured.err
    assert all(
        "plain decoding" in x or "plain loop" in x for x in said.splitlines() if "plain" in x
    )
    assert "by context length" not in captured.out or "+: plain)" not in captured.out
