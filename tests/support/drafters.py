"""What the tests of the field's drafters (EAGLE-3, DFlash, MTP) share: greedy answers against
the target's own, the marginal test of sampling through drafted steps, a second turn against a fresh
prompt, and `generate` with a drafter folder against the autoregressive answer."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np

from redrafter_mlx.core.decode.accept import make_sampler
from redrafter_mlx.core.decode.shape import BeamShape
from support import decoder_for, decoding_of, run_steps, shared_data
from support.decoding import take
from support.families import model_folder


def greedy_equals_autoregressive(target, drafter, shape: BeamShape, n: int = 40) -> bool:
    """Whether the first ``n`` greedy tokens with ``drafter`` at ``shape`` are the target's
    own (a fixed prompt)."""
    prompt = [5, 17, 33, 2, 41, 8]
    expected = take(run_steps(target, prompt), n)[0]
    return take(run_steps(target, prompt, drafter, shape), n)[0] == expected


def second_token_pvalue(target, drafter, vocab: int, temp: float, runs: int = 300) -> float:
    """The chi-square p-value of the second emitted token (the first a step emits, where
    drafts are accepted or not) against the target's marginal ``sum_t1 p(t1) p(t2 | t1)``,
    over ``runs`` seeded answers with 40 beams of one draft (40 distinct first drafts, so many
    steps accept one); asserts the drafts were accepted often enough to be tested."""
    from scipy.stats import chisquare

    prompt = [5, 17, 33]
    first = np.array(mx.softmax(target(mx.array([prompt]))[0, -1] / temp), np.float64)
    pairs = mx.array([prompt + [t] for t in range(vocab)])
    second = np.array(mx.softmax(target(pairs)[:, -1] / temp, axis=-1), np.float64)
    probs = first @ second
    probs /= probs.sum()
    counts, accepted = np.zeros(vocab), 0
    for seed in range(runs):
        mx.random.seed(seed)
        steps = run_steps(target, prompt, drafter, BeamShape(40, 2), make_sampler(temp))
        next(steps)
        step = next(steps)
        counts[step.tokens[0]] += 1
        accepted += len(step.tokens) > 1
    assert accepted >= runs // 5  # the drafts were tested, not just the target's own draws
    keep = probs * runs >= 5
    assert keep.sum() >= 3  # the test tells tokens apart
    observed = np.append(counts[keep], counts[~keep].sum())
    return chisquare(observed, np.append(probs[keep], probs[~keep].sum()) * runs).pvalue


def second_turn(target, drafter, shape: BeamShape, steps: int, turn_of):
    """A conversation decoded ``steps`` steps, then its next prompt ``turn_of(ids)`` prefilled
    after the reused prefix, and the same prompt prefilled on a fresh sequence ->
    ``(turn, drafter part after reuse, part when fresh, state after reuse, state fresh)``."""
    decoder = decoder_for(target, drafter)
    decoding = decoding_of(drafter, shape)
    sequence = decoder.new_sequence()
    state, _ = decoder.prefill(sequence, [5, 17, 33, 2], decoding)
    for _ in range(steps):
        state, _ = decoder.step(state)
    turn = turn_of(list(sequence.ids))
    reused, _ = sequence.reuse_prefix(turn)
    again, _ = decoder.prefill(sequence, turn[reused:], decoding)
    fresh = decoder.new_sequence()
    once, _ = decoder.prefill(fresh, turn, decoding)
    return turn, drafter.part(sequence), drafter.part(fresh), again, once


def assert_same_arrays(ours, theirs, atol: float = 1e-4) -> None:
    """Two drafter parts hold the same arrays (to float error)."""
    for a, b in zip(ours.arrays(), theirs.arrays(), strict=True):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=atol)


def generate_with_folder(tmp_path, capsys, make_drafter, shapes, kind: str) -> None:
    """`generate --drafter FOLDER` on a qwen3 folder: greedy at ``shapes[0]`` equals
    `--autoregressive`, and at ``shapes[1]`` the log names the drafter's ``kind``.
    ``make_drafter(vocab)`` writes the drafter folder for the model's vocabulary."""
    from redrafter_mlx.cli import main

    model = model_folder("qwen3", tmp_path / "qwen3", shared_data("vicuna-7b-v1.3-tokenizer"))
    folder = make_drafter(json.loads((model / "config.json").read_text())["vocab_size"])
    base = ["generate", "--model", str(model), "--prompt", "Hi there", "--max-tokens", "16"]

    def beams(shape):
        return ["--beam-width", str(shape.width), "--beam-length", str(shape.length)]

    capsys.readouterr()
    main([*base, "--autoregressive", "--json"])
    want = json.loads(capsys.readouterr().out)
    main([*base, "--drafter", str(folder), *beams(shapes[0]), "--json"])
    got = json.loads(capsys.readouterr().out)
    assert got["mode"] == "redrafter" and got["tokens"] == want["tokens"]
    main([*base, "--drafter", str(folder), *beams(shapes[1])])
    assert f"drafter: {folder} (type {kind}; --drafter, given)" in capsys.readouterr().err


def generate_with_config(tmp_path, capsys, cfg: dict, make_drafter, kind: str) -> None:
    """`generate --drafter FOLDER` on a folder of the tiny model of ``cfg`` (the tokenizer's
    vocabulary): greedy equals `--autoregressive` and the log names the drafter's ``kind``.
    ``make_drafter(vocab)`` writes the drafter folder for the model's vocabulary."""
    import shutil

    from redrafter_mlx.cli import main
    from support.families import CHATML, build_config, save

    tokenizer = shared_data("vicuna-7b-v1.3-tokenizer")
    vocab = json.loads((tokenizer / "tokenizer_config.json").read_text()).get("vocab_size", 32000)
    cfg = {**cfg, "vocab_size": vocab, "eos_token_id": 2, "bos_token_id": 1}
    model = save(build_config(cfg), cfg, tmp_path / "model")
    for f in tokenizer.iterdir():
        shutil.copy(f, model / f.name)
    tok_cfg = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "chat_template": CHATML}))
    folder = make_drafter(vocab)
    base = ["generate", "--model", str(model), "--prompt", "Hi there", "--max-tokens", "16"]
    capsys.readouterr()
    main([*base, "--autoregressive", "--json"])
    want = json.loads(capsys.readouterr().out)
    drafted = ["--drafter", str(folder), "--beam-width", "3", "--beam-length", "4"]
    main([*base, *drafted, "--json"])
    assert json.loads(capsys.readouterr().out)["tokens"] == want["tokens"]
    main([*base, *drafted])
    assert f"drafter: {folder} (type {kind}; --drafter, given)" in capsys.readouterr().err
