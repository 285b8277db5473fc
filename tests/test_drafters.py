"""Drafters as artifacts: `--drafter` Hub ids read offline from a local Hub cache, discovery
(trained here, shipped with the model, none, mismatched, a quantized variant, `none`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import tiny_llama, toy_tokenizer

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
    with pytest.raises(ReDrafterError, match="someone/missing: not a local path"):
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
