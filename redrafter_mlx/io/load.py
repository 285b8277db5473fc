"""Load a target model (mlx-lm format) and check it fits ReDrafter's verify forward.

Every failure is a :class:`LoadError` whose message is one line naming the file and the problem.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from redrafter_mlx.core.errors import ConversionError, LoadError
from redrafter_mlx.io.checks import (
    check_safetensors,
    check_structure,
    one_line,
    read_config,
    resolve_path,
)
from redrafter_mlx.io.embedded import cached_conversion

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def _load_weights(path: Path, prepare: Callable[[nn.Module], None] | None = None) -> nn.Module:
    from mlx_lm.utils import load_model

    files = sorted(path.glob("model*.safetensors"))
    if not files:
        raise LoadError(
            f"{path}: no model*.safetensors weights (convert it first: redrafter-mlx convert)"
        )
    for f in files:
        check_safetensors(f)
    try:
        model, _ = load_model(path, lazy=True)
    except ValueError as e:
        msg = one_line(e)
        if "not supported" in msg:
            raise LoadError(f"{path / 'config.json'}: unsupported architecture ({msg})") from e
        raise LoadError(f"{path}: weights do not match config.json ({msg})") from e
    except Exception as e:
        raise LoadError(f"{path}: cannot load weights ({one_line(e)})") from e
    check_structure(model, path)
    if prepare is not None:  # e.g. shard it: before its (lazy) weights are read
        prepare(model)
    try:
        mx.eval(model.parameters())
    except Exception as e:
        raise LoadError(f"{path}: cannot read weights ({one_line(e)})") from e
    return model


def _load_tokenizer(path: Path, config: dict[str, Any]):
    from mlx_lm.utils import load_tokenizer

    if not any((path / f).exists() for f in TOKENIZER_FILES):
        raise LoadError(f"{path}: no tokenizer files (tokenizer.json / tokenizer.model)")
    try:
        wrapper = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except Exception as e:
        raise LoadError(f"{path}: cannot load tokenizer ({one_line(e)})") from e
    # Prompt length is checked against the model's context where it matters, with a clear
    # error; transformers' own "sequence length is longer than..." warning only adds noise.
    hf = getattr(wrapper, "_tokenizer", None)
    if hasattr(hf, "model_max_length"):
        hf.model_max_length = 2**62
    return wrapper


def gguf_to_folder(path: Path) -> Path:
    """Convert a GGUF file once into the cache (see :mod:`redrafter_mlx.embedded`)."""
    try:
        return cached_conversion(path)
    except ConversionError as e:
        raise LoadError(str(e)) from e


def load_target(
    path_or_repo: str | Path,
    *,
    tokenizer: bool = True,
    prepare: Callable[[nn.Module], None] | None = None,
):
    """Load a target model: ``(model, tokenizer, config)``, parameters already evaluated.

    ``path_or_repo`` is an mlx-lm model folder, a Hugging Face hub id, or a ``.gguf`` file
    (converted once into the cache). With ``tokenizer=False`` the tokenizer is ``None``.
    ``prepare`` changes the model before its weights are read (``io/sharded.py`` shards it).
    """
    path = resolve_path(path_or_repo)
    if path.is_file() and path.suffix == ".gguf":
        path = gguf_to_folder(path)
    elif path.is_file():
        raise LoadError(f"{path}: expected a model folder or a .gguf file")
    config = read_config(path)
    model = _load_weights(path, prepare)
    tok = _load_tokenizer(path, config) if tokenizer else None
    return model, tok, config


def eos_ids(tokenizer) -> set[int]:
    """The token ids that end a generation (mlx-lm's wrapper, or a bare tokenizer's one id)."""
    return set(getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id])
