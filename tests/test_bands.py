"""A shape per context-length band: the profile format (version 2, version 1 still loads), the
band choice from measured step costs, and the session's per-answer pick."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
from support import make_runtime, toy_tokenizer

from redrafter_mlx.core.decode.accept import greedy
from redrafter_mlx.core.decode.decoder import Decoding
from redrafter_mlx.core.decode.mode import Mode
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.drafters.beam_search import BeamDrafter
from redrafter_mlx.core.serving.session import Session
from redrafter_mlx.tuning import profiles, search
from redrafter_mlx.tuning.profiles import ContextBands
from redrafter_mlx.tuning.search import BandCosts

W1L2, W2L4 = BeamShape(1, 2, lookup=1), BeamShape(2, 4)


def test_bands_pick_by_context_and_round_trip_as_json():
    bands = ContextBands(((0, W2L4), (1024, W1L2), (4096, None)))
    assert [bands.at(n) for n in (0, 1023, 1024, 4095, 4096, 10**6)] == [
        W2L4,
        W2L4,
        W1L2,
        W1L2,
        None,
        None,
    ]
    assert ContextBands.from_json(json.loads(json.dumps(bands.to_json()))) == bands
    for wrong in ((), ((5, W1L2),), ((0, W1L2), (0, None)), ((0, W1L2), (9, None), (3, W2L4))):
        with pytest.raises(ValueError):
            ContextBands(wrong)


def test_version_1_profiles_load_as_one_band_and_version_2_keeps_its_bands(tmp_path):
    path = tmp_path / "profiles.json"
    path.write_text(
        json.dumps({"version": 1, "profiles": {"k": {"shape": [2, 4], "fingerprint": "f"}}})
    )
    assert profiles.find_profile("k", "f", path) == BeamShape(2, 4)
    assert profiles.find_bands("k", "f", path) == ContextBands.single(BeamShape(2, 4))
    bands = ContextBands(((0, W1L2), (4096, None)))
    entry = {"shape": [1, 2, 0.0, 0, 1], "bands": bands.to_json(), "fingerprint": "f"}
    profiles.save_profile("k", entry, path)
    assert json.loads(path.read_text())["version"] == profiles.PROFILE_VERSION == 2
    assert profiles.find_profile("k", "f", path) == W1L2
    assert profiles.find_bands("k", "f", path) == bands
    assert profiles.find_bands("k", "other", path) is None  # stale


def test_bands_keep_the_fastest_shape_per_length_or_plain_decoding():
    """tokens/s = tokens/step over a step's seconds; plain decoding makes 1 / one-token
    seconds. Choices hold from the geometric midpoint between measured lengths; equal
    neighbours merge."""
    per_step = {W1L2: 1.8, W2L4: 2.4}
    costs = [
        BandCosts(512, 0.05, {W1L2: 0.06, W2L4: 0.07}),  # W2L4: 34 tok/s, W1L2 30, plain 20
        BandCosts(2048, 0.06, {W1L2: 0.08, W2L4: 0.14}),  # W1L2: 22.5, W2L4 17, plain 16.7
        BandCosts(8192, 0.09, {W1L2: 0.17, W2L4: 0.30}),  # plain: 11.1 beats 10.6 and 8
        BandCosts(4096, 0.07, {W1L2: 0.11, W2L4: 0.20}),  # W1L2 (unsorted input)
    ]
    assert search.choose_bands(costs, per_step) == ContextBands(
        ((0, W2L4), (1024, W1L2), (5793, None))
    )


@pytest.fixture
def runtime(target, drafter, tmp_path, monkeypatch):
    monkeypatch.setenv("REDRAFTER_CACHE", str(tmp_path / "cache"))
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "model.safetensors").write_bytes(b"weights")
    return make_runtime(
        target,
        toy_tokenizer(),
        {"max_position_embeddings": 600},
        BeamDrafter(drafter, target.model.embed_tokens),
        str(tmp_path / "model"),
        str(tmp_path / "drafter"),
    )


def test_a_session_answers_with_its_bands_decoding_and_an_explicit_choice_ends_them(runtime):
    base = Decoding(Mode.REDRAFTER, W1L2, greedy)
    session = Session(runtime.decoder, runtime.tokenizer, base, warm=False)
    warmed = []
    bands = ContextBands(((0, W1L2), (100, W2L4), (300, None)))
    session.by_context = profiles.decoding_by_context(bands, base, warmed.append)
    picked = [session.decoding_at(n) for n in (10, 150, 400, 120)]
    assert [d.shape for d in picked[:2]] == [W1L2, W2L4]
    assert picked[2].mode is Mode.AUTOREGRESSIVE and picked[0] is base
    assert warmed == [picked[1], picked[2]]  # each new decoding once, when first asked for
    prompt = list(range(5, 40)) * 10  # 350 tokens: plain decoding, one token per step
    responses = list(session.generate(prompt, max_tokens=4))
    assert responses[-1].stats.tree_sizes == [] or set(responses[-1].stats.tree_sizes) == {1}
    session.set_decoding(Decoding(Mode.REDRAFTER, W2L4, greedy))
    assert session.by_context is None and session.decoding_at(400).shape == W2L4


def test_follow_context_installs_a_profiles_bands_only_for_a_profiles_shape(runtime):
    key, fp = profiles.runtime_identity(runtime)
    bands = ContextBands(((0, W1L2), (300, None)))
    entry = {"shape": [1, 2, 0.0, 0, 1], "bands": bands.to_json(), "fingerprint": fp}
    profiles.save_profile(key, entry)
    decoding = Decoding(Mode.REDRAFTER, W1L2, greedy)
    for source, follows in (("autotune profile", True), ("flags", False)):
        session = Session(runtime.decoder, None, decoding, warm=False)
        assert (profiles.follow_context(session, runtime, source) == bands) is follows
        assert (session.by_context is not None) is follows


def test_the_default_shape_decodes_plainly_from_the_plans_plain_from(runtime):
    """No profile: the plan's default shape below ``plain_from``, plain decoding from there;
    a plan without one keeps the shape at every length, and flags are never overridden."""
    decoding = Decoding(Mode.REDRAFTER, W1L2, greedy)
    warmed = []
    decoder = SimpleNamespace(warm_up=warmed.append)
    with_cut = SimpleNamespace(plan=replace(runtime.plan, plain_from=300), decoder=decoder)
    session = Session(runtime.decoder, runtime.tokenizer, decoding, warm=False)
    bands = profiles.follow_context(session, with_cut, "default")
    assert bands == ContextBands(((0, W1L2), (300, None)))
    assert session.decoding_at(299) is decoding
    assert session.decoding_at(300).mode is Mode.AUTOREGRESSIVE
    assert warmed == [session.decoding_at(300)]
    responses = list(session.generate(list(range(5, 40)) * 10, max_tokens=4))  # 350 tokens
    assert set(responses[-1].stats.tree_sizes) <= {1}
    for plan, source in ((replace(runtime.plan, plain_from=None), "default"), (None, "flags")):
        plain = SimpleNamespace(plan=plan or with_cut.plan, decoder=decoder)
        session = Session(runtime.decoder, None, decoding, warm=False)
        assert profiles.follow_context(session, plain, source) is None
        assert session.by_context is None


def test_context_costs_time_each_shape_and_a_token_at_each_length(runtime):
    costs = search.context_costs(runtime, [W1L2, W2L4], [64, 256, 5000], list(range(3, 40)), reps=1)
    assert [c.context for c in costs] == [64, 256, 600 - 4 - 2]  # cut to the model's context
    assert all(c.one_token > 0 and set(c.steps) == {W1L2, W2L4} for c in costs)


def test_generate_answers_past_plain_from_plainly_and_says_so(target, drafter, monkeypatch, capsys):
    """`generate` with the default shape: a prompt shorter than the plan's plain_from
    speculates, a longer one decodes plainly (the same tokens), and its header says why."""
    from redrafter_mlx.backend.plan import build_decoder, plan_for
    from redrafter_mlx.cli import generate
    from redrafter_mlx.io import runtime as rt

    plan = replace(plan_for(), plain_from=100)
    beam = BeamDrafter(drafter, target.model.embed_tokens)
    decoder = build_decoder(target, beam, plan=plan, max_context=600)
    config = {"max_position_embeddings": 600}
    runtime = rt.Runtime(decoder.model, toy_tokenizer(), config, beam, "tiny", None, decoder)
    monkeypatch.setattr(rt, "load_runtime", lambda *a, **k: runtime)
    got = {}
    for length in (50, 150):
        prompt = [5 + i % 30 for i in range(length)]
        monkeypatch.setattr(rt, "encode_chat", lambda runtime, messages, p=prompt: p)
        for extra in (["--json"], []):
            argv = ["--prompt", "hi", "--max-tokens", "6", *extra]
            generate.main(generate.setup_arg_parser().parse_args(argv))
            got[length, bool(extra)] = capsys.readouterr()
    short, long = (json.loads(got[n, True].out) for n in (50, 150))
    assert short["mode"] == "redrafter" and long["mode"] == "autoregressive"
    assert "plain from this context length (trees where they measure faster): default" in (
        got[150, False].err
    )
    assert "plain from" not in got[50, False].err
    assert long["tokens"] == generate_plainly(runtime, [5 + i % 30 for i in range(150)], 6)


def generate_plainly(runtime, prompt: list[int], max_tokens: int) -> list[int]:
    decoding = Decoding(Mode.AUTOREGRESSIVE, W1L2, greedy)
    session = Session(runtime.decoder, runtime.tokenizer, decoding, warm=False)
    return [t for r in session.generate(prompt, max_tokens=max_tokens) for t in r.tokens]
