"""Drafters as artifacts: `--drafter` Hub ids read offline from a local Hub cache, discovery
(trained here, shipped with the model, none, mismatched, a quantized variant, `none`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from support import tiny_llama, toy_hf_tokenizer, toy_tokenizer

from redrafter_mlx.core.drafter import load_drafter, random_drafter, save_drafter
from redrafter_mlx.core.errors import ReDrafterError
from redrafter_mlx.io import drafters

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


def find(given, *, target, tokenizer, model="models/tiny", config=CONFIG, embedded=False):
    return drafters.find_drafter(
        given, model=model, target=target, config=config, tokenizer=tokenizer, embedded=embedded
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


def test_the_embedded_models_shipped_drafter_is_still_found(target, tokenizer):
    shipped = drafters.default_drafter_path()
    if shipped is None:
        pytest.skip("no shipped drafter in this checkout")
    choice = find(None, target=target, tokenizer=tokenizer, embedded=True)
    assert choice.path == shipped and choice.reason == "the embedded model's shipped drafter"


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


def test_upload_dry_run_writes_the_card_and_lists_the_files_without_the_network(
    tmp_path, monkeypatch, capsys, target, tokenizer
):
    import huggingface_hub

    from redrafter_mlx.cli import main

    folder = trained_folder(tmp_path, target, tokenizer)
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda *a, **k: pytest.fail("network"))
    repo = ["--repo", "you/tiny-redrafter", "--model", "org/tiny-4bit"]
    main(["upload", "--drafter", str(folder), *repo, "--dry-run"])
    out, err = capsys.readouterr()
    listed = [line.split("\t")[0] for line in out.splitlines()]
    assert listed == ["config.json", "model.safetensors", "target.json", "README.md"]
    assert "would upload these 4 files" in err
    card = (folder / "README.md").read_text()
    assert "--model org/tiny-4bit --drafter you/tiny-redrafter " in card
    assert "base_model: org/tiny-4bit" in card


def test_upload_creates_the_repo_and_sends_the_shared_files_only(
    tmp_path, monkeypatch, capsys, target, tokenizer
):
    import huggingface_hub

    from redrafter_mlx.cli import main

    calls = []

    class FakeApi:
        def create_repo(self, repo, **kwargs):
            calls.append(("create", repo, kwargs["private"]))
            return f"https://huggingface.co/{repo}"

        def upload_folder(self, **kwargs):
            calls.append(("upload", kwargs["repo_id"], sorted(kwargs["allow_patterns"])))

    folder = trained_folder(tmp_path, target, tokenizer)
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    main(["upload", "--drafter", str(folder), "--repo", "you/tiny-redrafter"])
    shared = sorted(["config.json", "model.safetensors", "target.json", "README.md"])
    assert calls == [
        ("create", "you/tiny-redrafter", False),
        ("upload", "you/tiny-redrafter", shared),
    ]
    with pytest.raises(SystemExit):
        main(["upload", "--drafter", str(tmp_path), "--repo", "you/x", "--dry-run"])
    assert "no config.json or model.safetensors (not a drafter folder)" in capsys.readouterr().err


def model_folder(out: Path, *, bits: int | None = None) -> Path:
    """The tiny Llama as an mlx-lm folder with the toy tokenizer; ``bits``: quantized as
    ``mlx_lm.convert -q`` leaves it (quantized layers, ``quantization`` in config.json)."""
    import mlx.nn as nn
    from support.families import save

    model = tiny_llama()
    cfg = {**dict(vars(model.args)), "architectures": ["LlamaForCausalLM"]}
    if bits:
        nn.quantize(model, group_size=32, bits=bits)
        cfg["quantization"] = {"group_size": 32, "bits": bits}
    save(model, cfg, out)
    toy_hf_tokenizer().save_pretrained(str(out))
    return out


def test_the_4bit_variant_of_a_model_loads_the_drafter_trained_for_it(tmp_path):
    """End to end through load_runtime: a drafter recorded for the 16-bit folder is found for
    its 4-bit conversion (another folder, another name), and `none` turns that off."""
    from redrafter_mlx.io import runtime as rt
    from redrafter_mlx.io.load import load_target

    full, four = model_folder(tmp_path / "m16"), model_folder(tmp_path / "m4", bits=4)
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
    folder = model_folder(tmp_path / "m16")
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
