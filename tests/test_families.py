"""Tree verification through mlx-lm's own model classes, family by family
(tests/support/families.py).

The reference is always mlx-lm itself: its forward over each root-to-node path, and
``mlx_lm.generate``'s greedy tokens.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from support import run_steps, shared_data
from support.chat import ask, session
from support.families import (
    FAMILIES,
    PLANS,
    PREFIX,
    PROMPTS,
    QUANTIZED,
    TOKENIZER,
    PartOracle,
    build,
    config,
    exchanges,
    mlx_lm_greedy,
    model_folder,
    ours,
    quantized_folder,
    random_beams,
    run_json,
    train_flags,
)

from redrafter_mlx.backend.plan import make_forward
from redrafter_mlx.cli import main
from redrafter_mlx.core.decode import llm
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.decode.tree import pack_beams, tree_mask
from redrafter_mlx.core.drafters.beam_search import BeamDrafter
from redrafter_mlx.core.drafters.redrafter import random_drafter
from redrafter_mlx.core.serving.session import Session
from redrafter_mlx.io.load import load_target
from redrafter_mlx.io.runtime import decoding, encode_chat, load_runtime


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    return request.param, build(request.param)


@pytest.mark.parametrize("plan", list(PLANS))
def test_tree_verify_equals_mlx_lm_on_each_path(family, plan):
    name, model = family
    rng = np.random.default_rng(len(name))
    cache = llm.new_sequence(model)
    n = len(PREFIX)
    llm.forward(model, mx.array(PREFIX), mx.arange(n), llm.chain_mask(0, n), cache)
    cache.commit(PREFIX)
    forward = make_forward(model, PLANS[plan])
    for _ in range(2):
        beams = random_beams(rng, 4, 5, config(name)["vocab_size"])
        tree = pack_beams(beams)
        hidden = forward(
            mx.array(tree.tokens), mx.array(n + tree.depths), tree_mask(tree, n), cache
        )
        logits = llm.lm_head(model, hidden)
        for w, d in np.ndindex(*beams.shape):
            path = mx.array([PREFIX + beams[w, : d + 1].tolist()])
            node = tree.unpack[w, d]
            want_hidden = model.model(path)[0, -1]
            want_logits = model(path)[0, -1]
            np.testing.assert_allclose(hidden[node], want_hidden, atol=2e-4, rtol=1e-4)
            np.testing.assert_allclose(logits[node], want_logits, atol=2e-4, rtol=1e-4)


def test_accepted_paths_equal_mlx_lm_generate(family):
    name, model = family
    want = mlx_lm_greedy(model, PREFIX, 40)
    for plan in PLANS.values():
        oracle = PartOracle(want, config(name)["vocab_size"], seed=len(name))
        got, steps = [], 0
        for step in run_steps(model, PREFIX, oracle, BeamShape(3, 5), plan=plan):
            got, steps = got + step.tokens, steps + 1
            if len(got) >= 40:
                break
        assert got[:40] == want, name
        assert steps < 30  # drafts were accepted


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_redrafter_equals_mlx_lm_generate(family, seed):
    name, model = family
    hidden, vocab = llm.target_dims(model)
    drafter = BeamDrafter(random_drafter(hidden, vocab, seed=seed), model.model.embed_tokens)
    prompt = PREFIX[seed:]
    want = mlx_lm_greedy(model, prompt, 32)
    for plan in PLANS.values():
        got = []
        for step in run_steps(model, prompt, drafter, BeamShape(4, 4), plan=plan):
            got += step.tokens
            if len(got) >= 32:
                break
        assert got[:32] == want, name


def test_chat_turns_equal_autoregressive(family):
    """A multi-turn chat reuses the cache's prefix across turns (sliding windows included)."""
    name, model = family
    hidden, vocab = llm.target_dims(model)
    drafter = BeamDrafter(random_drafter(hidden, vocab, seed=5), model.model.embed_tokens)
    fast, slow = session(model, drafter, max_tokens=12), session(model, max_tokens=12)
    for question in ("abc", "defgh", "i"):
        assert ask(fast, question) == ask(slow, question), name
    assert fast.messages == slow.messages


# ----------------------------------------------------------------------------------------------
# the trainer and the commands, on a tiny folder of each family


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    """sharegpt-tiny's exchanges, one conversation each (JSONL)."""
    out = tmp_path_factory.mktemp("data") / "exchanges.jsonl"
    return exchanges(shared_data("sharegpt-tiny/sharegpt_tiny.json"), out)


def generated(runtime, prompt: str, shape: BeamShape, *, autoregressive: bool) -> list[int]:
    mode = runtime.mode(shape, autoregressive=autoregressive)
    session = Session(runtime.decoder, runtime.tokenizer, decoding(runtime, shape, mode=mode))
    ids = encode_chat(runtime, [{"role": "user", "content": prompt}])
    return [t for step in session.generate(ids, max_tokens=32) for t in step.tokens]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_drafter_trained_on_sharegpt_tiny_loads_and_decodes_exactly(
    name, conversations, tmp_path
):
    folder = model_folder(name, tmp_path / "model", shared_data(TOKENIZER))
    main(train_flags(folder, conversations, tmp_path))
    log = (tmp_path / "drafter" / "train_log.jsonl").read_text().splitlines()
    log = [json.loads(x) for x in log]
    assert max(entry.get("step", 0) for entry in log) >= 200
    runtime = load_runtime(str(folder), str(tmp_path / "drafter"), need_drafter=True)
    for prompt in PROMPTS:
        want = generated(runtime, prompt, BeamShape(), autoregressive=True)
        assert len(want) == 32
        for shape in (BeamShape(1, 2), BeamShape(4, 4)):
            assert generated(runtime, prompt, shape, autoregressive=False) == want, shape


# ----------------------------------------------------------------------------------------------
# quantized targets


@pytest.mark.parametrize("kind", list(QUANTIZED))
@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3_text"])
def test_quantized_targets_decode_exactly(name, kind, tmp_path):
    model, _, cfg = load_target(quantized_folder(name, kind, tmp_path / "q"), tokenizer=False)
    assert cfg["quantization"]["bits"] == QUANTIZED[kind][1]
    assert llm.compute_dtype(model) == mx.float32  # mxfp4's scales are uint8
    want = mlx_lm_greedy(model, PREFIX, 40)
    hidden, vocab = llm.target_dims(model)
    for plan in PLANS.values():
        assert ours(model, PREFIX, 40, plan=plan) == want
        oracle = PartOracle(want, vocab, seed=3)
        assert ours(model, PREFIX, 40, oracle, BeamShape(3, 5), plan) == want
        drafter = BeamDrafter(random_drafter(hidden, vocab, seed=2), model.model.embed_tokens)
        assert ours(model, PREFIX, 40, drafter, BeamShape(4, 3), plan) == want


# ----------------------------------------------------------------------------------------------
# a user's whole path, from the command line


def test_qwen3_from_hf_folder_to_exact_redrafter_output(conversations, tmp_path, capsys):
    """convert (an HF-style folder) -> train a drafter (tiny budget) -> generate with it, equal
    to --autoregressive; then eval-drafter and bench run on the same pair."""
    hf = model_folder("qwen3", tmp_path / "hf", shared_data(TOKENIZER))
    model = tmp_path / "qwen3-mlx"
    main(["convert", "--src", str(hf), "--out", str(model), "--dtype", "float32"])
    main(train_flags(model, conversations, tmp_path))
    drafter = str(tmp_path / "drafter")
    for prompt in PROMPTS:
        base = ["generate", "--model", str(model), "--prompt", prompt, "--max-tokens", "24"]
        want = run_json(capsys, [*base, "--autoregressive", "--json"])
        shape = ["--beam-width", "4", "--beam-length", "4"]
        got = run_json(capsys, [*base, "--drafter", drafter, *shape, "--json"])
        assert got["mode"] == "redrafter" and want["mode"] == "autoregressive"
        assert got["tokens"] == want["tokens"] and len(want["tokens"]) == 24
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    pair = ["--model", str(model), "--drafter", drafter, "--prompts", str(prompts)]
    report = run_json(capsys, [
        "eval-drafter", *pair, "--max-tokens", "16", "--beam-width", "1,2",
        "--beam-length", "3", "--json",
    ])  # fmt: skip
    assert report
    out = tmp_path / "bench"
    main([
        "bench", *pair, "--num-prompts", "1", "--max-tokens", "12", "--repetitions", "1",
        "--beam-width", "2", "--beam-length", "3", "--timed-prompts", "0",
        "--this-plan-only", "--out", str(out),
    ])  # fmt: skip
    rows = json.loads((out / "bench.json").read_text())["plans"][0]["results"]
    assert {r["kind"] for r in rows} >= {"mlx-lm", "redrafter"}, rows
    assert all(r["exact"] for r in rows), rows
    main([
        "autotune", *pair, "--num-prompts", "1", "--max-tokens", "12", "--beam-width", "1,2",
        "--beam-length", "2,3", "--repetitions", "1", "--no-save",
    ])  # fmt: skip
    assert "best: W=" in capsys.readouterr().out
