"""Which drafter a loaded target uses, and why: :func:`find_drafter` returns a
:class:`DrafterChoice` (a folder or None, and one line of reason).

Without ``--drafter`` the sources are tried in this order:

1. one trained on this machine for this model: ``train`` records every drafter it writes in
   the registry ``$REDRAFTER_CACHE/drafters.json`` (:func:`record_trained`), newest first;
2. one shipped with the model: a ``redrafter/`` folder in the model's folder or Hub repository;
3. the embedded SmolLM2's shipped drafter (``io/embedded.py``), for the embedded model;
4. none: lookup beams only.

``--drafter DIR`` or ``--drafter USER/NAME`` (a Hub id, downloaded once into the Hugging Face
cache and read from there offline) skips discovery; ``--drafter none`` turns it off.

How a drafter is matched to a model (:class:`ModelIdentity`), never by a name: its hidden size
and vocabulary size must equal the target's (or its weights cannot apply), and so must two
fingerprints: the tokenizer's (a hash of its token -> id table: the drafter's token ids mean
the same words) and the config's (a hash of ``config.json`` without the fields that only say
how the weights are stored: quantization and dtype). The 4-, 8- and 16-bit variants of a
model therefore share one identity and one drafter, while a different architecture or
tokenizer with the same sizes does not match. Fine-tunes of one base model that keep its
config and tokenizer share its identity too: weights are not compared (a quantized copy's
weights differ from the original's by design), so such a drafter still loads and drafts,
only perhaps with fewer tokens accepted.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from redrafter_mlx.core.atomic import write_text
from redrafter_mlx.core.errors import DrafterError, LoadError
from redrafter_mlx.core.llm import target_dims
from redrafter_mlx.core.paths import cache_dir
from redrafter_mlx.io.checks import looks_like_hub_id, resolve_path
from redrafter_mlx.io.embedded import default_drafter_path

# Config fields that say how weights are stored, not which model they are
STORAGE_FIELDS = frozenset(
    {"quantization", "quantization_config", "torch_dtype", "dtype", "_name_or_path"}
    | {"transformers_version"}
)
SHIPPED_DIR = "redrafter"  # a drafter shipped inside a model's folder or repository
TARGET_FILE = "target.json"  # in a drafter folder: the identity of the model it was made for
REGISTRY_NAME = "drafters.json"
OFF = "none"  # --drafter none


@dataclass(frozen=True)
class ModelIdentity:
    """What a drafter and its target must share (module docstring: how it is decided)."""

    hidden_size: int
    vocab_size: int
    config_sha: str
    tokenizer_sha: str

    @classmethod
    def of(cls, target, config: dict, tokenizer) -> ModelIdentity:
        hidden, vocab = target_dims(target)
        return cls(hidden, vocab, config_fingerprint(config), tokenizer_fingerprint(tokenizer))

    def differs_from(self, recorded: dict) -> str | None:
        """What of ``recorded`` (a ``target.json`` or registry identity) differs from this
        model, in words; None when it matches."""
        names = {"config_sha": "config", "tokenizer_sha": "tokenizer"}
        differ = [names.get(k, k) for k, v in asdict(self).items() if recorded.get(k) != v]
        return f"{' and '.join(differ)} differ" if differ else None


@dataclass(frozen=True)
class DrafterChoice:
    """The drafter folder a command uses (None: none) and why, in words."""

    path: Path | None
    reason: str

    def describe(self) -> str:
        """One line for stderr: ``drafter: PATH (why)`` or ``drafter: none (why): ...``."""
        if self.path is None:
            return f"drafter: none ({self.reason}): lookup beams only"
        return f"drafter: {self.path} ({self.reason})"

    def as_json(self) -> dict:
        return {"path": None if self.path is None else str(self.path), "reason": self.reason}


def config_fingerprint(config: dict) -> str:
    """A hash of ``config`` less :data:`STORAGE_FIELDS` (equal across quantized variants)."""
    kept = {k: v for k, v in config.items() if k not in STORAGE_FIELDS}
    return _sha(json.dumps(kept, sort_keys=True, default=str))


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of the tokenizer's token -> id table (added tokens included)."""
    vocab = tokenizer.get_vocab()
    return _sha(json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False))


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def find_drafter(
    given: str | None, *, model: str, target, config: dict, tokenizer, embedded: bool
) -> DrafterChoice:
    """The drafter for the target loaded from ``model`` (a folder, Hub id or .gguf): ``given``
    (``--drafter``: a folder, a Hub id, or ``none``), else the first match of the module
    docstring's sources. DrafterError (one line) for a given drafter made for another model."""
    if given is not None and given.strip().lower() == OFF:
        return DrafterChoice(None, "--drafter none: discovery off")
    identity = ModelIdentity.of(target, config, tokenizer)
    if given is not None:
        try:
            path = resolve_path(given)
        except LoadError as e:  # it names a model's loading otherwise
            raise DrafterError(f"--drafter {e}") from None
        if problem := mismatch(path, identity):
            raise DrafterError(f"--drafter {given}: {problem}")
        where = "a Hub id, from the Hugging Face cache" if not Path(given).exists() else "given"
        return DrafterChoice(path, f"--drafter, {where}")
    refused: list[str] = []
    for found in (_trained_here(model, identity, refused), _shipped(model, identity, refused)):
        if found is not None:
            return found
    if embedded and (shipped := default_drafter_path()) is not None:
        return DrafterChoice(shipped, "the embedded model's shipped drafter")
    reason = "none trained here or shipped with this model"
    return DrafterChoice(None, "; ".join([reason, *refused]))


def mismatch(folder: Path, identity: ModelIdentity) -> str | None:
    """Why the drafter in ``folder`` cannot serve ``identity`` (its sizes in ``config.json``,
    its ``target.json`` when it has one), or None."""
    try:
        config = json.loads((folder / "config.json").read_text())
        sizes = (config["hidden_size"], config["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # not a readable drafter: load_drafter says what is wrong with it
    if sizes != (identity.hidden_size, identity.vocab_size):
        return (
            f"made for hidden_size {sizes[0]} / vocab_size {sizes[1]}, but the model has "
            f"{identity.hidden_size} / {identity.vocab_size}"
        )
    recorded = read_target_file(folder)
    if recorded is not None and (differ := identity.differs_from(recorded)):
        return f"made for another model ({recorded.get('model', '?')}: {differ})"
    return None


def read_target_file(folder: Path) -> dict | None:
    """The identity a drafter folder records (``target.json``), or None without one."""
    try:
        recorded = json.loads((folder / TARGET_FILE).read_text())
    except (OSError, ValueError):
        return None
    return recorded if isinstance(recorded, dict) else None


def _trained_here(model: str, identity: ModelIdentity, refused: list[str]) -> DrafterChoice | None:
    """The newest registry entry for ``identity`` whose folder still holds a drafter; an
    entry recorded under this model's name but for another identity goes into ``refused``."""
    for entry in reversed(read_registry()):
        path = Path(entry.get("path", ""))
        if not (path / "config.json").is_file():
            continue
        if identity.differs_from(entry.get("identity", {})) is None:
            return DrafterChoice(path, f"trained here for this model, {entry.get('written', '?')}")
        if entry.get("model") == model:
            refused.append(f"refused {path}: trained for another model under the name {model}")
    return None


def _shipped(model: str, identity: ModelIdentity, refused: list[str]) -> DrafterChoice | None:
    """The ``redrafter/`` folder of the model's folder or Hub repository, if it matches."""
    root = _model_root(model)
    folder = None if root is None else root / SHIPPED_DIR
    if folder is None or not (folder / "config.json").is_file():
        return None
    if problem := mismatch(folder, identity):
        refused.append(f"refused {folder}: {problem}")
        return None
    return DrafterChoice(folder, f"shipped with the model ({SHIPPED_DIR}/)")


def _model_root(model: str) -> Path | None:
    """The local folder of ``model``: itself, or its Hub snapshot with the ``redrafter/``
    files fetched (from the cache when offline); None for a file or an unreachable repo."""
    path = Path(model).expanduser()
    if path.exists():
        return path if path.is_dir() else None
    if not looks_like_hub_id(model):
        return None
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model, allow_patterns=[f"{SHIPPED_DIR}/*"]))
    except Exception:  # offline without it in the cache, no such repo: nothing shipped
        return None


def registry_path() -> Path:
    return cache_dir() / REGISTRY_NAME


def read_registry() -> list[dict]:
    """The registry's entries, oldest first; [] when it is missing or unreadable (it only
    ever helps: a broken one must not stop a command)."""
    try:
        data = json.loads(registry_path().read_text())
    except (OSError, ValueError):
        return []
    entries = data.get("drafters") if isinstance(data, dict) else None
    return [e for e in entries or [] if isinstance(e, dict)]


def identity_record(identity: ModelIdentity, model: str) -> dict:
    """What ``target.json`` holds: the identity and the model's name (for people)."""
    return {"model": model, **asdict(identity)}


def record_trained(folder: Path, identity: ModelIdentity, model: str, **extra) -> None:
    """Write ``folder/target.json`` and add ``folder`` to the registry (replacing an older
    entry for the same folder); both written atomically."""
    folder = Path(folder).expanduser().resolve()
    write_text(folder / TARGET_FILE, json.dumps(identity_record(identity, model), indent=2) + "\n")
    written = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    entry = {"path": str(folder), "model": model, "identity": asdict(identity)}
    entries = [e for e in read_registry() if e.get("path") != str(folder)]
    entries.append({**entry, "written": written, **extra})
    write_text(registry_path(), json.dumps({"drafters": entries}, indent=2) + "\n")
