"""Drafter distillation (`redrafter-mlx train`) on a tiny, learnable random target."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama
from support import shared_data, write_conversations

from redrafter_mlx.backend.plan import build_decoder
from redrafter_mlx.cli import train as T
from redrafter_mlx.core.decode import llm
from redrafter_mlx.core.decode.accept import log_softmax
from redrafter_mlx.core.decode.lookup import NgramIndex
from redrafter_mlx.core.decode.shape import shape_grid
from redrafter_mlx.core.drafters.redrafter import (
    load_drafter,
    random_drafter,
    save_drafter,
    tap_features,
)
from redrafter_mlx.core.errors import TrainError
from redrafter_mlx.training import budget, loop
from redrafter_mlx.training import evaluate as E
from redrafter_mlx.training.cache import Cache
from redrafter_mlx.training.checkpoint import load_checkpoint
from redrafter_mlx.training.data import (
    encode_conversation,
    every_user_turn,
    read_conversations,
    split_conversations,
)
from redrafter_mlx.training.drafter_init import grow_layers
from redrafter_mlx.training.examples import Examples, frequent_tokens
from redrafter_mlx.training.extract import GEN_WINDOW, prepare_cache, teacher_force
from redrafter_mlx.training.loss import loss_fn, unrolled_logits
from redrafter_mlx.training.ranks import ONE
from redrafter_mlx.training.selfdistill import greedy_batch
from redrafter_mlx.training.taps import tapped
from redrafter_mlx.training.trainer import WarmupCosine, build_trainer

VOCAB = 64
TINY_SHAREGPT = "sharegpt-tiny/sharegpt_tiny.json"
LETTERS = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")


class CharTokenizer:
    """Characters -> ids 8..63 with a ChatML-like template (1 = start, 2 = end, 3 = newline)."""

    eos_token_ids = {2}
    chat_template = "ChatML-like, below"

    def encode(self, text: str) -> list[int]:
        return [8 + ord(c) % (VOCAB - 8) for c in text]

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False):
        ids = []
        for m in messages:
            ids += [1, *self.encode(m["role"]), 3, *self.encode(m["content"]), 2, 3]
        if add_generation_prompt:
            ids += [1, *self.encode("assistant"), 3]
        return ids


def learnable_target(seed: int = 0) -> llama.Model:
    """A tiny Llama whose greedy next token is (mostly) a permutation of the current token:
    damped residual branches, and an LM head made of permuted input embeddings."""
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
    )
    model = llama.Model(args)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight = layer.self_attn.o_proj.weight * 0.5
        layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * 0.5
    perm = mx.array(np.random.default_rng(seed).permutation(VOCAB))
    model.lm_head.weight = model.model.embed_tokens.weight[mx.argsort(perm)]
    mx.eval(model.parameters())
    return model


def test_reads_truncated_sharegpt_file(tmp_path):
    record = json.loads(shared_data(TINY_SHAREGPT).read_text())[0]
    text = json.dumps([record, record], indent=2)
    cut = tmp_path / "cut.json"
    cut.write_text(text[: len(text) * 3 // 4])  # second copy cut mid-string
    convs = read_conversations(cut)
    assert len(convs) == 1
    assert [m["role"] for m in convs[0][:2]] == ["user", "assistant"]
    assert convs[0][1]["content"] == record["conversations"][1]["value"]
    jsonl = tmp_path / "chats.jsonl"
    jsonl.write_text(json.dumps(record) + "\n" + json.dumps({"messages": convs[0]}) + "\n")
    assert read_conversations(jsonl) == [convs[0], convs[0]]


def test_a_malformed_jsonl_line_is_named_and_only_a_cut_last_line_is_skipped(tmp_path):
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    chat = json.dumps({"messages": turns})
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join([chat, chat[:-5], chat]) + "\n")
    with pytest.raises(ValueError, match=r"chats.jsonl:2: not valid JSON"):
        read_conversations(path)
    path.write_text("\n".join([chat, chat, chat[:-5]]) + "\n\n")
    assert len(read_conversations(path)) == 2


def test_a_corrupt_object_in_the_middle_of_a_json_array_is_named_by_file_and_place(tmp_path):
    """The reader stopped there as at a cut-off tail: the objects before it were trained on,
    exit 0. A tail cut mid-object is still kept up to its last whole object."""
    turns = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]
    record = json.dumps({"conversations": turns})
    path = tmp_path / "data.json"
    path.write_text("[\n" + ",\n".join([record, record.replace('"value":', '"value"', 1), record]))
    with pytest.raises(ValueError, match=r"data.json:3:\d+: not valid JSON \(Expecting ':'"):
        read_conversations(path)
    path.write_text("[\n" + ",\n".join([record, record, record[:-9]]))
    assert len(read_conversations(path)) == 2


def test_records_that_are_no_usable_conversation_are_counted(tmp_path):
    from redrafter_mlx.training.data import read_corpus

    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    unusable = [turns[:1], "text", [1, 2], [{"role": "robot", "content": "x"}, turns[1]]]
    path = tmp_path / "chats.jsonl"
    lines = [{"messages": turns}, *({"messages": u} for u in unusable), {"messages": turns}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    convs, skipped = read_corpus(path)
    assert (len(convs), skipped) == (2, 4)
    note = T._skipped_note(path, skipped)
    assert "\n" not in note and f"{path}: 4 records were skipped" in note


def test_prepare_cache_returns_the_skipped_count_for_the_command_to_say(tmp_path):
    write_conversations(tmp_path / "data.json", 30)
    text = (tmp_path / "data.json").read_text()
    (tmp_path / "data.json").write_text('[{"conversations": []}, "x",' + text.lstrip()[1:])
    args = T.setup_arg_parser().parse_args(
        ["--max-tokens", "200", "--heldout-tokens", "50", "--heldout", "2", "--quiet"]
    )
    data, folder = tmp_path / "data.json", tmp_path / "cache"
    opts = T.extract_options(args)
    cache = prepare_cache(learnable_target(), CharTokenizer(), "tiny", data, folder, opts)
    assert cache.skipped_records == 2


def parse(*flags: str):
    return T.setup_arg_parser().parse_args(list(flags))


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--data", "nope.jsonl"], "--data nope.jsonl: no such file"),
        (["--batch-size", "0"], "--batch-size must be at least 1"),
        (["--eval-every", "0"], "--eval-every must be at least 1"),
        (["--max-tokens", "-5"], "--max-tokens must be at least 1"),
        (["--epochs", "0"], "--epochs must be a positive number"),
        (["--epochs", "inf"], "--epochs must be a positive number"),
        (["--num-draft-layers", "-1"], "--num-draft-layers must be a finite number >= 0"),
        (["--skip-prompts", "-1"], "--skip-prompts must be a finite number >= 0"),
        (["--exit-dim", "-8"], "--exit-dim must be a finite number >= 0"),
        (["--soft-weight", "nan"], "--soft-weight must be a finite number >= 0"),
        (["--soft-weight", "3"], "--soft-weight must be a share from 0 to 1"),
        (["--hidden-weight", "inf"], "--hidden-weight must be a finite number >= 0"),
        (["--weight-decay", "-0.1"], "--weight-decay must be a finite number >= 0"),
        (["--init", "nowhere"], "not a drafter folder"),
        ([], "--out is required"),
        (["--out", "FILE"], "is a file"),
        (["--source", "self", "--max-seq-len", "128"], "--gen-tokens must be"),
    ],
)
def test_bad_flags_are_refused_before_anything_loads(tmp_path, flags, message):
    (tmp_path / "FILE").write_text("")
    flags = [str(tmp_path / f) if f == "FILE" else f for f in flags]
    with pytest.raises(TrainError, match=message):
        T.check_args(parse(*flags, "--cache-max-gb", "1"))


def test_a_broken_manifest_or_checkpoint_state_is_a_one_line_error(tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "out"
    cache.mkdir()
    (cache / "manifest.json").write_text('{"shards": [')
    with pytest.raises(TrainError, match=r"manifest.json: not valid JSON"):
        T.check_args(parse("--extra-cache", str(cache), "--out", str(out)))
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / "state.json").write_text("[1, 2]")
    with pytest.raises(TrainError, match=r"state.json: not a JSON object"):
        T.check_out(parse("--out", str(out), "--resume"))


def test_train_refuses_to_overwrite_a_model_or_drafter_folder(tmp_path):
    """--out holding a model or a drafter (not a training run) is refused before anything
    runs; an empty folder, or one a killed run left before its first checkpoint, is fine."""
    out = tmp_path / "out"
    out.mkdir()
    T.check_out(parse("--out", str(out)))  # empty
    for name in ("config.json", "model.safetensors"):
        (out / name).write_text("{}")
    with pytest.raises(TrainError, match=r"already holds config.json, model.safetensors"):
        T.check_out(parse("--out", str(out)))
    (out / "train_log.jsonl").write_text("")  # a run killed before its first checkpoint
    T.check_out(parse("--out", str(out)))
    (out / "tokenizer.json").write_text("{}")
    with pytest.raises(TrainError, match=r"training would overwrite it"):
        T.check_out(parse("--out", str(out), "--resume"))


def test_gen_tokens_only_bounds_self_generation(tmp_path):
    T.check_args(parse("--max-seq-len", "128", "--out", str(tmp_path / "o")))  # --source data


def test_mask_covers_exactly_the_assistant_turns():
    tok = CharTokenizer()
    convs = read_conversations(shared_data(TINY_SHAREGPT))
    messages = convs[0][:4]
    ids, mask = encode_conversation(tok, messages)
    assert ids == tok.apply_chat_template(messages)
    masked = [i for i, m in zip(ids, mask, strict=True) if m]
    expected = []
    for m in messages:
        if m["role"] == "assistant":
            expected += [*tok.encode(m["content"]), 2, 3]
    assert masked == expected


def trained_flags(root: Path) -> list[str]:
    """The `train` flags of the ``trained`` fixture's run in ``root``."""
    return [
        "--out",
        str(root / "out"),
        "--cache-dir",
        str(root / "cache"),
        "--heldout",
        "16",
        "--heldout-tokens",
        "2500",
        "--max-tokens",
        "16000",
        "--head",
        "own",
        "--draft-vocab",
        "48",
        "--exit-dim",
        "64",
        "--batch-size",
        "64",
        "--epochs",
        "2",
        "--eval-every",
        "100",
        "--lr",
        "3e-3",
        "--seed",
        "0",
        "--quiet",
    ]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A drafter trained for a few hundred steps (shared by the tests below)."""
    root = tmp_path_factory.mktemp("distil")
    write_conversations(root / "data.json", 140)
    model = learnable_target()
    args = T.setup_arg_parser().parse_args(trained_flags(root))
    data, folder = root / "data.json", root / "cache"
    cache = prepare_cache(model, CharTokenizer(), "tiny", data, folder, T.extract_options(args))
    heldout = Examples.build(cache.load("heldout"), args.positions)
    vocab = frequent_tokens(cache.load("train"), args.draft_vocab)
    opts = T.train_options(args)
    before = build_trainer(model, vocab, opts, total_steps=1).agreement(heldout)
    best = loop.train(model, cache, Path(args.out), opts, run_options=T.run_options(args))
    return model, args, cache, heldout, before, best


def planned_steps(args, cache) -> int:
    """The steps the ``trained`` run planned: its epochs over the cached training positions."""
    examples = Examples.build(cache.load("train", args.max_tokens), args.positions)
    return loop.planned_steps(len(examples.starts), T.train_options(args))


def test_heldout_agreement_rises_well_above_chance(trained):
    _, args, cache, _, before, best = trained
    assert cache.tokens("train") >= 16000 and cache.tokens("heldout") >= 2000
    total = planned_steps(args, cache)
    assert total >= 200
    assert before["mean_agreement"] < 0.2  # untrained: about chance (1/48 .. a few %)
    assert best["mean_agreement"] > 0.8, best
    assert min(best["agreement"]) > 0.6, best
    log = [json.loads(x) for x in (Path(args.out) / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == total and len(log) >= 3


def test_saved_drafter_reproduces_predictions(trained):
    model, args, _, heldout, _, best = trained
    drafter = load_drafter(args.out, model)
    assert drafter.args.head == "own" and drafter.args.draft_vocab_size == 48
    trainer = build_trainer(model, np.array(drafter.draft_vocab), T.train_options(args), 1)
    trainer.drafter = drafter
    again = trainer.agreement(heldout)
    assert again["agreement"] == best["agreement"]
    assert again["leading"] == pytest.approx(best["leading"])


def test_checkpoint_restores_weights_and_loop_state(trained):
    model, args, cache, _, _, _ = trained
    ckpt = Path(args.out) / "checkpoint"
    trainer = build_trainer(model, np.arange(48), T.train_options(args), 1)
    state = load_checkpoint(trainer, ckpt)
    assert state["step"] == state["total_steps"] == planned_steps(args, cache)
    saved = mx.load(str(ckpt / "model.safetensors"))
    for name, value in saved.items():
        got = dict(__import__("mlx.utils").utils.tree_flatten(trainer.drafter.parameters()))[name]
        assert mx.array_equal(got, value)


def test_a_checkpoint_is_continued_only_with_resume_and_its_options(trained, tmp_path):
    _, args, _, _, _, _ = trained
    again = T.setup_arg_parser().parse_args(trained_flags(Path(args.out).parent))  # the command
    assert again.resume is False
    with pytest.raises(TrainError, match="holds a finished run"):  # it ran all its steps
        T.check_out(again)
    # the same run stopped one step short (killed): --resume is the way on
    again.out = str(tmp_path / "cut")
    shutil.copytree(args.out, again.out)
    state_file = Path(again.out) / "checkpoint" / "state.json"
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**state, "step": state["step"] - 1}))
    with pytest.raises(TrainError, match="--resume to continue"):
        T.check_out(again)
    again.max_minutes = state["seconds"] / 60  # ... unless its time was up
    with pytest.raises(TrainError, match="holds a finished run"):
        T.check_out(again)
    again.out, again.max_minutes = args.out, args.max_minutes
    again.resume = True
    T.check_out(again)  # the same options: fine
    again.batch_size = 32
    with pytest.raises(TrainError, match=r"--batch-size 64 \(now 32\)"):
        T.check_out(again)


def test_resume_takes_the_recipe_the_checkpoint_filled_in(trained, tmp_path):
    """`train` fills the recipe's flags left out (from --minutes' row or today's defaults)
    after the target loads, so the checkpoint holds them filled in: the same command with
    --resume continues with them; a recipe flag given otherwise is refused."""
    _, args, _, _, _, _ = trained
    out = tmp_path / "out"
    shutil.copytree(args.out, out)
    state_file = out / "checkpoint" / "state.json"
    state = json.loads(state_file.read_text())
    filled = {"context_layers": [0], "own_drafts": 0.5, "soft_weight": 0.0, "hidden_weight": 0.0}
    state["step"] -= 1
    state["options"] = {**state["options"], **filled, "out": str(out)}
    state_file.write_text(json.dumps(state))
    again = T.setup_arg_parser().parse_args([*trained_flags(Path(args.out).parent), "--resume"])
    again.out = str(out)
    T.check_out(again)
    assert again.context_layers == (0,)
    assert (again.own_drafts, again.soft_weight, again.hidden_weight) == (0.5, 0.0, 0.0)
    given = T.setup_arg_parser().parse_args([*trained_flags(Path(args.out).parent), "--resume"])
    given.out, given.soft_weight = str(out), 1.0
    with pytest.raises(TrainError, match=r"--soft-weight 0.0 \(now 1.0\)"):
        T.check_out(given)


def test_outputs_are_readable_like_any_file(trained):
    """Written aside, then renamed: with the modes a plain open / mkdir gives (not 0600)."""
    _, args, _, _, _, _ = trained
    umask = os.umask(0)
    os.umask(umask)
    out = Path(args.out)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask
    assert (out / "checkpoint").stat().st_mode & 0o777 == 0o777 & ~umask


def test_init_can_grow_layers_but_not_drop_them(trained):
    model, args, _, _, _, _ = trained
    smaller = argparse.Namespace(**vars(args))
    smaller.init, smaller.num_draft_layers = args.out, 1  # the trained drafter has 2
    with pytest.raises(TrainError, match="grow layers, not drop them"):
        T.check_init(smaller)
    smaller.num_draft_layers = 3
    T.check_init(smaller)


def test_a_run_that_would_train_nothing_is_refused(trained, tmp_path):
    model, args, cache, _, _, _ = trained
    huge = dataclasses.replace(T.train_options(args), batch_size=10**7)
    with pytest.raises(TrainError, match="make no step"):
        loop.train(model, cache, tmp_path / "out", huge, run_options={})
    assert not (tmp_path / "out").exists()


def test_eval_drafter_loop_and_simulation_agree(trained):
    model, args, _, _, _, _ = trained
    drafter = load_drafter(args.out, model)
    prompts = ["ab cd", "Xy 12 z", "hello"]
    tok = CharTokenizer()
    grid = shape_grid([1, 2], [3, 5], search_widths=(0, 6))  # plain, and 6 beams searched
    job = E.Evaluation(model, tok, drafter, prompts, grid, max_tokens=24)
    real, sim = E.evaluate(job), E.simulate_grid(job)
    shapes = [(r["width"], r["length"], r["search_width"]) for r in sim]
    assert shapes == [(r["width"], r["length"], r["search_width"]) for r in real]
    assert (1, 3, 6) in shapes and (2, 5, 2) in shapes
    assert [(r["tokens"], r["steps"]) for r in real] == [(r["tokens"], r["steps"]) for r in sim]
    path_row = shapes.index((2, 5, 2))  # the shape whose real loop decoded the greedy paths
    assert (sim[path_row]["real_tokens"], sim[path_row]["real_steps"]) == (
        real[path_row]["tokens"],
        real[path_row]["steps"],
    )
    assert all(r["tokens"] >= 23 for r in real)
    assert min(r["tokens_per_step"] for r in real) > 1.5, real


def test_eval_drafter_lookup_beams_loop_and_simulation_agree(trained):
    """With K lookup beams the replay (an n-gram index walking the path) counts what the real
    loop counts: tokens, steps and where the accepted drafts came from."""
    model, args, _, _, _, _ = trained
    prompts = ["ab ab ab cd", "Xy 12 z Xy 12", "hello"]
    for drafter in (load_drafter(args.out, model), random_drafter(64, VOCAB, seed=1)):
        grid = shape_grid([1, 2], [4], lookups=(0, 3))
        job = E.Evaluation(model, CharTokenizer(), drafter, prompts, grid, max_tokens=48)
        real, sim = E.evaluate(job), E.simulate_grid(job)
        assert [r["lookup"] for r in real] == [r["lookup"] for r in sim] == [0, 3, 0, 3]
        for r, s in zip(real, sim, strict=True):
            assert (r["tokens"], r["steps"]) == (s["tokens"], s["steps"]), (r, s)
            assert r["accepted_from"] == s["accepted_from"], (r, s)
            assert r["tokens"] == r["steps"] + sum(r["accepted_from"].values())
            assert r["output_digest"] == real[0]["output_digest"]  # lookup keeps the output
            if not r["lookup"]:
                assert r["accepted_from"]["lookup"] == r["accepted_from"]["both"] == 0
        with_lookup = [r["accepted_from"] for r in real if r["lookup"]]
        assert all(a["lookup"] + a["both"] > 0 for a in with_lookup), with_lookup
    # an untrained drafter rarely guesses: the lookup beams carry the steps alone
    assert all(a["lookup"] > a["drafter"] for a in with_lookup), with_lookup
    assert real[1]["tokens_per_step"] > real[0]["tokens_per_step"], real


def test_lookup_replay_proposes_from_the_prompt_and_the_path_so_far():
    """At path position j the lookup beams are those of an index of ids[:j] with pending
    ids[j], as a fresh index of that history proposes them."""
    ids = [5, 6, 7, 5, 6, 8, 5, 6, 7, 9, 5, 6]
    n_prompt = 4
    found = E.lookup_everywhere(ids, n_prompt, [(2, 3), (1, 4)])
    assert set(found) == {(2, 3), (1, 4)}
    for (k, n), beams in found.items():
        assert beams.shape == (len(ids) - n_prompt, k, n)
        for r in range(len(ids) - n_prompt):
            want = NgramIndex(ids[: n_prompt + r]).propose(ids[n_prompt + r], k, n)
            assert (beams[r, : len(want)] == want).all()
            assert (beams[r, len(want) :] == E.NO_TOKEN).all()
    assert E.lookup_everywhere(ids, n_prompt, []) == {}


def test_eval_drafter_pools_tokens_per_step_per_category(trained):
    model, args, _, _, _, _ = trained
    drafter = load_drafter(args.out, model)
    prompts, grid = ["ab cd", "Xy 12 z", "hello", "zz"], shape_grid([2], [3], lookups=(0, 2))
    tok = CharTokenizer()
    job = E.Evaluation(model, tok, drafter, prompts, grid, 12, ["x", None, "y", "x"])
    rows = E.simulate_grid(job)
    for k, row in enumerate(rows):
        assert set(row["per_category"]) == {"x", "y"}  # a prompt without one is in no category
        for category, picked in (("x", [0, 3]), ("y", [2])):
            alone = E.Evaluation(model, tok, drafter, [prompts[i] for i in picked], grid, 12)
            assert row["per_category"][category] == E.simulate_grid(alone)[k]["tokens_per_step"]
    plain = E.simulate_grid(dataclasses.replace(job, categories=None))
    assert all(r["per_category"] == {} for r in plain)
    with pytest.raises(ValueError, match="3 categories for 4 prompts"):
        E.Evaluation(model, tok, drafter, prompts, grid, 12, ["x", "y", "x"])


def test_eval_drafter_selection_keeps_each_prompt_with_its_category(tmp_path):
    from redrafter_mlx.cli import eval_drafter as ED
    from redrafter_mlx.cli.flags import read_conversations

    lines = [
        {"category": "a", "turns": ["p0", "second turn"]},
        {"prompt": "p1"},
        {"category": "b", "text": "a long p2"},
        {"category": 7, "prompt": "p3"},  # not a string: no category
        {"category": "c", "prompt": "p4"},
        {"category": "d", "prompt": "p5"},
        {"category": "e", "prompt": "p6"},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text(
        "\n".join(json.dumps(x) + ("\n" if i == 2 else "") for i, x in enumerate(lines))
    )
    conversations = read_conversations(path, None, 1)
    texts = [c.turns[0] for c in conversations]
    categories = [c.category for c in conversations]
    assert categories == ["a", None, "b", None, "c", "d", "e"]
    assert len(texts) == len(categories)

    def short(text):
        return "long" not in text

    assert ED.select_prompts(texts, categories, 2, 3, short) == (
        ["p0", "p4", "p6"],
        ["a", "c", "e"],
    )
    assert ED.select_prompts(texts, categories, 1, 4, short) == (
        ["p0", "p1", "p3", "p4"],
        ["a", None, None, "c"],
    )
    mtb = [c.category for c in read_conversations(None, None, 1)]  # 10 per category, in order
    assert len(mtb) == 80 and mtb[::10] == list(dict.fromkeys(mtb))


def test_eval_drafter_table_labels_lookup_rows_and_lists_categories(trained, capsys):
    from redrafter_mlx.cli import eval_drafter as ED

    model, args, _, _, _, _ = trained
    drafter = load_drafter(args.out, model)
    grid = shape_grid([2], [3, 4], lookups=(0, 4))
    job = E.Evaluation(model, CharTokenizer(), drafter, ["ab ab", "hello"], grid, 8, ["qa", "rag"])
    rows = E.simulate_grid(job)
    ED.print_table({"results": rows, "num_prompts": 2, "max_tokens": 8, "simulated": True})
    out = capsys.readouterr().out
    assert "W=2 lookup 4" in out and "per category" in out
    assert "W=2 L=3 lookup 4" in out and "qa" in out and "rag" in out
    ED.print_table(
        {
            "results": E.simulate_grid(dataclasses.replace(job, categories=None)),
            "num_prompts": 2,
            "max_tokens": 8,
        }
    )
    assert "per category" not in capsys.readouterr().out


def test_paths_cache_is_per_target_and_refuses_a_foreign_file(trained, tmp_path, monkeypatch):
    """The greedy paths cache goes into a new folder, is reused for the same target only, and
    a file that is not one stops with a clear error instead of a traceback."""
    model, args, _, _, _, _ = trained
    drafter = load_drafter(args.out, model)
    decoded, real_path = [], E.greedy_path
    monkeypatch.setattr(E, "greedy_path", lambda *a, **k: decoded.append(1) or real_path(*a, **k))
    cache, grid = tmp_path / "new" / "paths.json", shape_grid([1], [3])
    for target_id, fresh in (("a", 2), ("a", 0), ("b", 2)):
        before = len(decoded)
        job = E.Evaluation(model, CharTokenizer(), drafter, ["ab cd", "hello"], grid, 8)
        E.simulate_grid(job, paths_file=cache, target_id=target_id)
        assert len(decoded) - before == fresh
    cache.write_text('{"prompt": "not a cache"}\n{"x": 1}\n')
    with pytest.raises(E.PathsCacheError, match="not a paths cache"):
        E.load_paths(build_decoder(model), CharTokenizer(), ["ab"], 8, cache)


def test_self_distillation_records_are_the_targets_greedy_path():
    """Batched, left-padded greedy answers carry the same hidden states and next tokens as
    teacher forcing the finished sequence alone, and every answer token is the target's argmax."""
    model = learnable_target(3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(8, VOCAB, n).tolist() for n in (5, 11, 2, 8)]
    records = greedy_batch(model, prompts, 20, eos={2})
    assert len(records) == len(prompts)
    for prompt, rec in zip(prompts, records, strict=True):
        n = len(prompt)
        assert rec["tokens"][:n].tolist() == prompt and not rec["mask"][:n].any()
        assert rec["mask"][n:].all() and 1 <= len(rec["tokens"]) - n <= 19
        alone = teacher_force(model, rec["tokens"].tolist(), topk=0)
        np.testing.assert_allclose(rec["hidden"], alone["hidden"], atol=2e-2)
        assert rec["argmax"][n - 1 :].tolist() == alone["argmax"][n - 1 :].tolist()
        assert rec["tokens"][n:].tolist() == alone["argmax"][n - 1 : -1].tolist()


def test_self_source_fills_and_resumes_the_cache(tmp_path):
    write_conversations(tmp_path / "data.json", 40)
    model = learnable_target()

    def fill(budget):
        args = T.setup_arg_parser().parse_args(
            ["--source", "self", "--gen-tokens", "16", "--gen-batch", "6", "--heldout", "4"]
            + ["--heldout-tokens", "50", "--max-tokens", str(budget), "--quiet"]
        )
        data, folder = tmp_path / "data.json", tmp_path / "c"
        return prepare_cache(model, CharTokenizer(), "tiny", data, folder, T.extract_options(args))

    first = fill(300)
    assert first.manifest["identity"]["source"] == "self"
    window = GEN_WINDOW * 6
    assert first.manifest["next"]["train"] % window == 0 and first.tokens("train") >= 300
    again = fill(1500)
    assert again.tokens("train") >= 1500
    assert again.manifest["next"]["train"] > first.manifest["next"]["train"]
    data = again.load("train")
    assert data["tokens"].shape == data["argmax"].shape == data["doc"].shape
    assert data["hidden"].shape == (data["tokens"].shape[0], 64)
    # one record per prompt, in order: docs never repeat a prompt after the resume
    docs = np.unique(data["doc"])
    prompts = [tuple(data["tokens"][(data["doc"] == d) & ~data["mask"]]) for d in docs]
    assert len(set(prompts)) == len(prompts) == len(docs)


def test_second_writer_is_refused(tmp_path):
    """Two processes extracting into one cache would overwrite each other's shards."""
    import fcntl

    cache = Cache.open(tmp_path / "c", {"model": "x"})
    with open(tmp_path / "c" / "extract.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another writer (flock is per open file)
        with pytest.raises(TrainError, match="another process"), cache.writing():
            pass
    with cache.writing():  # free again
        pass


@pytest.mark.parametrize("head,layers", [("target", 0), ("own", 2)])
def test_grown_drafter_predicts_what_it_grew_from(head, layers):
    model = learnable_target()
    small = random_drafter(64, VOCAB, seed=2, head=head, num_draft_layers=layers)
    small.bind_target(model)
    grown = grow_layers(small, layers + 1, model)
    assert grown.args.num_draft_layers == layers + 1 and len(grown.lm_head) == layers + 2
    context, state = mx.random.normal((5, 64)), mx.random.normal((5, 64))
    assert mx.allclose(grown.logits(context, state), small.logits(context, state), atol=1e-5)


def test_self_prompts_all_answers_every_training_user_turn_once(tmp_path):
    write_conversations(tmp_path / "data.json", 20)
    convs = read_conversations(tmp_path / "data.json")
    heldout, training = split_conversations(convs, 0, 2)
    turns = every_user_turn(training + training, heldout)  # a repeat adds no prompt
    assert [t[0]["content"] for t in turns] == list(
        dict.fromkeys(m["content"] for c in training for m in c if m["role"] == "user")
    )
    shared = training[0][0]["content"]  # a turn a held-out conversation has too is left out
    assert shared not in {t[0]["content"] for t in every_user_turn(training, training[:1])}
    args = T.setup_arg_parser().parse_args(
        ["--source", "self", "--self-prompts", "all", "--gen-tokens", "8", "--gen-batch", "8"]
        + ["--heldout", "2", "--heldout-tokens", "20", "--max-tokens", "100000", "--quiet"]
    )
    data, folder = tmp_path / "data.json", tmp_path / "c"
    opts = T.extract_options(args)
    cache = prepare_cache(learnable_target(), CharTokenizer(), "tiny", data, folder, opts)
    assert cache.manifest["identity"]["self_prompts"] == "all"
    data = cache.load("train")
    tok = CharTokenizer()
    recorded = {
        tuple(data["tokens"][(data["doc"] == d) & ~data["mask"]]) for d in np.unique(data["doc"])
    }
    expected = {tuple(tok.apply_chat_template([t[0]], add_generation_prompt=True)) for t in turns}
    assert recorded == expected  # second turns too, and no held-out conversation's turn
    assert len(expected) > len(training)


def test_schedule_warms_up_decays_and_fits_the_time_limit():
    sched = WarmupCosine(1e-3, 1000)
    lr = {s: sched(mx.array(s)).item() for s in (0, 50, 100, 550, 1000, 5000)}
    assert lr[0] == pytest.approx(1e-5) and lr[100] == pytest.approx(1e-3)
    assert lr[0] < lr[50] < lr[100] > lr[550] > lr[1000]
    assert lr[1000] == pytest.approx(5e-5) and lr[5000] == pytest.approx(5e-5)
    fit = dict(steps=50, max_minutes=1)
    total = loop.fit_to_time(1000, seconds=10.0, step=50, **fit)  # 5 steps/s, 50 s left
    assert total == 50 + int(50 * 5 * loop.TIME_MARGIN) == 287  # 237 more
    sched.total = total
    # faster now: never lengthened
    assert loop.fit_to_time(total, seconds=1.0, step=50, before=9.0, **fit) == 287
    assert sched(mx.array(287)).item() == pytest.approx(5e-5)
    # resumed after 40 s of the minute: 5 steps/s in this process, 10 s left -> 47 more steps
    total = loop.fit_to_time(1000, seconds=10.0, step=100, before=40.0, **fit)
    assert total == 100 + int(10 * 5 * loop.TIME_MARGIN)


def test_a_held_out_split_without_tokens_stops_before_the_training_split(tmp_path):
    """Prompts too long for --max-seq-len leave the held-out split empty: that is said right
    after its (short) extraction, not after generating the whole training split."""
    write_conversations(tmp_path / "data.json", 40)
    args = T.setup_arg_parser().parse_args(
        ["--source", "self", "--gen-tokens", "16", "--max-seq-len", "20", "--heldout", "4"]
        + ["--heldout-tokens", "50", "--max-tokens", "300", "--quiet"]
    )
    with pytest.raises(TrainError, match="held-out conversations gave no tokens"):
        data, cache = tmp_path / "data.json", tmp_path / "c"
        opts = T.extract_options(args)
        prepare_cache(learnable_target(), CharTokenizer(), "tiny", data, cache, opts)
    assert not list((tmp_path / "c").glob("train-*.npz"))  # no training split generated


def test_skip_prompts_leaves_out_the_first_training_prompts_only(tmp_path):
    """--skip-prompts N: a run on another machine answered prompts 0..N-1; this cache starts at
    N (new data for a drafter trained on those), with the same held-out split."""
    write_conversations(tmp_path / "data.json", 20)
    tok = CharTokenizer()

    def recorded(skip: int) -> dict[str, set]:
        args = T.setup_arg_parser().parse_args(
            ["--source", "self", "--self-prompts", "all", "--gen-tokens", "8", "--gen-batch", "4"]
            + ["--heldout", "2", "--heldout-tokens", "20", "--max-tokens", "100000", "--quiet"]
            + ["--skip-prompts", str(skip)]
        )
        data, folder = tmp_path / "data.json", tmp_path / f"c{skip}"
        opts = T.extract_options(args)
        cache = prepare_cache(learnable_target(), tok, "tiny", data, folder, opts)
        out = {}
        for split in ("heldout", "train"):
            data = cache.load(split)
            out[split] = {
                tuple(data["tokens"][(data["doc"] == d) & ~data["mask"]])
                for d in np.unique(data["doc"])
            }
        return out

    convs = read_conversations(tmp_path / "data.json")
    heldout, training = split_conversations(convs, 0, 2)
    turns = [
        tuple(tok.apply_chat_template([t[0]], add_generation_prompt=True))
        for t in every_user_turn(training, heldout)
    ]
    every, skipped = recorded(0), recorded(10)
    assert every["train"] == set(turns) and skipped["train"] == set(turns[10:])
    assert skipped["heldout"] == every["heldout"]


class VocabCharTokenizer(CharTokenizer):
    """CharTokenizer with the token table discovery fingerprints."""

    def get_vocab(self) -> dict[str, int]:
        return {f"c{i}": i for i in range(VOCAB)}


def test_train_ends_by_measuring_recording_and_writing_the_card(trained, tmp_path, monkeypatch):
    """After training: tokens/step with the command the card quotes, the card, and a record
    with which commands find the drafter for this model without --drafter."""
    from redrafter_mlx.io import drafters
    from redrafter_mlx.training.finish import TrainedTarget, finish

    model, args, cache, _, _, best = trained
    assert best["stopped"] == f"finished the planned {planned_steps(args, cache)} steps"
    monkeypatch.setenv("REDRAFTER_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "drafter"
    shutil.copytree(args.out, out)
    config = {"model_type": "llama", "hidden_size": 64, "vocab_size": VOCAB}
    target = TrainedTarget(model, VocabCharTokenizer(), config, "tiny")
    facts = finish(target, out, best, data="tiny chats", license_="mit", prompts=2)
    assert facts["tokens_per_step"] > 1.2  # a drafter at > 0.8 agreement is accepted
    assert facts["measured_with"].startswith(
        f"redrafter-mlx eval-drafter --model tiny --drafter {out}"
    )
    card = (out / "README.md").read_text()
    assert f"{facts['tokens_per_step']:.2f} tokens/step, measured with" in card
    assert "**Data**: tiny chats" in card and "license: mit" in card
    found = drafters.find_drafter(
        None,
        model="tiny",
        target=model,
        config=config,
        tokenizer=VocabCharTokenizer(),
    )
    assert found.path == out.resolve() and found.reason.startswith("trained here")


def test_an_early_stop_says_why_and_the_eta_is_the_mean_pace():
    from redrafter_mlx.training import progress

    opts = dataclasses.replace(T.train_options(T.setup_arg_parser().parse_args([])), patience=3)
    state = {"bad": 3, "best_eval": {"step": 400}}
    assert "did not improve in 3 evaluations (--patience)" in loop._stop_reason(state, opts, False)
    assert "step 400" in loop._stop_reason(state, opts, False)
    timed = dataclasses.replace(opts, max_minutes=2.5)
    assert loop._stop_reason({"bad": 0}, timed, True).startswith("--max-minutes 2.5 reached")
    assert loop._stop_reason({"bad": 0}, opts, False) is None
    assert progress.eta(60.0, 10, 15) == "ETA 1:30"  # 6 s each so far, 15 to go


def test_progress_into_a_file_is_a_plain_line_every_few_seconds(tmp_path, monkeypatch, capsys):
    """Output to a file (capsys: stderr is no terminal) gets plain lines from extraction and
    training, every PLAIN_EVERY seconds (here: every step), and stdout none of the bars."""
    from redrafter_mlx.training import progress

    monkeypatch.setattr(progress, "PLAIN_EVERY", 0.0)
    write_conversations(tmp_path / "data.json", 30)
    flags = [*trained_flags(tmp_path), "--max-tokens", "1500", "--heldout", "4"]
    flags = [f for f in flags if f != "--quiet"] + ["--heldout-tokens", "300", "--epochs", "1"]
    args = T.setup_arg_parser().parse_args(flags)
    model, data = learnable_target(), tmp_path / "data.json"
    cache = prepare_cache(
        model, CharTokenizer(), "tiny", data, tmp_path / "c", T.extract_options(args)
    )
    opts = dataclasses.replace(T.train_options(args), batch_size=16, eval_every=10)
    loop.train(model, cache, Path(args.out), opts, run_options=T.run_options(args))
    out, err = capsys.readouterr()
    assert out == ""
    assert "extract train: " in err and " tokens, " in err and " tok/s, ETA " in err
    assert "train step 1/" in err and "train step 2/" in err and ", ETA " in err


def test_minutes_give_extraction_a_deadline_and_training_the_rest(tmp_path):
    """--minutes N: extraction stops at 40% of N (here: at once, past its deadline, after the
    first conversation), training gets what is left less the final evaluation's share."""
    import time

    write_conversations(tmp_path / "data.json", 60)
    flags = [*trained_flags(tmp_path), "--minutes", "10"]
    args = T.setup_arg_parser().parse_args(flags)
    started = time.time() - 60  # a minute ago
    assert T.extract_deadline(args, started) == pytest.approx(started + 240)
    assert T.training_minutes(args, started) == pytest.approx(10 - 1 - 0.5, abs=0.01)
    past = T.extract_options(args, stop_at=time.time() - 1)
    cache = prepare_cache(
        learnable_target(), CharTokenizer(), "tiny", tmp_path / "data.json", tmp_path / "c", past
    )
    assert 0 < cache.tokens("train") < 1000 < args.max_tokens  # one conversation, not 16,000
    with pytest.raises(TrainError, match="leave out --max-minutes"):
        T.check_minutes(T.setup_arg_parser().parse_args([*flags, "--max-minutes", "5"]), ONE)
    assert T.training_minutes(T.setup_arg_parser().parse_args([]), started) == 0.0


def test_minutes_without_epochs_lets_the_time_decide_how_many_passes():
    """With --minutes a small extraction (its share of the time ran out) used to train its
    default two passes and end minutes early; now the schedule fitted to the time decides,
    unless --epochs was given."""
    import argparse

    assert T.epochs(argparse.Namespace(epochs=None, minutes=15)) == T.MINUTES_EPOCHS
    assert T.epochs(argparse.Namespace(epochs=None, minutes=0)) == T.DEFAULT_EPOCHS == 2.0
    assert T.epochs(argparse.Namespace(epochs=3.0, minutes=15)) == 3.0
    assert T.setup_arg_parser().parse_args([]).epochs is None


@pytest.mark.parametrize(
    "value,message",
    [
        ("0", "must be a positive number of minutes, got 0 (leave the flag out for no limit)"),
        ("-1", "must be a positive number of minutes"),
        ("nan", "must be a positive number of minutes"),
        ("inf", "must be a positive number of minutes"),
        ("1e308", "at most 527,040 minutes (a year), got 1e308"),
    ],
)
@pytest.mark.parametrize("flag", ["--minutes", "--max-minutes"])
def test_time_budgets_are_positive_finite_and_bounded(flag, value, message, capsys):
    """--minutes 0 used to mean no limit, silently; 1e308 ended in an OverflowError traceback
    (its deadline is past what time.localtime shows)."""
    with pytest.raises(SystemExit) as ended:
        parse(flag, value)
    assert ended.value.code == 2
    assert f"argument {flag}: {message}" in capsys.readouterr().err
    assert parse(flag, "0.5").__dict__[flag[2:].replace("-", "_")] == 0.5


def eta_seconds(line: str) -> int:
    minutes, seconds = line.rsplit("ETA ", 1)[1].split(":")
    return int(minutes) * 60 + int(seconds[:2])


def test_progress_and_etas_fit_the_time_budget_from_the_first_line(tmp_path, monkeypatch, capsys):
    """Under a time budget every progress line's total and ETA is what the budget leaves time
    for, from the first line on: the training plan of 100 passes (--minutes' default) used to
    show its full step count and an ETA past the budget until the schedule's first fit."""
    from redrafter_mlx.training import progress

    monkeypatch.setattr(progress, "PLAIN_EVERY", 0.0)
    write_conversations(tmp_path / "data.json", 30)
    flags = [*trained_flags(tmp_path), "--max-tokens", "1500", "--heldout", "4"]
    flags = [f for f in flags if f != "--quiet"] + ["--heldout-tokens", "300"]
    args = T.setup_arg_parser().parse_args(flags)
    model = learnable_target()
    cache = prepare_cache(
        model, CharTokenizer(), "tiny", tmp_path / "data.json", tmp_path / "c",
        T.extract_options(args),
    )  # fmt: skip
    opts = T.train_options(args)
    opts = dataclasses.replace(opts, batch_size=16, eval_every=10**6, epochs=100, max_minutes=0.05)
    plan = planned_steps(args, cache) * 50  # 100 passes, not 2
    capsys.readouterr()
    loop.train(model, cache, Path(args.out), opts, run_options=T.run_options(args))
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("train step ")]
    assert len(lines) > 3
    for line in lines:
        total = int(line.split("/", 1)[1].split(" ", 1)[0])
        assert total < plan and eta_seconds(line) <= 3, line  # 0.05 min = 3 s


def test_progress_fitted_to_a_budget():
    """What a budget leaves time for: 286 tokens in 10 s, 170 s left of the budget."""
    from redrafter_mlx.training import progress

    assert progress.fitted(600_000, have=286, done=286, seconds=10.0, time_left=170.0) == (
        286 + int(28.6 * 170),
        "ETA 2:50",
    )
    assert progress.fitted(1000, have=500, done=500, seconds=10.0, time_left=170.0) == (
        1000,
        "ETA 0:10",
    )  # ends before the budget
    assert progress.fitted(1000, have=0, done=0, seconds=0.0, time_left=60.0) == (1000, "ETA 1:00")
    assert progress.fitted(1000, have=500, done=500, seconds=10.0, time_left=None) == (
        1000,
        "ETA 0:10",
    )


@pytest.fixture
def sigterm_restored():
    import signal

    previous = signal.getsignal(signal.SIGTERM)

    def not_handled(signum, frame):
        raise AssertionError("train left SIGTERM to its default: the process would die silently")

    signal.signal(signal.SIGTERM, not_handled)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_sigterm_ends_train_as_ctrl_c_does_with_how_to_resume(
    tmp_path, monkeypatch, capsys, sigterm_restored
):
    """SIGTERM during training: one line saying how to go on, exit 143 (it used to end with
    -15 and no word)."""
    import signal
    import time

    from redrafter_mlx.training.finish import TrainedTarget

    class Cached:
        skipped_records = 0

    def killed(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
        raise AssertionError("no SIGTERM")

    target = TrainedTarget(learnable_target(), CharTokenizer(), {}, "tiny")
    monkeypatch.setattr(T, "_load", lambda model: target)
    monkeypatch.setattr(T, "prepare_cache", lambda *args, **kwargs: Cached())
    monkeypatch.setattr(T, "train", killed)
    (tmp_path / "data.json").write_text("[]")
    args = parse(*trained_flags(tmp_path), "--data", str(tmp_path / "data.json"))
    with pytest.raises(SystemExit) as ended:
        T.main(args)
    assert ended.value.code == 143
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"terminated (SIGTERM): rerun the same command with --resume to go on from {args.out}"
        "/checkpoint"
    )


def test_a_drafter_is_registered_only_after_its_card(tmp_path, monkeypatch):
    """Stopped during the final evaluation (Ctrl-C, SIGTERM), a drafter is neither carded nor
    registered: discovery never finds a drafter without its card (it used to be registered
    first)."""
    from redrafter_mlx.io import drafters
    from redrafter_mlx.training import finish as F

    monkeypatch.setenv("REDRAFTER_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "drafter"
    save_drafter(random_drafter(64, VOCAB, seed=1), out)
    config = {"model_type": "llama", "hidden_size": 64, "vocab_size": VOCAB}
    target = F.TrainedTarget(learnable_target(), VocabCharTokenizer(), config, "tiny")

    def stopped(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(F, "tokens_per_step", stopped)
    with pytest.raises(KeyboardInterrupt):
        F.finish(target, out, {"agreement": [0.5]}, data="d", license_=None, prompts=1)
    assert drafters.read_registry() == [] and not (out / "README.md").exists()
    monkeypatch.setattr(F, "tokens_per_step", lambda *args: 1.5)
    F.finish(target, out, {"agreement": [0.5]}, data="d", license_=None, prompts=1)
    assert [e["path"] for e in drafters.read_registry()] == [str(out.resolve())]
    assert "1.50 tokens/step" in (out / "README.md").read_text()


# -- layered drafters and training on the drafter's own drafts (issue 44)


def layered_flags(root: Path, *more: str) -> argparse.Namespace:
    return T.setup_arg_parser().parse_args(
        [*trained_flags(root), "--max-tokens", "3000", "--heldout-tokens", "600"]
        + ["--context-layers", "0,1", *more]
    )


def test_layered_records_keep_the_tapped_layers_features_from_the_same_forward():
    """Teacher forcing and self-generation record the tapped layers' normalised outputs
    (``taps (N, n H)``) beside the final hidden state, equal between the two paths."""

    model = learnable_target(3)
    ids = [1, 9, 20, 33, 3, 40, 12]
    rec = teacher_force(model, ids, topk=0, layers=(0, 1))
    with tapped(model, (0, 1)) as got:
        llm.inner_model(model)(mx.array(ids)[None])
    want = tap_features([got[0][0][0], got[1][0][0]])
    assert rec["taps"].shape == (7, 128) and rec["taps"].dtype == np.float16
    np.testing.assert_allclose(rec["taps"], np.array(want), atol=2e-3)
    assert not isinstance(llm.inner_model(model).layers[0], llm.Tap)  # restored after
    (answer,) = greedy_batch(model, [ids], 12, eos={2}, layers=(0, 1))
    alone = teacher_force(model, answer["tokens"].tolist(), topk=0, layers=(0, 1))
    np.testing.assert_allclose(answer["taps"], alone["taps"], atol=2e-2)


def test_an_old_cache_is_refused_for_a_layered_drafter_and_a_newer_format_always(tmp_path):
    """A cache written before records kept taps (no ``format`` in its manifest) still serves
    a last-layer drafter, and is refused in one line for a layered one, never misread; a
    format newer than this code's is refused."""
    write_conversations(tmp_path / "data.json", 30)
    model, data, folder = learnable_target(), tmp_path / "data.json", tmp_path / "cache"
    plain = T.setup_arg_parser().parse_args(trained_flags(tmp_path) + ["--max-tokens", "500"])
    cache = prepare_cache(model, CharTokenizer(), "tiny", data, folder, T.extract_options(plain))
    assert cache.manifest["format"] == 2 and "taps" not in cache.load("train")
    manifest = json.loads((folder / "manifest.json").read_text())
    del manifest["format"]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    prepare_cache(model, CharTokenizer(), "tiny", data, folder, T.extract_options(plain))
    layered = T.extract_options(layered_flags(tmp_path))
    with pytest.raises(TrainError, match=r"cache format 1 \(written before records kept tapped"):
        prepare_cache(model, CharTokenizer(), "tiny", data, folder, layered)
    (folder / "manifest.json").write_text(json.dumps({**manifest, "format": 3}))
    with pytest.raises(TrainError, match="cache format 3, newer than this version reads"):
        prepare_cache(model, CharTokenizer(), "tiny", data, folder, T.extract_options(plain))


def test_training_on_own_drafts_feeds_the_drafters_argmax_and_learns(tmp_path):
    """--own-drafts: chosen rows get the drafter's own greedy drafts as inputs after the first
    position (the labels stay the target's); a layered drafter trained so (single process,
    through the loop) rises well above chance on held-out agreement, and eval-drafter's replay
    counts what its real decode loop counts."""
    write_conversations(tmp_path / "data.json", 60)
    model = learnable_target()
    args = layered_flags(tmp_path, "--own-drafts", "1")
    cache = prepare_cache(
        model, CharTokenizer(), "tiny", tmp_path / "data.json", tmp_path / "cache",
        T.extract_options(args),
    )  # fmt: skip
    opts = T.train_options(args)
    examples = Examples.build(cache.load("train"), opts.positions)
    trainer = build_trainer(model, frequent_tokens(cache.load("train"), 48), opts, 10)
    rows = examples.starts[:32]
    context, _, labels, *_ = trainer.tensors(examples, rows)
    mixed = trainer.own_inputs(rows, context, examples.batch(rows)["inputs"])
    teacher = examples.batch(rows)["inputs"]

    embeds = llm.embedding(model)(mx.array(teacher)).astype(mx.float32)
    drafts = np.array(trainer.drafter.draft_ids(mx.argmax(unrolled_logits(
        trainer.drafter, context, embeds), axis=-1)))  # fmt: skip
    assert (mixed[:, 0] == teacher[:, 0]).all() and (mixed[:, 1:] == drafts[:, :-1]).all()
    assert np.array_equal(labels, trainer.tensors(examples, rows, own=True)[2])
    heldout = Examples.build(cache.load("heldout"), opts.positions)
    before = trainer.agreement(heldout)["mean_agreement"]
    best = loop.train(model, cache, Path(args.out), opts, run_options=T.run_options(args))
    assert best["mean_agreement"] > max(0.25, before + 0.2), (before, best)  # chance: 1/48
    drafter = load_drafter(Path(args.out), model)
    assert drafter.taps == (0, 1)
    # eval-drafter's replay fuses the same taps as the real loop: the same counts
    job = E.Evaluation(
        model, CharTokenizer(), drafter, ["ab cd", "Xy 12 z"], shape_grid([2], [4]), 20
    )
    real, sim = E.evaluate(job), E.simulate_grid(job)
    assert [(r["tokens"], r["steps"]) for r in real] == [(r["tokens"], r["steps"]) for r in sim]
    assert real[0]["tokens_per_step"] > 1.2, real


def test_minutes_take_the_measured_recipe_of_their_budget_and_say_what_it_reached(
    monkeypatch, capsys
):
    """--minutes N takes the row of the longest measured budget not above N (the shortest
    below all), fills the flags the user left out with its recipe, and says its figure."""
    rows = (
        budget.Budget(15, False, 0.0, 1.2, "run A"),
        budget.Budget(30, True, 0.25, 1.4, "run B", soft_weight=1.0, hidden_weight=0.5),
    )
    monkeypatch.setattr(budget, "TABLE", rows)
    assert budget.budget_for(10) is rows[0] and budget.budget_for(29.9) is rows[0]
    assert budget.budget_for(30) is rows[1] and budget.budget_for(600) is rows[1]
    assert budget.budget_for(30, ()) is None
    assert budget.fused_layers(30) == (2, 15, 27) and budget.fused_layers(2) == (1,)
    args = parse("--minutes", "45")
    assert T.with_budget_recipe(args, 30, 64) is rows[1]
    assert (args.context_layers, args.own_drafts) == ((2, 15, 27), 0.25)
    assert (args.soft_weight, args.hidden_weight) == (1.0, 0.5)
    assert T.train_options(args).soft_weight == 1.0
    T.with_budget_share(args)
    assert T.follows(args, rows[1], 30, 64)  # the row's figure is said only for the row's recipe
    T.say_expected(rows[1])
    said = capsys.readouterr().err
    assert "expected: about 1.40 tokens/step (a 30-minute run" in said
    assert "soft targets 1, hidden-state regression 0.5, extraction 40% of the minutes" in said
    given = parse("--minutes", "45", "--context-layers", "3", "--own-drafts", "0")
    T.with_budget_recipe(given, 30, 64)
    T.with_budget_share(given)
    assert (given.context_layers, given.own_drafts) == ((3,), 0.0)  # what the user gave wins
    assert not T.follows(given, rows[1], 30, 64)
    plain = parse()
    assert T.with_budget_recipe(plain, 30, 64) is None
    assert (plain.context_layers, plain.own_drafts) == ((), 0.0)  # today's recipe
    assert (plain.soft_weight, plain.hidden_weight, plain.exit_dim) == (0.0, 0.0, 0)
    narrow = (dataclasses.replace(rows[1], width=1.5),)
    monkeypatch.setattr(budget, "TABLE", narrow)
    sized = parse("--minutes", "45")
    T.with_budget_recipe(sized, 30, 64)
    assert T.train_options(sized).exit_dim == 96  # 1.5 x the target's 64
    mine = parse("--minutes", "45", "--exit-dim", "0")
    T.with_budget_recipe(mine, 30, 64)
    assert T.train_options(mine).exit_dim == 0  # 2H, as the user asked


def test_minutes_give_extraction_the_share_their_measured_row_chose(monkeypatch):
    """--minutes N: extraction's share of N is the budget row's (--extract-share wins), the
    default share without a row; a share outside (0, 1) or without --minutes is refused."""
    import time

    rows = (budget.Budget(15, False, 0.0, 1.2, "run A", extract_share=0.6),)
    monkeypatch.setattr(budget, "TABLE", rows)
    started = time.time()
    args = parse("--minutes", "20")
    T.with_budget_share(args)
    assert args.extract_share == 0.6
    assert T.extract_deadline(args, started) == pytest.approx(started + 20 * 60 * 0.6)
    given = parse("--minutes", "20", "--extract-share", "0.3")
    T.with_budget_share(given)
    assert T.extract_deadline(given, started) == pytest.approx(started + 20 * 60 * 0.3)
    monkeypatch.setattr(budget, "TABLE", ())
    unmeasured = parse("--minutes", "20")
    T.with_budget_share(unmeasured)
    assert unmeasured.extract_share == budget.EXTRACT_SHARE
    for bad in ("0", "1", "nan", "-0.2"):
        with pytest.raises(TrainError, match="--extract-share must be a share"):
            T.check_args(parse("--minutes", "20", "--extract-share", bad))
    with pytest.raises(TrainError, match="give --minutes too"):
        T.check_args(parse("--extract-share", "0.5"))


def test_soft_targets_and_the_hidden_regression_enter_the_loss_and_train_a_drafter(tmp_path):
    """``--soft-weight 1`` trains on the target's distribution alone (the argmax labels no
    longer count), ``--hidden-weight`` adds the regression onto the target's next hidden state;
    together (what ``--minutes`` takes) they train a target-head drafter well above chance."""
    write_conversations(tmp_path / "data.json", 60)
    model = learnable_target()
    more = ["--max-tokens", "3000", "--heldout-tokens", "600", "--head", "target"]
    args = parse(*trained_flags(tmp_path), *more, "--soft-weight", "1", "--hidden-weight", "1")
    T.with_budget_recipe(args, 2, 64)
    cache = prepare_cache(
        model, CharTokenizer(), "tiny", tmp_path / "data.json", tmp_path / "cache",
        T.extract_options(args),
    )  # fmt: skip
    opts = T.train_options(args)
    trainer = build_trainer(model, frequent_tokens(cache.load("train"), 48), opts, 10)
    drafter = trainer.drafter
    context = mx.random.normal((4, drafter.args.hidden_size))
    embeds = mx.random.normal((4, 3, drafter.args.hidden_size))
    labels, weights = mx.zeros((4, 3), mx.int32), mx.ones((4, 3))
    soft = log_softmax(mx.random.normal((4, 3, 48)))
    next_hidden = mx.random.normal((4, 3, drafter.args.hidden_size))

    def loss(labels, soft_weight, hidden_weight):
        return loss_fn(
            drafter, context, embeds, labels, weights, soft, next_hidden, soft_weight,
            hidden_weight,
        ).item()  # fmt: skip

    other_labels = labels + 5
    assert loss(labels, 1.0, 0.0) == pytest.approx(loss(other_labels, 1.0, 0.0))
    assert loss(labels, 0.0, 0.0) != pytest.approx(loss(other_labels, 0.0, 0.0))
    assert loss(labels, 1.0, 1.0) > loss(labels, 1.0, 0.0)
    heldout = Examples.build(cache.load("heldout"), opts.positions)
    before = trainer.agreement(heldout)["mean_agreement"]
    best = loop.train(model, cache, Path(args.out), opts, run_options=T.run_options(args))
    assert best["mean_agreement"] > max(0.25, before + 0.05), (before, best)  # chance: 1/48


def disk_full_run(tmp_path, monkeypatch, capsys):
    """`train` on the tiny target with small flags: (exit status, error lines, args)."""
    from redrafter_mlx.training.finish import TrainedTarget

    target = TrainedTarget(learnable_target(), CharTokenizer(), {}, "tiny")
    monkeypatch.setattr(T, "_load", lambda model: target)
    write_conversations(tmp_path / "data.json", 30)
    flags = [*trained_flags(tmp_path), "--data", str(tmp_path / "data.json")]
    args = parse(*flags, "--max-tokens", "1500", "--heldout-tokens", "300", "--eval-every", "5")
    with pytest.raises(SystemExit) as ended:
        T.main(args)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return ended.value.code, [x for x in err.splitlines() if x.startswith("error: ")], args


def test_a_full_disk_while_training_is_one_line_and_keeps_nothing_half_written(
    tmp_path, monkeypatch, capsys
):
    """MLX's writer says ``RuntimeError: [write] Unable to write N bytes`` (no errno): it ended
    in a traceback. Now one line names --out, the space left and what to do; the drafter
    and checkpoint are either whole or absent, and no temp file stays behind."""

    def full(path, arrays, *args, **kwargs):
        Path(path).write_bytes(b"\0" * 100)  # a partial file, as a full disk leaves one
        raise RuntimeError("[write] Unable to write 65536 bytes")

    monkeypatch.setattr(mx, "save_safetensors", full)
    code, errors, args = disk_full_run(tmp_path, monkeypatch, capsys)
    out = Path(args.out)
    assert code == 1 and len(errors) == 1, errors
    assert errors[0].startswith(f"error: {out}: no space left on its disk (")
    assert (
        "Unable to write 65536 bytes): free space there or give --out a folder on another"
        in (errors[0])
    )
    assert "nothing half-written was kept" in errors[0]
    assert sorted(p.name for p in out.iterdir()) == ["train_log.jsonl"]  # written whole
    assert all(json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines())
    assert "--resume" not in errors[0]  # no checkpoint was written to resume from


def test_a_full_disk_while_extracting_names_the_cache_folder(tmp_path, monkeypatch, capsys):
    import errno

    def full(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # numpy names no file

    monkeypatch.setattr(np, "savez", full)
    code, errors, args = disk_full_run(tmp_path, monkeypatch, capsys)
    assert code == 1 and len(errors) == 1, errors
    assert errors[0].startswith(f"error: {args.cache_dir}: no space left on its disk (")
    assert "free space there or give --cache-dir a folder on another disk" in errors[0]
    assert [p.name for p in Path(args.cache_dir).glob("*.npz")] == []


def test_extraction_lines_are_sized_to_the_data_not_the_budget(tmp_path, monkeypatch, capsys):
    """train showed "826/600000 tokens ... ETA 25:29" just before saying the data holds 826
    tokens: from the first conversation on, a line's total is what the data holds (estimated
    from the conversations read), and the last one is exact."""
    from redrafter_mlx.training import progress

    monkeypatch.setattr(progress, "PLAIN_EVERY", 0.0)
    write_conversations(tmp_path / "data.json", 12)
    flags = [*trained_flags(tmp_path), "--max-tokens", "600000", "--heldout", "2"]
    flags = [f for f in flags if f != "--quiet"] + ["--heldout-tokens", "300"]
    args = T.setup_arg_parser().parse_args(flags)
    cache = prepare_cache(
        learnable_target(), CharTokenizer(), "tiny", tmp_path / "data.json", tmp_path / "c",
        T.extract_options(args),
    )  # fmt: skip
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("extract train: ")]
    totals = [int(x.split("/", 1)[1].split(" ", 1)[0].replace(",", "")) for x in lines]
    held = cache.tokens("train")
    assert len(lines) >= 3 and held < 600_000
    assert all(total <= 2 * held for total in totals), lines
    assert totals[-1] == held and "(what the data holds, estimated)" in lines[-1]


def test_data_bound():
    from redrafter_mlx.training import progress

    # 2 conversations read (300 tokens), 8 left at 150 each: 1,500 tokens, well under budget
    assert progress.data_bound(600_000, have=300, done=300, read=2, unread=8) == 1500
    assert progress.data_bound(1000, have=300, done=300, read=2, unread=8) == 1000
    assert progress.data_bound(1000, have=0, done=0, read=0, unread=8) == 1000
