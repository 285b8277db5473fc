"""The extraction cache: a folder of ``.npz`` shards, one split each (``heldout`` / ``train``),
plus ``manifest.json`` (the settings it was made with, its shards, and where each split's
extraction goes on). Epochs and later runs read it instead of rerunning the target.

Legend: N tokens of a token stream, H target hidden size, k stored top-k log-probs.

A shard holds, per token: ``tokens (N,)``, ``hidden (N, H)`` f16 (the target's final-norm
hidden state), ``argmax (N,)`` (the target's next token), ``mask (N,)`` (assistant token),
``doc (N,)`` (which conversation), with ``--topk`` ``topk_ids`` / ``topk_logp (N, k)`` and,
for a layered drafter (``--context-layers``), ``taps (N, n H)`` f16: the tapped layers' RMS-
normalised outputs (``training/taps.py``).

``manifest["format"]`` versions the records: 1 (no ``format`` key: caches written before taps
existed) holds no ``taps``; 2 may. A format-1 cache serves a last-layer drafter as before and is
refused, in one line, for a layered one; a format this code does not know is refused.
"""

from __future__ import annotations

import fcntl
import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from redrafter_mlx.core.atomic import write_text, write_with
from redrafter_mlx.core.errors import TrainError
from redrafter_mlx.training.ranks import ONE, Ranks

FORMAT = 2  # the record format this code writes (see the module docstring)


def read_json(path: Path) -> dict:
    """The JSON object in ``path`` (a manifest, a checkpoint's state); a one-line TrainError
    when it is not one (ours are written whole, then renamed: a hand edit, or another tool's
    file)."""
    try:
        value = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise TrainError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise TrainError(f"{path}: not a JSON object")
    return value


@dataclass
class Cache:
    """A folder of extraction shards plus ``manifest.json`` (written atomically)."""

    root: Path
    manifest: dict
    # records of the data file read this run that were no usable conversation (not stored:
    # the caller says so; library code prints nothing of it)
    skipped_records: int = 0

    @classmethod
    def open(cls, root: Path, identity: dict) -> Cache:
        """The cache in ``root`` made with ``identity`` (the settings that shape its records),
        new if there is none; TrainError if it was made with other settings."""
        root.mkdir(parents=True, exist_ok=True)
        path = root / "manifest.json"
        if not path.exists():
            manifest = {"identity": identity, "shards": [], "next": {"heldout": 0, "train": 0}}
            return cls(root, {"format": FORMAT, **manifest})
        manifest = read_json(path)
        check_format(path, manifest, identity.get("context_layers"))
        if manifest["identity"] != identity:
            raise TrainError(
                f"{path} was extracted with other settings "
                f"({_differences(manifest['identity'], identity)}); use another "
                "--cache-dir, or the settings it was made with"
            )
        return cls(root, manifest)

    @classmethod
    def existing(cls, root: Path) -> Cache:
        """The cache already in ``root`` (no identity check); TrainError if there is none."""
        path = root / "manifest.json"
        if not path.exists():
            raise TrainError(f"{root}: no manifest.json (not a cache)")
        return cls(root, read_json(path))

    @contextmanager
    def writing(self, ranks: Ranks = ONE) -> Iterator[None]:
        """Hold the folder's extraction lock (one writer at a time; released if the process
        dies) and re-read the manifest, which another process may have extended. On several
        ranks rank 0 holds it for all of them."""
        with ExitStack() as held:
            error = None
            if ranks.lead:
                try:
                    held.enter_context(_locked(self.root / "extract.lock"))
                except TrainError as e:
                    error = e
            ranks.check(error)
            path = self.root / "manifest.json"
            if path.exists():
                self.manifest = read_json(path)
            yield

    def tokens(self, split: str) -> int:
        return sum(s["tokens"] for s in self.manifest["shards"] if s["split"] == split)

    def nbytes(self) -> int:
        return sum(s["bytes"] for s in self.manifest["shards"])

    def add_shard(self, split: str, arrays: dict[str, np.ndarray], next_conv: int) -> None:
        """Write ``arrays`` as the next shard of ``split``; a resumed extraction of it starts
        at conversation ``next_conv``."""
        name = f"{split}-{len(self.manifest['shards']):05d}.npz"
        entry = self.write_shard(name, split, arrays)
        self.append([entry], split, next_conv)

    def write_shard(self, name: str, split: str, arrays: dict[str, np.ndarray]) -> dict:
        """Write ``arrays`` as shard file ``name`` (not listed yet); its manifest entry."""
        write_with(self.root / name, lambda tmp: np.savez(tmp, **arrays))
        tokens, size = int(arrays["tokens"].shape[0]), (self.root / name).stat().st_size
        return {"file": name, "split": split, "tokens": tokens, "bytes": size}

    def append(self, entries: list[dict], split: str, next_conv: int, *, save=True) -> None:
        """List shard ``entries`` (written) in the manifest; a resumed extraction of ``split``
        starts at conversation ``next_conv``. ``save``: write the manifest (rank 0 does)."""
        self.manifest["shards"] += entries
        self.manifest["next"][split] = next_conv
        if save:
            write_text(self.root / "manifest.json", json.dumps(self.manifest, indent=1))

    def load(self, split: str, budget: int | None = None) -> dict[str, np.ndarray] | None:
        """Shards of ``split`` (up to ``budget`` tokens) concatenated, ``doc`` numbering
        sequences; None when there are none."""
        parts, have = [], 0
        for s in self.manifest["shards"]:
            if s["split"] == split and (budget is None or have < budget):
                parts.append(dict(np.load(self.root / s["file"])))
                have += s["tokens"]
        return join_docs(parts) if parts else None


def check_format(path: Path, manifest: dict, context_layers) -> None:
    """TrainError (one line) when the cache's record format cannot serve this run."""
    version = manifest.get("format", 1)
    if not isinstance(version, int) or version > FORMAT:
        raise TrainError(
            f"{path}: cache format {version!r}, newer than this version reads ({FORMAT}); "
            "use another --cache-dir, or the version that wrote it"
        )
    if version < 2 and context_layers:
        raise TrainError(
            f"{path}: cache format {version} (written before records kept tapped layers) "
            f"cannot train a drafter reading layers {context_layers}; use another "
            "--cache-dir (it is extracted anew), or leave out --context-layers"
        )


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` while the block runs; TrainError if it is held."""
    with open(path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise TrainError(
                f"{path.parent} is being extracted by another process; wait for it, "
                "or pass a --max-tokens the cache already holds to train on what is there"
            ) from None
        yield


def _differences(old: dict, new: dict) -> str:
    """``key: old there, new now`` for each setting that differs."""
    return ", ".join(
        f"{k}: {old.get(k)!r} there, {new.get(k)!r} now"
        for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k)
    )


def join_docs(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Concatenate token streams (the arrays they all have), renumbering ``doc`` so documents
    stay distinct across parts."""
    keys = set.intersection(*(set(p) for p in parts))
    offset, docs = 0, []
    for p in parts:
        docs.append(p["doc"] + offset)
        offset = int(docs[-1].max()) + 1
    joined = {k: np.concatenate([p[k] for p in parts]) for k in keys - {"doc"}}
    return {**joined, "doc": np.concatenate(docs)}
