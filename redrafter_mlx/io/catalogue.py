"""Published drafters found by the target's name: ``--drafter auto`` and the hint discovery gives.

The catalogue (``data/drafter_catalogue.json``) lists, per model, the drafters their authors
publish (repository, type, where the name is published), in order of preference. A target is
matched by its name (:func:`target_name`): its Hub id (``Qwen/Qwen3-8B``), the id of the Hub
snapshot it was loaded from, its model card's ``base_model`` or the ``_name_or_path`` its
``config.json`` records; the owner and the suffixes of quantized copies
(``mlx-community/Qwen3-8B-4bit``, ``-bf16``, ``-MLX-8bit``) are dropped, since a drafter serves
every quantized copy of its model.

``--drafter auto`` (:func:`auto_drafter`) tries the model's entries in order: an entry of a type
this package does not load yet is skipped with a line; otherwise the drafter's ``config.json``
is fetched first and checked against the target by its type's own loader (hidden size,
vocabulary, target layers), and only a drafter that fits is downloaded in full (into the
Hugging Face cache, with huggingface_hub's progress bars; read from there afterwards). Offline,
or with the Hub unreachable, it falls back to discovery and says what it would have fetched.
Without ``--drafter``, :func:`hint` names the catalogue's drafter when discovery found none:
nothing is downloaded that the user did not ask for.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

from redrafter_mlx.core.errors import DrafterError
from redrafter_mlx.io.checks import looks_like_hub_id, one_line, resolve_path
from redrafter_mlx.io.drafters import DrafterChoice
from redrafter_mlx.io.field_drafters import KIND_NAMES, MTP, TYPES, create_drafter, drafter_kind

AUTO = "auto"  # --drafter auto
CATALOGUE_FILE = "drafter_catalogue.json"
# What a drafter repository holds that its loaders read (READMEs, GGUFs and images are skipped)
DRAFTER_FILES = ["*.json", "*.safetensors"]
# The last words of a quantized copy's name (mlx-community/Qwen3-8B-4bit, Qwen3-8B-MLX-bf16,
# gpt-oss-20b-MXFP4-Q8, Qwen3-8B-4bit-DWQ-053125): dropped to find the model it is a copy of
QUANT_WORD = re.compile(
    r"\d+bits?|bf16|fp16|f16|fp32|f32|fp8|mxfp4|nvfp4|q\d+(_k)?(_[sml])?|mlx|dwq|awq|gptq|gguf"
    r"|mixed|\d{6}",
    re.IGNORECASE,
)
# Types named in the catalogue that this package does not load yet, for people
OTHER_NAMES = {"dflash2": "DFlash2", "gemma4_assistant": "Gemma 4 assistant MTP"}


@dataclass(frozen=True)
class Entry:
    """One published drafter: ``repo`` (None: the target's own checkpoint carries it, an MTP
    head), its ``kind`` (an ``io/field_drafters.TYPES`` name, or a type not loaded yet), the
    model ``target`` it was made for, where its name is published, and why ``auto`` skips it
    (None: it does not)."""

    repo: str | None
    kind: str
    target: str
    source: str
    unsupported: str | None = None

    @property
    def type_name(self) -> str:
        return KIND_NAMES.get(self.kind) or OTHER_NAMES.get(self.kind, self.kind)

    def describe(self) -> str:
        """``z-lab/Qwen3-8B-DFlash-b16 (DFlash)``, or the own head's words."""
        where = self.repo or f"{self.target}'s own checkpoint"
        return f"{where} ({self.type_name})"


class Offline(Exception):
    """The Hub cannot be reached (offline mode, no network) and the file is not cached."""


def read_catalogue(path: Path | None = None) -> dict[str, list[Entry]]:
    """The catalogue by :func:`base_name` of each model and alias: its entries in order."""
    if path is None:
        text = resources.files("redrafter_mlx").joinpath("data", CATALOGUE_FILE).read_text()
    else:
        text = Path(path).read_text()
    by_name: dict[str, list[Entry]] = {}
    for model in json.loads(text)["models"]:
        entries = [_entry(d, model["target"]) for d in model["drafters"]]
        for name in (model["target"], *model.get("aliases", ())):
            by_name[base_name(name)] = entries
    return by_name


def _entry(data: dict, target: str) -> Entry:
    repo = None if data.get("own_head") else data["repo"]
    return Entry(repo, data["type"], target, data["source"], data.get("unsupported"))


def base_name(name: str) -> str:
    """The model a Hub id or name is a copy of, lowercased: the owner and the trailing words of
    a quantized copy dropped (``mlx-community/Qwen3-8B-4bit`` -> ``qwen3-8b``)."""
    words = name.rstrip("/").rsplit("/", 1)[-1].split("-")
    while len(words) > 1 and QUANT_WORD.fullmatch(words[-1]):
        words.pop()
    return "-".join(words).lower()


def target_name(model: str, config: dict) -> str | None:
    """The Hub id (or name) the target was loaded as: ``model`` itself when it is a Hub id,
    the id of the Hugging Face cache snapshot it lies in, the ``base_model`` of its model card
    (``README.md``: what mlx-lm's convert records), or its config's ``_name_or_path``."""
    path = Path(model).expanduser()
    if looks_like_hub_id(model) and not path.exists():
        return model
    cached = re.search(r"models--([^/]+)--([^/]+)/snapshots/", str(path))
    if cached:
        return f"{cached[1]}/{cached[2]}"
    named = _card_base_model(path / "README.md") or config.get("_name_or_path")
    return named if isinstance(named, str) and named.strip() else None


def _card_base_model(card: Path) -> str | None:
    """The first ``base_model`` a model card's metadata names, or None (no card, none named,
    a card that does not parse)."""
    if not card.is_file():
        return None
    from huggingface_hub import ModelCard

    try:
        named = ModelCard.load(card).data.base_model
    except Exception:  # a card of the user's own: any text, any YAML
        return None
    return named[0] if isinstance(named, list) and named else named


def entries_for(model: str, config: dict) -> tuple[str | None, list[Entry]]:
    """The target's name and the catalogue's drafters for it (none: ``[]``)."""
    name = target_name(model, config)
    return name, ([] if name is None else read_catalogue().get(base_name(name), []))


def hint(model: str, config: dict) -> str | None:
    """Words naming the catalogue's first loadable drafter for the model and how to get it,
    for a command that found none; None when the catalogue has none."""
    name, entries = entries_for(model, config)
    usable = [e for e in entries if _skip_reason(e) is None and e.repo is not None]
    if not usable:
        return None
    return (
        f"the catalogue lists {usable[0].describe()} for {usable[0].target}: "
        f"--drafter auto downloads it once, or --drafter {usable[0].repo}"
    )


def _skip_reason(entry: Entry) -> str | None:
    """Why ``auto`` skips ``entry`` before fetching anything, or None."""
    if entry.unsupported:
        return entry.unsupported
    if entry.kind not in {name for name, _, _ in TYPES}:
        return f"{entry.type_name} drafters are not loaded yet"
    return None


def auto_drafter(model: str, config: dict, target, *, discover) -> DrafterChoice:
    """``--drafter auto``: the first of the model's catalogue entries that fits ``target``,
    fetched (module docstring); ``discover()`` (discovery's :class:`DrafterChoice`) when none
    does or the Hub cannot be reached, its reason saying why. Entries passed over are named
    in the choice's ``skipped``, each ``what: why``."""
    name, entries = entries_for(model, config)
    if not entries:
        return _fallback(discover(), f"the catalogue has no drafter for {name or model}", [])
    skipped: list[str] = []
    for entry in entries:
        if why := _skip_reason(entry):
            skipped.append(f"{entry.describe()}: {why}")
            continue
        try:
            folder = _own_head(model) if entry.repo is None else fetch(entry, target)
        except Offline as e:
            would = f"offline ({e}): would have fetched {entry.describe()} for {entry.target}"
            return _fallback(discover(), would, skipped)
        except DrafterError as e:
            skipped.append(f"{entry.describe()}: {e}")
            continue
        why = f"--drafter auto: {entry.describe()}, the catalogue's for {entry.target}"
        return DrafterChoice(folder, why, tuple(skipped))
    fits = f"no catalogue drafter for {entries[0].target} fits"
    return _fallback(discover(), fits, skipped)


def _fallback(found: DrafterChoice, why: str, skipped: list[str]) -> DrafterChoice:
    """Discovery's choice, its reason led by why ``auto`` fell back to it."""
    reason = f"--drafter auto: {why}; {found.reason}"
    return replace(found, reason=reason, skipped=(*skipped, *found.skipped))


def fetch(entry: Entry, target) -> Path:
    """The folder of ``entry``'s repository in the Hugging Face cache: its ``config.json``
    fetched and checked against ``target`` first (:func:`config_misfit`), then its weights. Offline
    when the Hub cannot be reached and nothing is cached; DrafterError (one line) for a repo
    that is not there or a drafter that does not fit; OSError (a full disk) as it comes."""
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo = entry.repo
    try:
        folder = Path(hf_hub_download(repo, "config.json")).parent
        if problem := config_misfit(folder, entry.kind, target):
            raise DrafterError(problem)
        return Path(snapshot_download(repo, allow_patterns=DRAFTER_FILES))
    except GatedRepoError:
        raise DrafterError("gated on the Hub: accept its licence there, then log in") from None
    except (RepositoryNotFoundError, RevisionNotFoundError, RemoteEntryNotFoundError) as e:
        raise DrafterError(f"not found on the Hub ({type(e).__name__})") from None
    except (LocalEntryNotFoundError, ConnectionError):
        # offline mode or no network, and not cached (a full disk, an OSError too, is no
        # reason to fall back: it stops the command in one line)
        raise Offline("the Hub cannot be reached and nothing is cached") from None
    except HfHubHTTPError as e:  # the Hub failing (a 5xx): as unreachable
        raise Offline(one_line(e)) from None


def config_misfit(folder: Path, kind: str, target) -> str | None:
    """Why the drafter whose ``config.json`` lies in ``folder`` cannot serve ``target``, by its
    type's own loader, before its weights are fetched; None when it fits. The loaders check a
    config before they read weights, so a folder holding the config alone is refused for the
    config, or, when it fits, for the missing weights."""
    found = drafter_kind(folder)
    if found != kind:
        name = KIND_NAMES.get(found, found)
        return f"its config.json is a {name} drafter's, not {KIND_NAMES.get(kind, kind)}"
    if any(folder.glob("*.safetensors")):
        return None  # fetched before: the command's load checks it in full
    try:
        create_drafter(folder, target)
    except DrafterError as e:
        return None if "no *.safetensors" in str(e) else _without_folder(str(e), folder)
    return None


def _without_folder(message: str, folder: Path) -> str:
    """A loader's message less the cache path it starts with (the line names the repo)."""
    return message.removeprefix(f"{folder}: ").removeprefix(f"{folder / 'config.json'}: ")


def _own_head(model: str) -> Path:
    """The target's own folder as its MTP drafter, when its checkpoint carries the head;
    DrafterError saying where the head is otherwise (mlx-community conversions drop it)."""
    try:
        folder = resolve_path(model)
    except Exception:  # a .gguf file, an unreachable repo: no folder to read a head from
        folder = None
    if folder is not None and drafter_kind(folder) == MTP:
        return folder
    raise DrafterError(
        "this copy has no MTP head (conversions drop it): pass the original checkpoint's "
        "folder as --drafter"
    )
