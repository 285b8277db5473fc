"""The autotune profile store: the best beam shape per chip + backend + model + drafter +
dtype/quantization (+ `` | sampling`` for the one tuned with ``--temp``), in one JSON file
(``$REDRAFTER_CACHE/profiles.json``, default ``~/.cache/redrafter-mlx``) written atomically.
A stale or unreadable profile is ignored with a warning, never an error.

Format version 2 adds ``bands`` to an entry: the shape per context-length band
(:class:`ContextBands`; ``null``: plain decoding there), since a verified tree costs more per
cached token than a one-token step does. A version-1 entry (one shape) still loads, as one band.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from dataclasses import astuple, dataclass, replace
from pathlib import Path

from redrafter_mlx.core.atomic import write_text
from redrafter_mlx.core.decode.accept import is_greedy
from redrafter_mlx.core.decode.adaptive import Adaptive
from redrafter_mlx.core.decode.decoder import Decoding
from redrafter_mlx.core.decode.llm import compute_dtype
from redrafter_mlx.core.decode.mode import Mode
from redrafter_mlx.core.decode.shape import SHAPE_FIELDS, BeamShape
from redrafter_mlx.core.decode.source import new_part
from redrafter_mlx.core.drafters.beam_search import check_width
from redrafter_mlx.core.errors import ConfigError
from redrafter_mlx.core.paths import cache_dir
from redrafter_mlx.tuning.device import chip_info

PROFILE_VERSION = 2
LOADABLE_VERSIONS = (1, 2)  # 1: one shape per entry, no bands


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def profile_key(
    chip: dict, model_id: str, drafter_id: str | None, dtype: str, quantization: object
) -> str:
    """One string key: chip (+ BLAS on CPU), backend, model, drafter, dtype/quantization."""
    quant = "none" if not quantization else json.dumps(quantization, sort_keys=True)
    parts = [
        chip.get("chip"),
        chip.get("blas"),
        chip.get("backend"),
        model_id,
        drafter_id,
        dtype,
        quant,
    ]
    return " | ".join(str(p) for p in parts if p is not None)


def fingerprint(*paths: str | None) -> str:
    """Size + mtime of the weight files under ``paths``: changes when a model is retrained."""
    h = hashlib.sha1()
    for p in paths:
        if p is None:
            continue
        path = Path(p)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        for f in files:
            try:
                st = f.stat()
                h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
            except OSError:
                h.update(f"{f}:missing;".encode())
    return h.hexdigest()[:16]


def runtime_identity(runtime) -> tuple[str, str]:
    """(profile key, fingerprint) of a loaded runtime."""
    dtype = str(compute_dtype(runtime.model)).replace("mlx.core.", "")
    quant = runtime.config.get("quantization") if isinstance(runtime.config, dict) else None
    key = profile_key(chip_info(), str(runtime.model_id), runtime.drafter_id, dtype, quant)
    return key, fingerprint(runtime.model_id, runtime.drafter_id)


def store_path() -> Path:
    return cache_dir() / "profiles.json"


def read_store(path: Path | None = None) -> dict:
    """The profile store ``{"version", "profiles": {key: entry}}``; raises ValueError if corrupt."""
    path = path or store_path()
    if not path.exists():
        return {"version": PROFILE_VERSION, "profiles": {}}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable profile store ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("profiles"), dict):
        raise ValueError(f"{path}: not a profile store (no 'profiles' object)")
    return data


def write_store(data: dict, path: Path | None = None) -> None:
    """Write the store atomically: a temp file in the same folder, then a rename."""
    write_text(path or store_path(), json.dumps(data, indent=2, default=str) + "\n")


def save_profile(key: str, entry: dict, path: Path | None = None) -> None:
    """Add or replace one profile; an unreadable store is replaced (with a warning)."""
    try:
        data = read_store(path)
    except ValueError as e:
        warn(f"{e}; starting a new store")
        data = {"version": PROFILE_VERSION, "profiles": {}}
    data["version"] = PROFILE_VERSION
    data["profiles"][key] = entry
    write_store(data, path)


def entry_shape(entry: dict) -> BeamShape:
    """A stored profile's shape; raises (TypeError, KeyError, ValueError...) when malformed."""
    return stored_shape(entry["shape"])


def stored_shape(values: list) -> BeamShape:
    """A shape as stored: [W, L], [W, L, p], [W, L, p, S] or [W, L, p, S, K]."""
    width, length, *more = values
    floor = float(more[0]) if more else 0.0
    search = int(more[1]) if len(more) > 1 else 0
    lookup = int(more[2]) if len(more) > 2 else 0
    return BeamShape(int(width), int(length), floor, search, lookup)


def store_shape(shape: BeamShape) -> list:
    """``shape`` as a profile stores it (:func:`stored_shape` reads it back)."""
    return [shape.width, shape.length, shape.min_prob, shape.searched, shape.lookup]


@dataclass(frozen=True)
class ContextBands:
    """The beam shape per context-length band: ``bands`` is ``((start, shape), ...)`` in
    increasing ``start``, the first at 0; a band holds from its start to the next one's, and a
    None shape means plain decoding there (no shape was faster than one token per step)."""

    bands: tuple[tuple[int, BeamShape | None], ...]

    def __post_init__(self):
        starts = [start for start, _ in self.bands]
        if not starts or starts[0] != 0 or starts != sorted(set(starts)):
            raise ValueError(f"bands must start at 0 and increase: {starts}")

    @classmethod
    def single(cls, shape: BeamShape | None) -> ContextBands:
        return cls(((0, shape),))

    @property
    def starts(self) -> tuple[int, ...]:
        return tuple(start for start, _ in self.bands)

    def at(self, context: int) -> BeamShape | None:
        """The shape for an answer after ``context`` tokens (None: plain decoding)."""
        return next(shape for start, shape in reversed(self.bands) if context >= start)

    def to_json(self) -> list:
        return [[start, None if s is None else store_shape(s)] for start, s in self.bands]

    @classmethod
    def from_json(cls, rows: list) -> ContextBands:
        return cls(tuple((int(start), None if s is None else stored_shape(s)) for start, s in rows))

    def describe(self) -> str:
        parts = [
            f"{start}+: {'plain decoding' if s is None else s.label}" for start, s in self.bands
        ]
        return ", ".join(parts)


def entry_bands(entry: dict) -> ContextBands:
    """A stored profile's bands; a version-1 entry (or one without bands) is one band."""
    rows = entry.get("bands")
    return ContextBands.single(entry_shape(entry)) if rows is None else ContextBands.from_json(rows)


def find_profile(key: str, fp: str, path: Path | None = None) -> BeamShape | None:
    """The stored shape for ``key``, or None (warning on stderr when stale or corrupt)."""
    entry = _find_entry(key, fp, path)
    try:
        return None if entry is None else entry_shape(entry)
    except Exception as e:  # a profile must never break generation
        warn(f"ignoring the autotune profile: {e}")
        return None


def find_bands(key: str, fp: str, path: Path | None = None) -> ContextBands | None:
    """The stored bands for ``key`` (one band for a version-1 profile), or None."""
    entry = _find_entry(key, fp, path, quiet=True)
    try:
        return None if entry is None else entry_bands(entry)
    except Exception as e:
        warn(f"ignoring the autotune profile's context bands: {e}")
        return None


def _find_entry(key: str, fp: str, path: Path | None, *, quiet: bool = False) -> dict | None:
    """The stored entry for ``key``, or None (a warning when stale or corrupt, unless
    ``quiet``: :func:`find_profile` has said it already)."""
    try:
        data = read_store(path)
        entry = data["profiles"].get(key)
        if entry is None:
            return None
        if data.get("version") not in LOADABLE_VERSIONS or entry.get("fingerprint") != fp:
            if not quiet:
                warn(
                    "ignoring a stale autotune profile (model or drafter changed): rerun "
                    "`redrafter-mlx autotune`"
                )
            return None
        return entry
    except Exception as e:  # a profile must never break generation
        if not quiet:
            warn(f"ignoring the autotune profile: {e}")
        return None


SAMPLING = " | sampling"  # suffix of the profile key tuned with --temp > 0


def lookup_profile(runtime, *, temp: float = 0.0) -> tuple[BeamShape, str] | None:
    """The autotuned shape for this chip + model + drafter and where it came from, or None.
    A sampling ``temp``: the profile tuned at a temperature if there is one, else the greedy
    one (the one place a temperature picks a profile)."""
    sampling = not is_greedy(temp)
    if runtime.drafter_id is None:
        return None
    try:
        key, fp = runtime_identity(runtime)
    except Exception as e:
        warn(f"ignoring the autotune profile: {e}")
        return None
    if sampling and (shape := find_profile(key + SAMPLING, fp)) is not None:
        return shape, "autotune profile, sampling"
    shape = find_profile(key, fp)
    return None if shape is None else (shape, "autotune profile")


def resolve_shape(
    runtime, *, overrides: dict | None = None, temp: float = 0.0
) -> tuple[BeamShape, str]:
    """The beam shape to use and where it came from. Each field in ``overrides`` (BeamShape
    field names: ``width``, ``length``, ``min_prob``, ``search_width``) overrides its field; the
    others come from the autotune profile (if this chip, model and drafter have one; at a
    sampling ``temp`` the one tuned for sampling, if any), else from the default. A profile the
    drafter cannot search (more beams than its vocabulary) is ignored with a warning."""
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    if len(given) < len(SHAPE_FIELDS):
        found = lookup_profile(runtime, temp=temp)
        if found and not _searchable(runtime, found[0]):
            found = None
        base, source = found or (runtime.default_shape, "default")
        if not given:
            return base, source
        source = f"flags + {source}"
    else:  # every field given: no profile read (nor its warnings)
        base, source = runtime.default_shape, "flags"
    fields = dict(zip(SHAPE_FIELDS, astuple(base), strict=True)) | given
    try:
        return BeamShape(**fields), source
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _searchable(runtime, shape: BeamShape) -> bool:
    """Whether ``runtime``'s drafter can search ``shape``; warns when it cannot."""
    if runtime.drafter is None:
        return True
    try:
        check_width(runtime.drafter.drafter, shape.searched)
    except ValueError as e:
        warn(
            f"ignoring the autotune profile {shape.describe()}: {e}; rerun `redrafter-mlx autotune`"
        )
        return False
    return True


def lookup_bands(runtime, *, temp: float = 0.0) -> ContextBands | None:
    """The autotuned shape per context band (:func:`lookup_profile`'s profile), or None."""
    sampling = not is_greedy(temp)
    if runtime.drafter_id is None:
        return None
    try:
        key, fp = runtime_identity(runtime)
    except Exception:
        return None  # lookup_profile has warned
    if sampling and (bands := find_bands(key + SAMPLING, fp)) is not None:
        return bands
    return find_bands(key, fp)


def decoding_by_context(
    bands: ContextBands, decoding: Decoding, warm_up: Callable[[Decoding], None]
) -> Callable[[int], Decoding]:
    """Context length -> the decoding of an answer there: ``decoding`` with the band's shape
    (its sampler kept), or plain decoding where the band has none. Each new decoding is warmed
    up (``warm_up``, e.g. ``Decoder.warm_up``) the first time a band asks for it, between
    answers. What ``Session.by_context`` takes."""
    made: dict[BeamShape | None, Decoding] = {decoding.shape: decoding}

    def pick(context: int) -> Decoding:
        shape = bands.at(context)
        if shape not in made:
            if shape is None:
                made[shape] = replace(decoding, mode=Mode.AUTOREGRESSIVE)
            else:
                made[shape] = replace(decoding, shape=shape)
            warm_up(made[shape])
        return made[shape]

    return pick


def default_bands(plan, shape: BeamShape) -> ContextBands:
    """The bands of a decoding with no profile: ``shape`` (the plan's default) up to the
    plan's ``plain_from``, plain decoding from there (one band where the plan has none)."""
    if plan.plain_from is None:
        return ContextBands.single(shape)
    return ContextBands(((0, shape), (plan.plain_from, None)))


def context_bands(
    runtime, shape: BeamShape, source: str, *, temp: float = 0.0
) -> ContextBands | None:
    """The shape per context length of a decoding at ``shape`` that came from ``source``
    (:func:`resolve_shape`'s), when no flag chose it: the autotune profile's bands for the
    profile's shape, the plan's :func:`default_bands` for the default shape (plain decoding at
    long contexts, where a tree costs more than it saves). None: ``shape`` at every length."""
    if source.startswith("autotune profile"):
        bands = lookup_bands(runtime, temp=temp)
    elif source == "default":
        bands = default_bands(runtime.plan, shape)
    else:
        return None
    return None if bands is None or bands == ContextBands.single(shape) else bands


def follow_context(session, runtime, source: str, *, temp: float = 0.0) -> ContextBands | None:
    """Let ``session`` pick each answer's shape by its context length when it speculates with
    a shape no flag chose (:func:`context_bands`). Returns the bands it follows (None: one
    decoding for every answer). With the plan's default bands, where they decode plainly the
    session's answers also try the default shape and keep the faster, step block by step
    block (:mod:`~redrafter_mlx.core.decode.adaptive`), where the session and its drafter allow."""
    if not session.decoding.mode.speculative:
        return None
    bands = context_bands(runtime, session.decoding.shape, source, temp=temp)
    if bands is not None:
        session.by_context = decoding_by_context(bands, session.decoding, runtime.decoder.warm_up)
        start = runtime.plan.plain_from
        if source == "default" and start is not None and adapts(session):
            plain = session.by_context(start)
            session.adaptive = Adaptive(session.decoding, plain, start)
    return bands


def adapts(session) -> bool:
    """Whether ``session`` may switch modes mid-answer: not a sharded target's (its ranks
    replay one decoding), nor with a drafter that keeps a part per sequence (plain steps
    record no taps for it)."""
    return session.can_adapt and new_part(session.decoder.drafter) is None
