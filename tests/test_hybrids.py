"""Hybrid models (attention among Gated DeltaNet, short-convolution or Mamba2 layers) and
Mamba2 alone, through mlx-lm's own classes (tests/support/families.py's HYBRIDS): trees
verified with recurrent state along each node's path, exactly.

Each test names its plans (the generic one Metal and CUDA run, and this CPU's), so the file is
not in ``make test``'s second pass (``REDRAFTER_CPU_TUNING=0``), which would run it again as it
is.

The reference is mlx-lm itself: its forward over each root-to-node path, and its own greedy
generation.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, ChunkedKVCache
from support import decoder_for, decoding_of, run_steps
from support.chat import ask, session, toy_template
from support.decoding import assert_drawn_from, first_three_token_probs
from support.families import (
    HYBRIDS,
    PLANS,
    PREFIX,
    PartOracle,
    build,
    config,
    mlx_lm_greedy,
    ours,
    quantized_folder,
    random_beams,
)

from redrafter_mlx.backend.plan import make_forward
from redrafter_mlx.core.decode import llm
from redrafter_mlx.core.decode.accept import make_sampler
from redrafter_mlx.core.decode.cache import common_prefix
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.decode.tree import pack_beams, tree_mask
from redrafter_mlx.core.drafters.beam_search import BeamDrafter
from redrafter_mlx.core.drafters.redrafter import random_drafter
from redrafter_mlx.core.serving.session import Session
from redrafter_mlx.io.load import load_target

TOKENS = 64


@pytest.fixture(scope="module", params=list(HYBRIDS))
def hybrid(request):
    return request.param, build(request.param)


def prefilled(model, prefix):
    cache = llm.new_sequence(model)
    n = len(prefix)
    llm.forward(model, mx.array(prefix), mx.arange(n), llm.CAUSAL, cache)
    cache.commit(prefix)
    return cache


@pytest.mark.parametrize("plan", list(PLANS))
def test_tree_verify_equals_mlx_lm_on_each_path(hybrid, plan):
    """Every node's hidden state and logits equal mlx-lm's forward over its root-to-node path
    (the recurrence runs along the tree, each node from its parent's state)."""
    name, model = hybrid
    rng = np.random.default_rng(len(name))
    cache = prefilled(model, PREFIX)
    forward, n = make_forward(model, PLANS[plan]), len(PREFIX)
    beams = random_beams(rng, 4, 5, config(name)["vocab_size"])
    tree = pack_beams(beams)
    positions = mx.array(n + tree.depths)
    hidden = forward(mx.array(tree.tokens), positions, tree_mask(tree, n), cache, tree=tree)
    logits = llm.lm_head(model, hidden)
    for w, d in np.ndindex(*beams.shape):
        path = mx.array([PREFIX + beams[w, : d + 1].tolist()])
        node = tree.unpack[w, d]
        want_hidden = llm.inner_model(model)(path, cache=model.make_cache())[0, -1]
        want_logits = model(path, cache=model.make_cache())[0, -1]
        np.testing.assert_allclose(hidden[node], want_hidden, atol=2e-4, rtol=1e-4)
        np.testing.assert_allclose(logits[node], want_logits, atol=2e-4, rtol=1e-4)


SHAPES = [(1, 2, 0), (2, 3, 1), (3, 4, 0), (4, 5, 2)]  # (W, L, lookup beams)


class RootedOracle(PartOracle):
    """:class:`PartOracle` whose beams start at the pending token, as a real drafter's do,
    and that finds its place again after a lookup beam was accepted instead of its own."""

    def search(self, context, pending, *, width, length, min_prob=0.0, search_width=0):
        root = int(np.array(pending))  # test only: a host read to find the place
        later = [
            p for p in range(self.start, len(self.continuation)) if self.continuation[p] == root
        ]
        self.start = later[0] if later else self.start
        beams, _, _ = super().search(context, pending, width=width, length=length)
        return beams.at[:, 0].add(root - beams[:, 0]), None, 0


def test_accepted_paths_equal_mlx_lm_generate(hybrid):
    """Drafts that agree for a known count are accepted and their node's state is kept:
    over W 1..4, L 2..5, with and without lookup beams, the tokens are mlx-lm's."""
    name, model = hybrid
    want = mlx_lm_greedy(model, PREFIX, TOKENS)
    for (width, length, lookup), plan in zip(SHAPES, [*PLANS.values()] * 2, strict=True):
        oracle = RootedOracle(want, config(name)["vocab_size"], seed=width)
        got, steps = [], 0
        shape = BeamShape(width, length, lookup=lookup)
        for step in run_steps(model, PREFIX, oracle, shape, plan=plan):
            got, steps = got + step.tokens, steps + 1
            if len(got) >= TOKENS:
                break
        assert got[:TOKENS] == want, (name, width, length, lookup)
        assert steps < TOKENS * 3 // 4  # drafts were accepted


def test_drafter_and_lookup_beams_equal_autoregressive(hybrid):
    """A real (random) drafter's beams, and lookup beams alone, give our autoregressive
    tokens, which are mlx-lm's."""
    name, model = hybrid
    hidden, vocab = llm.target_dims(model)
    drafter = BeamDrafter(random_drafter(hidden, vocab, seed=1), llm.embedding(model))
    prompt = PREFIX * 3  # repeats, so lookup beams find matches
    want = mlx_lm_greedy(model, prompt, TOKENS)
    runs = {
        (plan, "autoregressive"): run_steps(model, prompt, autoregressive=True, plan=PLANS[plan])
        for plan in PLANS
    }
    for plan in PLANS:
        runs[plan, "drafter"] = run_steps(
            model, prompt, drafter, BeamShape(3, 4, lookup=1), plan=PLANS[plan]
        )
        runs[plan, "lookup"] = run_steps(
            model, prompt, None, BeamShape(1, 4, lookup=2), plan=PLANS[plan]
        )
    for how, steps in runs.items():
        got = []
        for step in steps:
            got += step.tokens
            if len(got) >= TOKENS:
                break
        assert got[:TOKENS] == want, (name, how)


@pytest.mark.parametrize("plan", list(PLANS))
def test_chat_turns_reuse_the_state_and_equal_autoregressive(hybrid, plan):
    """A follow-up turn feeds only its new tokens (the state at the end of the last answer
    is the cache's), and the answers equal an autoregressive chat's."""
    name, model = hybrid
    hidden, vocab = llm.target_dims(model)
    drafter = BeamDrafter(random_drafter(hidden, vocab, seed=5), llm.embedding(model))
    fast = session(model, drafter, max_tokens=12, plan=PLANS[plan])
    slow = session(model, max_tokens=12)
    last_prompt = 0
    for question in ("abc", "defgh", "i"):
        before = list(fast.session.sequence.ids)
        assert ask(fast, question) == ask(slow, question), name
        prompt = toy_template(fast.messages[:-1])
        shared = common_prefix(before, prompt)  # the toy tokenizer re-encodes answers anew
        # at worst the previous prompt's end: the state there was kept
        assert last_prompt <= fast.last.reused_tokens <= shared, name
        assert fast.last.reread_tokens == shared - fast.last.reused_tokens, name
        last_prompt = len(prompt)
    assert fast.messages == slow.messages


def test_a_cache_rewinds_only_to_states_it_holds():
    """Recurrent states cannot be cut back anywhere: the cache rewinds to its snapshots (the
    end of each prompt, offset 0) and says so otherwise; reuse picks the latest it holds."""
    model = build("qwen3_5")
    cache = prefilled(model, PREFIX)
    cache.snapshot()
    llm.forward(model, mx.array([7, 8]), mx.arange(7, 9), llm.CAUSAL, cache)
    cache.commit([7, 8])
    with pytest.raises(ValueError, match="cannot rewind to 8 tokens"):
        cache.rewind(8)
    assert cache.reuse_prefix(PREFIX + [7, 8, 9]) == (9, 0)  # the live state: nothing to re-read
    assert cache.reuse_prefix(PREFIX + [7, 5, 5]) == (len(PREFIX), 1)  # back to the snapshot
    after_snapshot = llm.forward(model, mx.array([7]), mx.array([7]), None, cache)
    fresh = prefilled(model, PREFIX)
    want = llm.forward(model, mx.array([7]), mx.array([7]), None, fresh)
    np.testing.assert_allclose(after_snapshot, want, atol=1e-5)


@pytest.mark.distribution
def test_sampling_on_a_hybrid_matches_the_target_distribution():
    """Chi-square: sampled ReDrafter tokens on a Gated DeltaNet hybrid follow the target's
    own distribution (the 1st, 2nd and 3rd token after the prompt)."""
    vocab = 8
    model = build_small_vocab("qwen3_5", vocab)
    hidden, _ = llm.target_dims(model)
    drafter = BeamDrafter(random_drafter(hidden, vocab, seed=7), llm.embedding(model))
    sampler = make_sampler(1.0)
    prompt = [1, 2, 3]
    probs = first_three_token_probs(model, lambda x: x, 1.0, prompt)
    mx.random.seed(11)
    runs, counts = 800, np.zeros((3, vocab))
    for _ in range(runs):
        tokens = []
        for step in run_steps(model, prompt, drafter, BeamShape(3, 3), sampler):
            tokens += step.tokens
            if len(tokens) >= 3:
                break
        counts[np.arange(3), tokens[:3]] += 1
    assert_drawn_from(counts, probs, runs)


def build_small_vocab(family: str, vocab: int):
    from support.families import build_config

    model = build_config({**config(family), "vocab_size": vocab}, seed=6)
    # sharper logits than random weights give, so the test sees a non-uniform distribution
    head = model.language_model.lm_head
    head.weight = head.weight * 6
    mx.eval(model.parameters())
    return model


# ----------------------------------------------------------------------------------------------
# quantized hybrids (mlx-lm's quantization; its predicates keep convolutions unquantized)


@pytest.mark.parametrize("name", ["qwen3_5", "nemotron_h"])
def test_quantized_hybrids_decode_exactly(name, tmp_path):
    model, _, cfg = load_target(quantized_folder(name, "4bit", tmp_path / "q"), tokenizer=False)
    assert cfg["quantization"]["bits"] == 4
    want = mlx_lm_greedy(model, PREFIX, 40)
    hidden, vocab = llm.target_dims(model)
    for plan in PLANS.values():
        assert ours(model, PREFIX, 40, plan=plan) == want
        oracle = RootedOracle(want, vocab, seed=3)
        assert ours(model, PREFIX, 40, oracle, BeamShape(3, 5), plan) == want


def test_the_families_let_through_are_the_tested_ones():
    from redrafter_mlx.io.checks import VERIFIED_RECURRENT

    assert {config(name)["model_type"] for name in HYBRIDS} == VERIFIED_RECURRENT


def test_an_untested_recurrent_family_and_chunked_attention_are_refused_in_one_line(tmp_path):
    """What stays refused says so in one line naming the model type (a RWKV-7 folder, a
    Llama 4 folder with chunked attention)."""
    from redrafter_mlx.core.errors import LoadError
    from redrafter_mlx.io.checks import check_layers

    class Recurrent:  # what load sees of an untested family: its caches
        def make_cache(self):
            return [ArraysCache(2)]

    with pytest.raises(LoadError, match="rwkv7 has recurrent layers .* not tested on"):
        check_layers(Recurrent(), {"model_type": "rwkv7"}, tmp_path)

    class Chunked:
        layers = []

        def make_cache(self):
            return [ChunkedKVCache(8)]

    with pytest.raises(LoadError, match="llama4 layer 0 is ChunkedKVCache, attention over chunks"):
        check_layers(Chunked(), {"model_type": "llama4"}, tmp_path)


def test_a_step_keeps_only_the_accepted_nodes_state(hybrid):
    """Memory stays bounded by the tree: after a step the cache holds one state per layer
    (the accepted node's, committed), no node states, nothing staged."""
    name, model = hybrid
    hidden, vocab = llm.target_dims(model)
    drafter = BeamDrafter(random_drafter(hidden, vocab, seed=2), llm.embedding(model))
    cache = llm.new_sequence(model)
    steps = run_steps(model, PREFIX, drafter, BeamShape(4, 4), cache=cache)
    next(steps), next(steps), next(steps)
    states = cache.states
    assert all(s is None for s in states.nodes + states.staged), name
    assert all(s is not None and s[0].shape[0] == 1 for s in states.committed), name


def test_timing_steps_leaves_a_hybrid_conversation_as_it_was():
    """autotune's step timing rewinds after each step: on a hybrid it comes back to the
    state it started from, and the conversation goes on as without it."""
    from redrafter_mlx.tuning.measure import time_steps

    model = build("nemotron_h")
    hidden, vocab = llm.target_dims(model)
    drafter = BeamDrafter(random_drafter(hidden, vocab, seed=2), llm.embedding(model))
    decoder = decoder_for(model, drafter)
    session = Session(decoder, None, decoding_of(drafter, BeamShape(2, 3)), warm=False)
    next(session.steps(PREFIX))  # the prompt, and the first drafts from it
    ids = list(session.sequence.ids)
    time_steps(session, reps=1)
    assert list(session.sequence.ids) == ids
    want = mlx_lm_greedy(model, PREFIX, 24)
    got = []
    for step in session.steps(PREFIX + want[:4]):
        got += step.tokens
        if len(got) >= 20:
            break
    assert got[:20] == want[4:24]


@pytest.mark.parametrize("lookup", [0, 2])
def test_the_python_api_on_a_plain_mlx_lm_hybrid_equals_mlx_lm(lookup):
    """``redrafter_mlx.stream_generate`` on a hybrid loaded as mlx-lm builds it (no drafter):
    mlx-lm's tokens, text and, in float32, log-probs."""
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler as mlx_lm_sampler
    from support import toy_tokenizer
    from support.families import build_config

    import redrafter_mlx

    model = build_config({**config("qwen3_5"), "vocab_size": 64}, seed=3)
    tokenizer, prompt = toy_tokenizer(), "w5 w17 w33 w2 w41 w5 w17"
    options = {"max_tokens": 20, "sampler": mlx_lm_sampler(0.0)}
    theirs = list(mlx_lm.stream_generate(model, tokenizer, prompt, **options))
    ours = list(
        redrafter_mlx.stream_generate(
            model, tokenizer, prompt, lookup=lookup, logprobs=True, **options
        )
    )
    assert [r.token for r in ours] == [r.token for r in theirs]
    assert "".join(r.text for r in ours) == "".join(r.text for r in theirs)
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
