"""Which drafter a loaded target uses, and why: :func:`find_drafter` returns a
:class:`DrafterChoice` (a folder or None, and one line of reason).

Without ``--drafter`` the sources are tried in this order:

1. one trained on this machine for this model: ``train`` records every drafter it writes in
   the registry ``$REDRAFTER_CACHE/drafters.json`` (:func:`record_trained`, under a lock),
   newest first;
2. one shipped with the model: a ``redrafter/`` folder in the model's folder or Hub repository;
3. the drafter this package ships (``io/embedded.py``), made for the embedded SmolLM2: for any
   model its ``target.json`` matches, as a trained drafter's does (the embedded model's
   conversion at any path, its GGUF converted anew to float32 or float16);
4. none: lookup beams only.

A source that cannot be used (a registry that is no ``{"drafters": [...]}``, an entry without
a folder path or identity, a folder that holds no drafter: a model, a config alone, truncated
weights) is skipped for the next one and named in :attr:`DrafterChoice.skipped` (commands say
it in one line); it never stops a command.

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

import contextlib
import fcntl
import hashlib
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

from redrafter_mlx.core.atomic import os_error_text, write_text
from redrafter_mlx.core.decode.llm import target_dims
from redrafter_mlx.core.drafters import checked
from redrafter_mlx.core.drafters.redrafter import DrafterArgs, tensor_shapes
from redrafter_mlx.core.errors import DrafterError, LoadError
from redrafter_mlx.core.paths import cache_dir
from redrafter_mlx.io import drafter_types
from redrafter_mlx.io.checks import check_safetensors, looks_like_hub_id, one_line, resolve_path
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
    """The drafter folder a command uses (None: none) and why, in words; ``skipped``: the
    sources discovery could not use (a broken registry entry, a folder that holds no
    drafter), each ``what: why``."""

    path: Path | None
    reason: str
    skipped: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line for stderr: ``drafter: PATH (why)`` or ``drafter: none (why): ...``."""
        if self.path is None:
            return f"drafter: none ({self.reason}): lookup beams only"
        return f"drafter: {self.path} ({self.reason})"

    def skipped_line(self) -> str | None:
        """One line for stderr naming what discovery skipped and why; None when nothing was."""
        if not self.skipped:
            return None
        n = len(self.skipped)
        return f"note: drafter discovery skipped {n} unusable source{'s' * (n > 1)}: " + (
            "; ".join(self.skipped)
        )

    def as_json(self) -> dict:
        found = {"path": None if self.path is None else str(self.path), "reason": self.reason}
        return found | ({"skipped": list(self.skipped)} if self.skipped else {})


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
    given: str | None, *, model: str, target, config: dict, tokenizer
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
    skipped: list[str] = []
    sources = (_trained_here, _shipped, _packaged)
    for found in (source(model, identity, refused, skipped) for source in sources):
        if found is not None:
            return replace(found, skipped=tuple(skipped))
    reason = "none trained here or shipped with this model"
    return DrafterChoice(None, "; ".join([reason, *refused]), tuple(skipped))


def mismatch(folder: Path, identity: ModelIdentity) -> str | None:
    """Why the drafter in ``folder`` cannot serve ``identity`` (its sizes in ``config.json``,
    its ``target.json`` when it has one), or None."""
    try:
        config = json.loads((folder / "config.json").read_text())
        found = drafter_types.declared(config) if isinstance(config, dict) else None
        if found and found[1].kind is None:  # its type, not its sizes, is what keeps it out
            return drafter_types.refusal(*found)
        sizes = tuple(checked.sizes(config, "hidden_size", "vocab_size"))
    except (OSError, ValueError, KeyError, TypeError):  # DrafterError is a ValueError
        return None  # not a readable drafter, or a size no integer: its loader says which
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


def _trained_here(
    model: str, identity: ModelIdentity, refused: list[str], skipped: list[str]
) -> DrafterChoice | None:
    """The newest registry entry for ``identity`` whose folder still holds a drafter; an
    entry recorded under this model's name but for another identity goes into ``refused``,
    one that cannot be used (malformed, its folder no drafter) into ``skipped``."""
    for entry in reversed(read_registry(skipped)):
        path = Path(entry["path"]).expanduser()
        if not path.exists():
            continue  # removed since it was trained: nothing to say
        if identity.differs_from(entry["identity"]) is not None:
            if entry.get("model") == model:
                refused.append(f"refused {path}: trained for another model under the name {model}")
            continue
        if problem := drafter_problem(path):
            skipped.append(f"{path} (from {registry_path()}): {problem}")
            continue
        return DrafterChoice(path, f"trained here for this model, {entry.get('written', '?')}")
    return None


def _shipped(
    model: str, identity: ModelIdentity, refused: list[str], skipped: list[str]
) -> DrafterChoice | None:
    """The ``redrafter/`` folder of the model's folder or Hub repository, if it matches."""
    root = _model_root(model)
    folder = None if root is None else root / SHIPPED_DIR
    if folder is None or not folder.exists():
        return None
    if problem := drafter_problem(folder):
        skipped.append(f"{folder}: {problem}")
        return None
    if problem := mismatch(folder, identity):
        refused.append(f"refused {folder}: {problem}")
        return None
    return DrafterChoice(folder, f"shipped with the model ({SHIPPED_DIR}/)")


def _packaged(
    model: str, identity: ModelIdentity, refused: list[str], skipped: list[str]
) -> DrafterChoice | None:
    """The drafter this package ships, when the identity its ``target.json`` records is this
    model's; None otherwise, quietly: it was made for one model, and every other is not it."""
    folder = default_drafter_path()
    recorded = None if folder is None else read_target_file(folder)
    if recorded is None or identity.differs_from(recorded) is not None:
        return None
    return DrafterChoice(folder, f"shipped with redrafter-mlx for {recorded.get('model', '?')}")


def drafter_problem(folder: Path) -> str | None:
    """Why ``folder`` holds no loadable drafter, in words (no weights are read: its config, and
    the safetensors header checked against the tensors that config needs); None when it does."""
    if not folder.is_dir():
        return "not a folder"
    config_file, weights_file = folder / "config.json", folder / "model.safetensors"
    missing = [f.name for f in (config_file, weights_file) if not f.is_file()]
    if missing:
        return f"not a drafter (no {' or '.join(missing)})"
    try:
        args = DrafterArgs.from_dict(json.loads(config_file.read_text()))
        header = check_safetensors(weights_file)
        stored = {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        return f"not a drafter ({one_line(os_error_text(e) if isinstance(e, OSError) else e)})"
    stored = {k: v for k, v in stored.items() if not k.startswith("emb_norm")}
    if stored != tensor_shapes(args):
        return "not a drafter (its model.safetensors does not hold a drafter's tensors)"
    return None


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


def read_registry(skipped: list[str] | None = None) -> list[dict]:
    """The registry's usable entries, oldest first (a folder path and an identity each); []
    when it is missing or unreadable: it only ever helps, so a broken one must not stop a
    command. What is left out is said in ``skipped`` (a file that is no registry, an entry
    that is no drafter's)."""
    path = registry_path()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        _note(skipped, f"{path}: unreadable ({one_line(e)})")
        return []
    entries = data.get("drafters") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        _note(skipped, f'{path}: not a drafters record ({{"drafters": [...]}} expected)')
        return []
    usable = [e for e in entries if _usable_entry(e)]
    if bad := len(entries) - len(usable):
        what = "entries" if bad > 1 else "entry"
        _note(skipped, f"{path}: {bad} malformed {what} (each needs a folder path and an identity)")
    return usable


def _usable_entry(entry: object) -> bool:
    """Whether a registry entry names a folder (a non-empty string) and an identity (an
    object): what :func:`_trained_here` reads."""
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("path"), str)
        and entry["path"].strip() != ""
        and isinstance(entry.get("identity"), dict)
    )


def _note(skipped: list[str] | None, text: str) -> None:
    if skipped is not None:
        skipped.append(text)


def identity_record(identity: ModelIdentity, model: str) -> dict:
    """What ``target.json`` holds: the identity and the model's name (for people)."""
    return {"model": model, **asdict(identity)}


def record_trained(folder: Path, identity: ModelIdentity, model: str, **extra) -> None:
    """:func:`write_target_file`, then :func:`register`."""
    write_target_file(folder, identity, model)
    register(folder, identity, model, **extra)


def write_target_file(folder: Path, identity: ModelIdentity, model: str) -> None:
    """Write ``folder/target.json``: the identity of the model it was made for (atomic)."""
    folder = Path(folder).expanduser().resolve()
    write_text(folder / TARGET_FILE, json.dumps(identity_record(identity, model), indent=2) + "\n")


def register(folder: Path, identity: ModelIdentity, model: str, **extra) -> None:
    """Add ``folder`` to the registry (replacing an older entry for the same folder): read,
    merged and replaced atomically under a lock, so that concurrent writers (two ``train``
    runs) lose no entry. ``train`` registers a drafter last, once its card is written."""
    folder = Path(folder).expanduser().resolve()
    written = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    entry = {"path": str(folder), "model": model, "identity": asdict(identity)}
    with _locked(registry_path()):
        entries = [e for e in read_registry() if e.get("path") != str(folder)]
        entries.append({**entry, "written": written, **extra})
        write_text(registry_path(), json.dumps({"drafters": entries}, indent=2) + "\n")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` + ``.lock`` (``flock``: released when the process
    ends, however it ends) while the block runs."""
    lock = path.with_name(path.name + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
