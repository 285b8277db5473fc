"""End-to-end on the real embedded model, SmolLM2-135M-Instruct (slow; run in CI)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from support import decoder_for, decoding_of

from redrafter_mlx.backend.plan import plan_for
from redrafter_mlx.core.decode.accept import greedy
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.drafters.beam_search import BeamDrafter
from redrafter_mlx.core.drafters.redrafter import load_drafter, random_drafter
from redrafter_mlx.core.serving.session import Session
from redrafter_mlx.io.embedded import default_drafter_path, default_model_path
from redrafter_mlx.io.load import load_target
from redrafter_mlx.io.templates import apply_chat_template

pytestmark = pytest.mark.slow
PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about rain.",
    "Explain what a hash table is.",
]
GREEDY = greedy  # the fast path: argmax of raw logits


@pytest.fixture(scope="module")
def smollm():
    """In float32 on every device: token-for-token equality is what float32 guarantees (in
    float16 on a GPU near-ties of the logits may flip; docs/plans.md, "what is exact where")."""
    model, tokenizer, _ = load_target(str(default_model_path("float32")))
    return model, tokenizer


def chat_ids(tokenizer, text):
    return apply_chat_template(tokenizer, [{"role": "user", "content": text}])


def generate_tokens(model, tokenizer, ids, n, drafter=None, shape=None):
    """On the plan this process runs: the CPU plan, or with ``REDRAFTER_CPU_TUNING=0`` (make
    test's second pass) the generic one Metal and CUDA run."""
    decoding = decoding_of(drafter, shape or BeamShape(1, 2), autoregressive=not drafter)
    decoder = decoder_for(model, drafter, plan_for())
    session = Session(decoder, tokenizer, decoding, warm=False)
    out = []
    for r in session.generate(ids, max_tokens=n):
        out += r.tokens
    return out, r.stats


def test_autoregressive_equals_mlx_lm(smollm):
    model, tokenizer = smollm
    for text in PROMPTS:
        ids = chat_ids(tokenizer, text)
        ours, _ = generate_tokens(model, tokenizer, ids, 32)
        theirs = []
        for token, _ in generate_step(mx.array(ids), model, max_tokens=32, sampler=GREEDY):
            if int(token) in tokenizer.eos_token_ids:
                break
            theirs.append(int(token))
        assert ours == theirs


def _drafters(model):
    random = random_drafter(576, 49152, seed=0, head="target", draft_vocab_size=4096)
    random.bind_target(model)
    found = [("random", random)]
    if default_drafter_path() is not None:
        found.append(("shipped", load_drafter(default_drafter_path(), model)))
    return found


@pytest.fixture(scope="module")
def autoregressive(smollm):
    """Each of ``PROMPTS[1:]``'s chat ids and greedy autoregressive answer (48 tokens), decoded
    once for every shape and drafter compared with it."""
    model, tokenizer = smollm
    ids = [chat_ids(tokenizer, text) for text in PROMPTS[1:]]
    return [(i, generate_tokens(model, tokenizer, i, 48)[0]) for i in ids]


@pytest.mark.parametrize("shape", [BeamShape(1, 5), BeamShape(3, 4)])
def test_redrafter_equals_autoregressive(smollm, autoregressive, shape):
    model, tokenizer = smollm
    for name, drafter in _drafters(model):
        bd = BeamDrafter(drafter, model.model.embed_tokens)
        for ids, expected in autoregressive:
            got, stats = generate_tokens(model, tokenizer, ids, 48, bd, shape)
            assert got == expected, name
            assert stats.syncs_per_step == 1


def test_generate_cli_json_reports_steps_syncs_and_tree_sizes(tmp_path):
    env = dict(os.environ)
    cmd = [
        sys.executable,
        "-m",
        "redrafter_mlx",
        "generate",
        "--json",
        "--max-tokens",
        "24",
        "--prompt",
        "What is the capital of France?",
    ]
    ar = json.loads(
        subprocess.run(
            cmd + ["--autoregressive"], capture_output=True, text=True, env=env, check=True
        ).stdout
    )
    assert "Paris" in ar["text"] and ar["mode"] == "autoregressive"
    for key in (
        "tokens",
        "steps",
        "tokens_per_step",
        "generation_tps",
        "prompt_tps",
        "peak_memory_gb",
    ):
        assert key in ar
    drafter = tmp_path / "drafter"
    from redrafter_mlx.core.drafters.redrafter import save_drafter

    save_drafter(random_drafter(576, 49152, seed=0, head="target", draft_vocab_size=4096), drafter)
    sd = json.loads(
        subprocess.run(
            cmd
            + ["--drafter", str(drafter), "--beam-width", "3", "--beam-length", "4", "--timing"],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        ).stdout
    )
    assert sd["tokens"] == ar["tokens"] and sd["mode"] == "redrafter"
    assert sd["syncs_per_step"] == 1.0
    assert 4 <= sd["mean_tree_size"] <= 12 and (sd["beam_width"], sd["beam_length"]) == (3, 4)
    assert sum(sd["accept_histogram"].values()) == sd["steps"]
    assert set(sd["phase_seconds"]) == {"draft", "pack", "verify", "accept", "compact"}
    plain = [c for c in cmd if c != "--json"] + ["--drafter", str(drafter), "--timing"]
    shown = subprocess.run(plain, capture_output=True, text=True, env=env, check=True)
    assert "[seconds per phase: draft " in shown.stderr  # --timing without --json showed none


def test_eval_drafter_refuses_a_beam_wider_than_the_draft_vocabulary():
    """A one-line error naming the shape, like generate's (it was a traceback)."""
    done = subprocess.run(
        [sys.executable, "-m", "redrafter_mlx", "eval-drafter", "--num-prompts", "1"]
        + ["--beam-width", "2", "--beam-length", "3", "--search-width", "1,9000"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().endswith(
        "W=2 L=3 search 9000: 9000 beams exceed the drafter's vocabulary (8192 tokens)"
    )
