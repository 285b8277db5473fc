"""Drafters as artifacts: `--drafter` Hub ids read offline from a local Hub cache, discovery
(trained here, shipped with the model, none, mismatched, a quantized variant, `none`)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from support import (
    decoder_for,
    decoding_of,
    run_steps,
    tiny_llama,
    tiny_model_folder,
    toy_tokenizer,
)
from support.decoding import take

from redrafter_mlx.backend import plan as plans
from redrafter_mlx.core.decode import llm
from redrafter_mlx.core.decode.sequence import Sequence
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.decode.source import Reading
from redrafter_mlx.core.drafters.beam_search import BeamDrafter
from redrafter_mlx.core.drafters.redrafter import (
    load_drafter,
    random_drafter,
    save_drafter,
    tap_features,
)
from redrafter_mlx.core.errors import ReDrafterError
from redrafter_mlx.io import drafters
from redrafter_mlx.training.taps import tapped

CONFIG = {"model_type": "llama", "hidden_size": 64, "vocab_size": 64, "num_hidden_layers": 2}
QUANTIZED = {**CONFIG, "quantization": {"group_size": 64, "bits": 4}, "torch_dtype": "bfloat16"}


class OtherTokenizer:
    """A tokenizer of the same size whose ids mean other words."""

    def get_vocab(self) -> dict[str, int]:
        return {f"x{i}": i for i in range(64)}


@pytest.fixture(scope="module")
def target():
    return tiny_llama()


@pytest.fixture(scope="module")
def tokenizer():
    return toy_tokenizer()


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """A registry of this test's own (``$REDRAFTER_CACHE``), and a Hugging Face cache with no
    network: the Hub library reads its settings at import, so they are set on it too."""
    from huggingface_hub import constants

    monkeypatch.setenv("REDRAFTER_CACHE", str(tmp_path / "cache"))
    hub = tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub


def drafter_folder(out: Path, hidden: int = 64, vocab: int = 64) -> Path:
    save_drafter(random_drafter(hidden, vocab, seed=1), out)
    return out


def hub_repo(hub: Path, repo_id: str, files: dict[str, Path]) -> None:
    """``repo_id`` as huggingface_hub caches it: ``models--owner--name`` with ``refs/main``
    naming a snapshot folder that holds ``files`` (path in the repo -> local file)."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    for name, source in files.items():
        dest = repo / "snapshots" / commit / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, dest)


def find(given, *, target, tokenizer, model="models/tiny", config=CONFIG):
    return drafters.find_drafter(
        given, model=model, target=target, config=config, tokenizer=tokenizer
    )


def test_a_hub_drafter_id_is_read_offline_from_the_hub_cache(
    tmp_path, own_cache, target, tokenizer
):
    local = drafter_folder(tmp_path / "made")
    hub_repo(own_cache, "someone/tiny-drafter", {f.name: f for f in local.iterdir()})
    choice = find("someone/tiny-drafter", target=target, tokenizer=tokenizer)
    assert choice.path.is_relative_to(own_cache) and "Hub" in choice.reason
    assert load_drafter(choice.path, target).args.hidden_size == 64
    with pytest.raises(ReDrafterError, match="--drafter someone/missing: not a local path"):
        find("someone/missing", target=target, tokenizer=tokenizer)


def test_a_drafter_trained_here_is_found_for_the_model_and_its_quantized_variants(
    tmp_path, target, tokenizer
):
    folder = drafter_folder(tmp_path / "mine")
    identity = drafters.ModelIdentity.of(target, CONFIG, tokenizer)
    drafters.record_trained(folder, identity, "models/tiny")
    assert drafters.read_target_file(folder)["model"] == "models/tiny"
    same = find(None, target=target, tokenizer=tokenizer)
    assert same.path == folder.resolve() and same.reason.startswith("trained here")
    variant = find(None, target=target, tokenizer=tokenizer, model="m-4bit", config=QUANTIZED)
    assert variant.path == folder.resolve()


def test_another_model_with_the_same_sizes_does_not_match_and_a_same_name_is_refused(
    tmp_path, target, tokenizer
):
    folder = drafter_folder(tmp_path / "mine")
    drafters.record_trained(folder, drafters.ModelIdentity.of(target, CONFIG, tokenizer), "m")
    wider = {**CONFIG, "intermediate_size": 256}
    other = find(None, target=target, tokenizer=OtherTokenizer(), model="m", config=wider)
    assert other.path is None
    assert f"refused {folder.resolve()}: trained for another model under the name m" in (
        other.reason
    )
    assert "\n" not in other.describe()
    with pytest.raises(ReDrafterError, match="made for another model .m: config and tokenizer"):
        find(str(folder), target=target, tokenizer=OtherTokenizer(), config=wider)


def test_a_drafter_shipped_in_the_models_folder_or_repo_is_found_unless_it_mismatches(
    tmp_path, own_cache, target, tokenizer
):
    model = tmp_path / "model"
    shipped = drafter_folder(model / "redrafter")
    choice = find(None, target=target, tokenizer=tokenizer, model=str(model))
    assert choice.path == shipped and "shipped with the model" in choice.reason
    files = {f"redrafter/{f.name}": f for f in shipped.iterdir()}
    hub_repo(own_cache, "someone/tiny-model", files)
    from_hub = find(None, target=target, tokenizer=tokenizer, model="someone/tiny-model")
    assert from_hub.path.is_relative_to(own_cache) and from_hub.path.name == "redrafter"
    drafter_folder(model / "redrafter", hidden=32)
    refused = find(None, target=target, tokenizer=tokenizer, model=str(model))
    assert refused.path is None
    assert "made for hidden_size 32 / vocab_size 64, but the model has 64 / 64" in refused.reason


def test_no_drafter_or_none_means_lookup_beams_only(tmp_path, target, tokenizer):
    nothing = find(None, target=target, tokenizer=tokenizer, model=str(tmp_path))
    assert nothing.path is None
    assert nothing.describe() == (
        "drafter: none (none trained here or shipped with this model): lookup beams only"
    )
    folder = drafter_folder(tmp_path / "mine")
    drafters.record_trained(folder, drafters.ModelIdentity.of(target, CONFIG, tokenizer), "m")
    off = find("none", target=target, tokenizer=tokenizer, model="m")
    assert off.path is None and off.reason == "--drafter none: discovery off"


def test_the_packaged_drafter_goes_to_every_model_its_target_json_records(
    tmp_path, monkeypatch, target, tokenizer
):
    """The drafter the package ships is matched as a trained one is, by the identity its
    target.json records, at any path (it went only to the embedded model's own path); a model
    that shares only its sizes does not get it, nor does any model without that file."""
    packaged = drafter_folder(tmp_path / "packaged")
    monkeypatch.setattr(drafters, "default_drafter_path", lambda: packaged)
    copy = str(tmp_path / "a copy")
    assert find(None, target=target, tokenizer=tokenizer, model=copy).path is None
    identity = drafters.ModelIdentity.of(target, CONFIG, tokenizer)
    drafters.write_target_file(packaged, identity, "tiny")
    found = find(None, target=target, tokenizer=tokenizer, model=copy)
    assert found.path == packaged and found.reason == "shipped with redrafter-mlx for tiny"
    variant = find(None, target=target, tokenizer=tokenizer, model=copy, config=QUANTIZED)
    assert variant.path == packaged
    other = find(None, target=target, tokenizer=OtherTokenizer(), model=copy)
    wider = find(None, target=target, tokenizer=tokenizer, config={**CONFIG, "rope_theta": 1.0})
    assert other.path is None and wider.path is None
    assert other.reason == "none trained here or shipped with this model"


@pytest.fixture(scope="module")
def embedded_float32():
    """The embedded model's float32 conversion (the user's cache: converted once)."""
    from redrafter_mlx.io.embedded import EmbeddedModelError, default_model_path

    try:
        return default_model_path("float32")
    except EmbeddedModelError as e:
        pytest.skip(str(e))


def linked_copy(source: Path, out: Path, **config) -> Path:
    """``source``'s files linked into ``out`` (cheap), its config.json changed by ``config``."""
    out.mkdir()
    for f in source.iterdir():
        (out / f.name).symlink_to(f)
    if config:
        (out / "config.json").unlink()
        settings = json.loads((source / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**settings, **config}))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("copy", ["float32 copy", "float16 conversion", "another model"])
def test_a_copy_of_the_embedded_model_finds_the_shipped_drafter(tmp_path, embedded_float32, copy):
    """A converted copy of the embedded model (its files elsewhere, or its GGUF converted
    anew to float16) gets the shipped drafter (it got none); a model with the same sizes and
    tokenizer but another config (here the original's rms_norm_eps) does not."""
    from redrafter_mlx.io.convert import convert_gguf
    from redrafter_mlx.io.embedded import default_drafter_path, embedded_gguf
    from redrafter_mlx.io.runtime import load_runtime

    if copy == "float16 conversion":
        folder = tmp_path / "smollm2-f16"
        convert_gguf(embedded_gguf(), folder, dtype="float16")
    elif copy == "float32 copy":
        folder = linked_copy(embedded_float32, tmp_path / "smollm2")
    else:
        folder = linked_copy(embedded_float32, tmp_path / "other", rms_norm_eps=1e-5)
    runtime = load_runtime(str(folder), None, need_drafter=False)
    choice = runtime.drafter_choice
    if copy == "another model":
        assert choice.path is None and runtime.drafter is None
        assert choice.reason == "none trained here or shipped with this model"
    else:
        assert choice.path == default_drafter_path() and runtime.drafter is not None
        assert choice.reason.startswith("shipped with redrafter-mlx for SmolLM2-135M-Instruct")


def test_a_broken_registry_is_ignored(tmp_path, target, tokenizer):
    drafters.registry_path().parent.mkdir(parents=True)
    drafters.registry_path().write_text("{not json")
    assert find(None, target=target, tokenizer=tokenizer, model=str(tmp_path)).path is None


FACTS = {
    "data": "self-distilled: the target's answers to 40 ShareGPT prompts",
    "heldout_agreement": [0.61, 0.42],
    "tokens_per_step": 1.87,
    "measured_with": "redrafter-mlx eval-drafter --model m --drafter d --num-prompts 5",
    "license": "apache-2.0",
}


def trained_folder(tmp_path: Path, target, tokenizer, model: str = "someone/tiny") -> Path:
    """A drafter folder as ``train`` leaves it: weights, target.json with card facts, a
    checkpoint that is not shared."""
    from redrafter_mlx.io.card import record_card_facts

    folder = drafter_folder(tmp_path / "mine")
    drafters.record_trained(folder, drafters.ModelIdentity.of(target, CONFIG, tokenizer), model)
    record_card_facts(folder, FACTS)
    (folder / "checkpoint").mkdir()
    (folder / "checkpoint" / "state.json").write_text("{}")
    return folder


def test_the_card_says_target_data_agreement_speed_license_and_how_to_load(
    tmp_path, target, tokenizer
):
    from redrafter_mlx.io.card import write_card

    folder = trained_folder(tmp_path, target, tokenizer)
    card = write_card(folder).read_text()
    assert "base_model: someone/tiny" in card and "license: apache-2.0" in card
    assert "**Target**: someone/tiny" in card
    assert f"**Data**: {FACTS['data']}" in card
    assert "0.610 / 0.420" in card
    assert f"1.87 tokens/step, measured with `{FACTS['measured_with']}`" in card
    assert f"--model someone/tiny --drafter {folder} " in card
    # the card's facts do not disturb the identity discovery matches on
    assert find(None, target=target, tokenizer=tokenizer, model="x").path == folder.resolve()


def test_upload_dry_run_lists_the_files_and_writes_or_sends_nothing(
    tmp_path, monkeypatch, capsys, target, tokenizer
):
    """--dry-run lists what would go (the card made for the repository among them) and leaves
    the folder as it was: a README.md of the user's own is not replaced by the card."""
    import huggingface_hub

    from redrafter_mlx.cli import main

    folder = trained_folder(tmp_path, target, tokenizer)
    (folder / "README.md").write_text("my own notes\n")
    before = {f: f.read_bytes() for f in folder.rglob("*") if f.is_file()}
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda *a, **k: pytest.fail("network"))
    repo = ["--repo", "you/tiny-redrafter", "--model", "org/tiny-4bit"]
    main(["upload", "--drafter", str(folder), *repo, "--dry-run"])
    out, err = capsys.readouterr()
    listed = [line.split("\t")[0] for line in out.splitlines()]
    assert listed == ["config.json", "model.safetensors", "target.json", "README.md"]
    assert "nothing written or sent; would upload these 4 files" in err
    assert {f: f.read_bytes() for f in folder.rglob("*") if f.is_file()} == before


def test_upload_creates_the_repo_and_sends_the_shared_files_and_the_card_only(
    tmp_path, monkeypatch, capsys, target, tokenizer
):
    import huggingface_hub

    from redrafter_mlx.cli import main

    calls = []

    class FakeApi:
        def create_repo(self, repo, **kwargs):
            calls.append(("create", repo, kwargs["private"]))
            return f"https://huggingface.co/{repo}"

        def create_commit(self, **kwargs):
            sent = {op.path_in_repo: op.path_or_fileobj for op in kwargs["operations"]}
            calls.append(("commit", kwargs["repo_id"], sorted(sent)))
            card.append(sent["README.md"].decode())

    card = []
    folder = trained_folder(tmp_path, target, tokenizer)
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    main(["upload", "--drafter", str(folder), "--repo", "you/tiny-redrafter"])
    shared = sorted(["config.json", "model.safetensors", "target.json", "README.md"])
    assert calls == [
        ("create", "you/tiny-redrafter", False),
        ("commit", "you/tiny-redrafter", shared),
    ]
    assert "--drafter you/tiny-redrafter " in card[0] and not (folder / "README.md").exists()
    with pytest.raises(SystemExit):
        main(["upload", "--drafter", str(tmp_path), "--repo", "you/x", "--dry-run"])
    assert "not a drafter (no config.json or model.safetensors)" in capsys.readouterr().err


@pytest.mark.parametrize("what", ["model", "config only", "truncated"])
def test_upload_refuses_a_folder_that_holds_no_drafter_before_writing_anything(
    tmp_path, monkeypatch, capsys, target, tokenizer, what
):
    """A model folder given as --drafter used to get a drafter card written into it and
    "would upload 3 files"; now nothing is written and the folder is named."""
    import huggingface_hub

    from redrafter_mlx.cli import main

    if what == "model":
        folder = tiny_model_folder(tmp_path / "model")
    else:
        folder = drafter_folder(tmp_path / "d")
        if what == "config only":
            (folder / "model.safetensors").unlink()
        else:
            weights = folder / "model.safetensors"
            weights.write_bytes(weights.read_bytes()[:-64])
    before = sorted(folder.iterdir())
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda *a, **k: pytest.fail("network"))
    with pytest.raises(SystemExit) as ended:
        main(["upload", "--drafter", str(folder), "--repo", "you/x", "--dry-run"])
    assert ended.value.code == 1
    assert sorted(folder.iterdir()) == before
    err = capsys.readouterr().err
    assert f"error: --drafter {folder}: not a drafter (" in err and err.count("\n") == 1


@pytest.mark.parametrize("repo", ["foo/..", "a/.", "ü/é", "a/b-", "a/" + "b" * 200, "a", "a/b/c"])
def test_upload_refuses_a_repo_name_the_hub_refuses_before_anything_else(
    tmp_path, monkeypatch, capsys, target, tokenizer, repo
):
    import huggingface_hub

    from redrafter_mlx.cli import main

    folder = trained_folder(tmp_path, target, tokenizer)
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda *a, **k: pytest.fail("network"))
    with pytest.raises(SystemExit):
        main(["upload", "--drafter", str(folder), "--repo", repo])
    err = capsys.readouterr().err
    assert f"--repo {repo!r}: " in err
    assert "1 to 96 characters of A-Z, a-z, 0-9, '-', '_' and '.'" in err
    assert not (folder / "README.md").exists()


def test_the_4bit_variant_of_a_model_loads_the_drafter_trained_for_it(tmp_path):
    """End to end through load_runtime: a drafter recorded for the 16-bit folder is found for
    its 4-bit conversion (another folder, another name), and `none` turns that off."""
    from redrafter_mlx.io import runtime as rt
    from redrafter_mlx.io.load import load_target

    full, four = tiny_model_folder(tmp_path / "m16"), tiny_model_folder(tmp_path / "m4", bits=4)
    target, tok, config = load_target(full)
    folder = drafter_folder(tmp_path / "mine")
    drafters.record_trained(folder, drafters.ModelIdentity.of(target, config, tok), str(full))
    assert "quantization" in load_target(four, tokenizer=False)[2]  # another config.json
    runtime = rt.load_runtime(str(four), None, need_drafter=True)
    assert runtime.drafter is not None and runtime.drafter_id == str(folder.resolve())
    assert runtime.drafter_choice.reason.startswith("trained here for this model")
    off = rt.load_runtime(str(four), "none", need_drafter=False)
    assert off.drafter is None and off.drafter_choice.describe().endswith("lookup beams only")
    with pytest.raises(ReDrafterError, match=r"no drafter for this model \(--drafter none"):
        rt.load_runtime(str(four), "none", need_drafter=True)


@pytest.mark.parametrize("cpu_plan", ["1", "0"])
def test_generate_without_a_drafter_for_the_model_says_so_and_uses_lookup_beams(
    tmp_path, capsys, monkeypatch, cpu_plan
):
    """No drafter trained here or shipped: one line says so, and the answer (lookup beams
    alone: the CPU plan's default shape has one, the generic plan's none, so one is added)
    equals plain decoding's."""
    from redrafter_mlx.cli import main

    monkeypatch.setenv("REDRAFTER_CPU_TUNING", cpu_plan)
    folder = tiny_model_folder(tmp_path / "m16")
    prompt = ["--model", str(folder), "--prompt", "w5 w6 w7", "--max-tokens", "12"]
    main(["generate", *prompt])
    found = capsys.readouterr()
    main(["generate", *prompt, "--autoregressive"])
    assert found.out == capsys.readouterr().out
    assert "drafter: none (none trained here or shipped with this model): lookup beams only\n" in (
        found.err
    )
    shape = "L=2 lookup 1 (default)" if cpu_plan == "1" else "L=4 lookup 1 (default; lookup 1: no"
    assert f"[lookup only {shape}" in found.err


def write_registry(data) -> None:
    drafters.registry_path().parent.mkdir(parents=True, exist_ok=True)
    drafters.registry_path().write_text(json.dumps(data))


def registry_entry(path, target, tokenizer) -> dict:
    identity = drafters.ModelIdentity.of(target, CONFIG, tokenizer)
    return {"path": path, "model": "m", "identity": dataclasses.asdict(identity)}


@pytest.mark.parametrize(
    "broken",
    [
        5,
        {"drafters": 5},
        {"drafters": {"path": "x"}},
        {"drafters": [{"path": 5}]},
        {"drafters": [{"path": ["a"]}]},
        {"drafters": [{"path": None}]},
        {"drafters": [{"path": ""}]},
        {"drafters": [{"identity": "abc"}]},
        {"drafters": [{"identity": ["abc"]}]},
        {"drafters": [{"identity": None}]},
    ],
)
def test_a_malformed_registry_or_entry_is_skipped_said_and_the_next_source_used(
    tmp_path, monkeypatch, target, tokenizer, broken
):
    """Discovery goes on to the model's shipped drafter past a registry it cannot read, and
    names what it skipped in one line (an entry with ``"path": ""`` used to mean the working
    folder: here a model folder, which then failed to load as a drafter)."""
    model = tmp_path / "model"
    shipped = drafter_folder(model / "redrafter")
    (model / "config.json").write_text(json.dumps(CONFIG))
    monkeypatch.chdir(model)
    if isinstance(broken, dict) and isinstance(broken["drafters"], list):
        entry = {**registry_entry(str(shipped), target, tokenizer), **broken["drafters"][0]}
        broken = {"drafters": [entry]}
    write_registry(broken)
    choice = find(None, target=target, tokenizer=tokenizer, model=str(model))
    assert choice.path == shipped and "shipped with the model" in choice.reason
    line = choice.skipped_line()
    assert line.startswith("note: drafter discovery skipped 1 unusable source: ")
    assert str(drafters.registry_path()) in line and "\n" not in line


@pytest.mark.parametrize(
    "what,why",
    [
        ("model", "not a drafter (its model.safetensors does not hold a drafter's tensors)"),
        ("config only", "not a drafter (no model.safetensors)"),
        ("truncated", "not a drafter ({bad}/model.safetensors: truncated safetensors file ("),
        ("not a folder", "not a folder"),
    ],
)
def test_a_registry_entry_that_holds_no_drafter_is_skipped_for_the_next_source(
    tmp_path, target, tokenizer, what, why
):
    """The newest entry for this model names the model's own folder, a config.json alone, a
    cut drafter or a file: it is named in ``skipped`` and the older entry's drafter is used
    (the newest used to be returned, and loading it failed)."""
    if what == "model":
        bad = tiny_model_folder(tmp_path / "target")
    elif what == "config only":
        bad = tmp_path / "config-only"
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps(CONFIG))
    elif what == "truncated":
        bad = drafter_folder(tmp_path / "cut")
        weights = bad / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-100])
    else:
        bad = tmp_path / "file"
        bad.write_text("{}")
    good = drafter_folder(tmp_path / "older")
    entries = [registry_entry(str(p), target, tokenizer) for p in (good, bad)]  # bad: newest
    write_registry({"drafters": entries})
    choice = find(None, target=target, tokenizer=tokenizer, model=str(tmp_path / "model"))
    assert choice.path == good and choice.reason.startswith("trained here")
    (skipped,) = choice.skipped
    prefix = f"{bad} (from {drafters.registry_path()}): {why.format(bad=bad)}"
    assert skipped.startswith(prefix), skipped
    load_drafter(choice.path, target)


def test_generate_past_an_entry_that_is_no_drafter_answers_and_says_so_once(
    tmp_path, capsys, monkeypatch
):
    """The registry names the model folder itself as this model's drafter: `generate` skips it
    with one line and answers as without it (before: exit 1, "not a drafter config")."""
    from redrafter_mlx.cli import main
    from redrafter_mlx.io.load import load_target

    folder = tiny_model_folder(tmp_path / "m16")
    target, tok, config = load_target(folder)
    identity = drafters.ModelIdentity.of(target, config, tok)
    entry = {"path": str(folder), "model": str(folder), "identity": dataclasses.asdict(identity)}
    write_registry({"drafters": [entry]})
    prompt = ["--model", str(folder), "--prompt", "w5 w6 w7", "--max-tokens", "8"]
    main(["generate", *prompt])
    found = capsys.readouterr()
    main(["generate", *prompt, "--autoregressive"])
    assert found.out == capsys.readouterr().out
    skipped = [line for line in found.err.splitlines() if "discovery skipped" in line]
    assert skipped == [
        f"note: drafter discovery skipped 1 unusable source: {folder} (from "
        f"{drafters.registry_path()}): not a drafter (its model.safetensors does not hold a "
        "drafter's tensors)"
    ]


WRITER = """
import sys, time
from pathlib import Path
from redrafter_mlx.io import drafters
identity = drafters.ModelIdentity(64, 64, "c", "t")
root = Path(sys.argv[1])
(root / "ready").touch()
while not (root.parent / "go").exists():  # both start together, imports done
    time.sleep(0.01)
for i in range(int(sys.argv[2])):
    (root / str(i)).mkdir()
    drafters.record_trained(root / str(i), identity, "m")
"""


def test_two_writers_recording_at_once_keep_every_entry(tmp_path):
    """Two processes recording 40 drafters each: all 80 entries are kept (the registry is
    read, merged and replaced under a lock; without it a few were lost)."""
    import os
    import subprocess
    import sys
    import time

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        argv = [sys.executable, "-c", WRITER, str(tmp_path / name), "40"]
        procs.append(subprocess.Popen(argv, env=env))
    for name in ("a", "b"):
        while not (tmp_path / name / "ready").exists():
            assert all(p.poll() is None for p in procs)
            time.sleep(0.01)
    (tmp_path / "go").touch()
    assert [p.wait(120) for p in procs] == [0, 0]
    paths = {e["path"] for e in drafters.read_registry()}
    assert len(paths) == 80


# -- layered drafters: inputs from several target layers (issue 44)


def layered_drafter(target, layers=(0, 2), seed: int = 3):
    """A random drafter reading ``layers`` besides the final hidden state, its fusion random
    (not the pass-through it starts training from: every tapped column counts)."""

    drafter = random_drafter(64, 64, seed=seed, context_layers=list(layers), exit_dim=96)
    return BeamDrafter(drafter, llm.embedding(target))


@pytest.fixture(scope="module")
def deep_target():
    return tiny_llama(seed=5, layers=4)


@pytest.mark.parametrize("plan_name", ["CPU_PLAN", "GENERIC_PLAN"])
@pytest.mark.parametrize("shape", [(1, 4), (3, 4), (4, 5)], ids=str)
def test_greedy_with_a_layered_drafter_equals_the_targets_own_output(deep_target, plan_name, shape):
    """Exactness on the CPU plan's fused forward and on the generic one (what
    REDRAFTER_CPU_TUNING=0 runs): the answer is the target's own, token for token."""

    plan = getattr(plans, plan_name)
    drafter = layered_drafter(deep_target)
    prompt = [5, 17, 33, 2, 41, 8, 9]
    expected, _ = take(run_steps(deep_target, prompt, plan=plan), 48)
    got, steps = take(run_steps(deep_target, prompt, drafter, BeamShape(*shape), plan=plan), 48)
    assert got == expected
    assert steps <= 48


@pytest.mark.parametrize("plan_name", ["CPU_PLAN", "GENERIC_PLAN"])
def test_a_layered_drafter_drafts_from_the_taps_training_extracts(deep_target, plan_name):
    """After a prompt, the first beams are the beam search from the final hidden state fused
    with the tapped layers' features of the last prompt token, as extraction records them
    (``training/taps.py``): decoding reads what training learnt from, at no extra forward."""

    drafter = layered_drafter(deep_target, layers=(1, 2))
    decoder = decoder_for(deep_target, drafter, getattr(plans, plan_name))
    sequence = decoder.new_sequence()

    def expected_beams(ids):
        with tapped(deep_target, (1, 2)) as got:
            hidden = llm.inner_model(deep_target)(mx.array(ids)[None])[0]
        features = tap_features([got[1][0][0], got[2][0][0]])
        pending = mx.argmax(llm.lm_head(deep_target, hidden[-1:]), axis=-1)[0]
        context = drafter.drafter.fuse(hidden[-1:], features[-1:])[0]
        return int(pending), np.array(drafter(context, pending, width=3, length=4)[0])

    state, _ = decoder.prefill(
        sequence, [5, 17, 33, 2, 41, 8, 9], decoding_of(drafter, BeamShape(3, 4))
    )
    for _ in range(4):  # after the prompt, then after steps (the last accepted path row's taps)
        pending, beams = expected_beams(list(sequence.ids))
        assert state.pending == pending
        np.testing.assert_array_equal(state.drafted, beams)
        state, _ = decoder.step(state)


def test_a_layered_drafter_round_trips_and_old_drafters_keep_loading(tmp_path, deep_target):
    """``context_layers`` is saved and read back; a config without it (the reference format,
    v1-v5) loads as the last-layer-only drafter, which keeps no per-sequence part; one reading
    a layer the target lacks is refused in one line."""

    layered = layered_drafter(deep_target).drafter
    save_drafter(layered, tmp_path / "layered")
    loaded = load_drafter(tmp_path / "layered", deep_target)
    assert loaded.taps == (0, 2) and "context_proj" in loaded
    x = mx.ones((1, 3 * 64))
    assert mx.array_equal(loaded.context_proj(x), layered.context_proj(x))
    old = drafter_folder(tmp_path / "old")
    config = json.loads((old / "config.json").read_text())
    config.pop("context_layers")  # as v1-v5 and the reference format write it
    (old / "config.json").write_text(json.dumps(config))
    plain = load_drafter(old, deep_target)
    assert plain.taps == () and "context_proj" not in plain
    assert BeamDrafter(plain, llm.embedding(deep_target)).new_part() is None
    with pytest.raises(ReDrafterError, match=r"reads target layers \[0, 2\], but the target has 2"):
        load_drafter(tmp_path / "layered", tiny_llama())


def test_a_layered_drafter_drafts_from_the_last_accepted_path_rows_taps(deep_target):
    """A step's reading drafts from the taps of path row ``count - 1`` (the last accepted
    token), and the commit keeps that row's features for the next prompt-less draft."""

    drafter = layered_drafter(deep_target, layers=(1, 3))
    part = drafter.new_part()
    sequence = Sequence(1, mx.float32)
    sequence.parts.append(part)
    rng = np.random.default_rng(0)
    taps = {i: mx.array(rng.normal(size=(6, 64)).astype(np.float32)) for i in (1, 3)}
    rows = mx.array([4, 0, 2, 5])
    drafter.observe(sequence, taps, rows)
    context, pending = mx.array(rng.normal(size=64).astype(np.float32)), mx.array(7)
    reading = Reading(context, pending, rows, mx.array([3, 4, 5, 6]), mx.array(3))
    got = drafter.draft(sequence, reading, width=2, length=3)[0]
    row = tap_features([taps[1][2:3], taps[3][2:3]])  # path row 3 - 1 is forward row 2
    fused = drafter.drafter.fuse(context[None], row)[0]
    np.testing.assert_array_equal(
        np.array(got), np.array(drafter(fused, pending, width=2, length=3)[0])
    )
    part.commit([3, 4, 5])
    after = drafter.draft(sequence, Reading.after_prompt(context, pending), width=2, length=3)[0]
    np.testing.assert_array_equal(np.array(after), np.array(got))


# -- the drafter interface (issue 66): one abstract type, one factory


def test_every_drafter_type_is_a_source_that_names_its_type():
    """ReDrafter's RNN, EAGLE-3, DFlash, MTP and lookup all implement ``drafting.Source`` and
    say which type they are (what banners and ``--json`` print)."""
    from redrafter_mlx.core.decode.lookup import Lookup
    from redrafter_mlx.core.decode.source import Source
    from redrafter_mlx.core.drafters.dflash import DFlashDrafter
    from redrafter_mlx.core.drafters.dflash2 import DFlash2Drafter
    from redrafter_mlx.core.drafters.dspark import DSparkDrafter
    from redrafter_mlx.core.drafters.eagle3 import Eagle3Drafter
    from redrafter_mlx.core.drafters.mtp import MTPDrafter

    kinds = {
        BeamDrafter: "redrafter",
        Eagle3Drafter: "eagle3",
        DFlashDrafter: "dflash",
        DFlash2Drafter: "dflash2",
        DSparkDrafter: "dspark",
        MTPDrafter: "mtp",
        Lookup: "lookup",
    }
    for cls, kind in kinds.items():
        assert issubclass(cls, Source) and cls.kind == kind, cls


def test_a_source_must_draft_and_defaults_the_rest():
    """A subclass that does not draft cannot be made; one that only drafts reads the final
    hidden state alone, keeps nothing per sequence and takes any shape."""
    from redrafter_mlx.core.decode.source import Source

    class Silent(Source):
        kind = "silent"

    with pytest.raises(TypeError, match="abstract"):
        Silent()

    class Root(Silent):
        def draft(self, sequence, reading, **options):
            return reading.pending.reshape(1, 1), None, 0

    root = Root()
    assert root.taps == () and root.new_part() is None and not root.prunes
    assert root.check_shape(BeamShape(64, 9)) is None
    assert not root.batch_fits


def test_a_beam_drafters_shape_check_refuses_more_beams_than_draft_tokens(target):
    drafter = BeamDrafter(random_drafter(64, 16, seed=1), llm.embedding(target))
    drafter.check_shape(BeamShape(4, 3, search_width=16))
    with pytest.raises(ValueError, match="17 beams exceed the drafter's vocabulary"):
        drafter.check_shape(BeamShape(4, 3, search_width=17))


def test_create_drafter_loads_a_redrafter_folder_as_its_source(tmp_path, target):
    from redrafter_mlx.io.field_drafters import create_drafter

    folder = drafter_folder(tmp_path / "d")
    drafter = create_drafter(folder, target)
    assert isinstance(drafter, BeamDrafter) and drafter.kind == "redrafter"
    context, pending = mx.ones((64,)), mx.array(3)
    want = BeamDrafter(load_drafter(folder, target), llm.embedding(target))
    np.testing.assert_array_equal(
        np.array(drafter(context, pending, width=2, length=3)[0]),
        np.array(want(context, pending, width=2, length=3)[0]),
    )
    (tmp_path / "bad").mkdir()
    with pytest.raises(ReDrafterError):
        create_drafter(tmp_path / "bad", target)


def test_lookup_drafts_the_sequences_own_continuations():
    """Lookup as a source: the beams its index proposes after the pending token, at
    log-prob 0, after one host read (the pending token)."""
    from redrafter_mlx.core.decode.lookup import Lookup

    sequence = Sequence(1, mx.float32)
    sequence.commit([1, 2, 3, 1, 2, 4, 1])
    reading = Reading.after_prompt(mx.zeros((4,)), mx.array(2))
    beams, logprobs, reads = Lookup().draft(sequence, reading, width=3, length=4)
    assert np.array(beams).tolist() == [[2, 4, 1, 2], [2, 3, 1, 2]]  # (1, 2) twice, latest first
    assert np.array(logprobs).tolist() == [[0.0] * 3] * 2 and reads == 1


def test_a_drafter_whose_size_is_a_string_is_told_it_needs_an_integer(tmp_path, capsys):
    """``"hidden_size": "64"`` was refused as "made for hidden_size 64 / vocab_size 64, but the
    model has 64 / 64"."""
    from redrafter_mlx.cli import main

    model = tiny_model_folder(tmp_path / "m")
    folder = drafter_folder(tmp_path / "d")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_size": "64"}))
    capsys.readouterr()
    with pytest.raises(SystemExit) as ended:
        main(["generate", "--model", str(model), "--drafter", str(folder), "--prompt", "w5 w6"])
    err = capsys.readouterr().err
    assert ended.value.code == 1 and "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("error: ")]
    assert line.endswith("not a drafter config (hidden_size '64': need an integer >= 1)")
