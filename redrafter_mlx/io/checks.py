"""Checks of a target model folder before and after mlx-lm builds it: one-line
:class:`LoadError` messages naming the file and the problem (used by loading and converting).
"""

from __future__ import annotations

import importlib
import json
import re
import struct
from pathlib import Path
from typing import Any

import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

from redrafter_mlx.core.decode import llm
from redrafter_mlx.core.errors import LoadError

# What a layer's cache may be (mlx-lm's ``make_cache``): plain and sliding-window attention,
# whose K/V roll back, and recurrent state, which the verify forward runs along the tree.
SUPPORTED_CACHES = (KVCache, RotatingKVCache, ArraysCache)
# Families whose recurrent layers the tree verification is tested on (tests/test_hybrids.py,
# mlx-lm's own classes): their mixers take the state as mlx-lm's ``ArraysCache`` and run a
# sequence from it. Other recurrent families (RWKV-7, Kimi Linear, RecurrentGemma, ...) may
# keep state elsewhere, so they are refused rather than risk an inexact answer.
VERIFIED_RECURRENT = frozenset({
    "qwen3_5", "qwen3_5_moe", "qwen3_next", "lfm2", "lfm2_moe", "granitemoehybrid",
    "nemotron_h", "falcon_h1", "mamba", "mamba2", "jamba",
})  # fmt: skip
# A layer's submodules that are not what makes it recurrent (named by the refusal otherwise)
COMMON_PARTS = re.compile(r"norm|mlp|moe|feed_?forward|expert|embed|^self_attn$|^attention$", re.I)


def one_line(text: object) -> str:
    """Collapse an exception message to a single line."""
    return " ".join(str(text).split())


def looks_like_hub_id(text: str) -> bool:
    """True for ``owner/name`` strings that are not local paths."""
    if text.startswith((".", "/", "~")) or text.count("/") != 1:
        return False
    return re.fullmatch(r"[\w.-]+/[\w.-]+", text) is not None


def check_safetensors(path: Path) -> dict:
    """Raise LoadError if ``path`` is not a complete safetensors file (checks header + size);
    its header (tensor name -> dtype, shape, offsets) when it is."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise LoadError(f"{path}: truncated safetensors file (no header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise LoadError(f"{path}: truncated safetensors file (header cut off)")
            header = json.loads(f.read(n))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoadError(f"{path}: corrupt safetensors file ({one_line(e)})") from e
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    if 8 + n + max(ends, default=0) > size:
        raise LoadError(
            f"{path}: truncated safetensors file ({size} bytes, needs {8 + n + max(ends)})"
        )
    return header


def resolve_path(path_or_repo: str | Path) -> Path:
    """A local folder, or a Hugging Face hub id downloaded (the files mlx-lm's loader fetches)."""
    path = Path(path_or_repo).expanduser()
    if path.exists():
        return path
    if not looks_like_hub_id(str(path_or_repo)):
        raise LoadError(f"{path_or_repo}: no such file or directory")
    from huggingface_hub import snapshot_download
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    try:
        return Path(snapshot_download(str(path_or_repo), allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except Exception as e:  # hub errors come in many types
        raise LoadError(
            f"{path_or_repo}: not a local path and not downloadable ({one_line(e)})"
        ) from e


def read_config(path: Path) -> dict[str, Any]:
    """Read and sanity-check ``config.json`` of a model folder."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise LoadError(f"{cfg_file}: missing config.json")
    from mlx_lm.utils import load_config

    try:
        settings = json.loads(cfg_file.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoadError(f"{cfg_file}: not valid JSON ({one_line(e)})") from e
    if not isinstance(settings, dict):  # mlx-lm and every check below read keys
        kind = type(settings).__name__
        raise LoadError(f"{cfg_file}: expected a JSON object of settings, found a {kind}")
    config = load_config(path)
    check_attention(config, cfg_file)
    check_layers(build_empty(config, cfg_file), config, cfg_file)
    return config


def model_classes(config: dict[str, Any], where: Path) -> tuple[type, type]:
    """mlx-lm's ``(Model, ModelArgs)`` classes for ``config``'s ``model_type``, remapped as
    mlx-lm's loader remaps it (by architecture, then by model type)."""
    from mlx_lm.utils import MODEL_ARCHITECTURE_REMAPPING, MODEL_REMAPPING

    model_type = config.get("model_type")
    if not model_type:
        raise LoadError(f"{where}: unsupported architecture (no model_type)")
    architectures = config.get("architectures") or ()
    architectures = (architectures,) if isinstance(architectures, str) else architectures
    remapped = (MODEL_ARCHITECTURE_REMAPPING.get((model_type, a)) for a in architectures)
    module = next((m for m in remapped if m), None) or MODEL_REMAPPING.get(model_type, model_type)
    try:
        arch = importlib.import_module(f"mlx_lm.models.{module}")
    except ImportError as e:
        raise LoadError(
            f"{where}: unsupported architecture model_type={model_type!r} "
            f"(mlx-lm has no such model: {one_line(e)})"
        ) from e
    return arch.Model, arch.ModelArgs


def build_empty(config: dict[str, Any], where: Path) -> nn.Module:
    """The mlx-lm model ``config`` describes, with its (lazy, never evaluated) initial weights:
    its structure, before any weights are read."""
    model_class, args_class = model_classes(config, where)
    try:
        return model_class(args_class.from_dict(config))
    except Exception as e:  # a config mlx-lm cannot build from: missing or odd fields
        raise LoadError(f"{where}: unsupported architecture ({one_line(e)})") from e


def check_layers(model: nn.Module, config: dict[str, Any], where: Path) -> None:
    """Refuse a model with a layer whose cache (the model's own ``make_cache``) is neither
    attention K/V nor recurrent state (mlx-lm's ``ArraysCache``): chunked attention, for
    example, which ReDrafter's tree masks do not do."""
    try:
        layout = llm.cache_layout(model)
    except TypeError:
        pass
    else:
        model_type = config.get("model_type")
        if llm.slot_counts(layout)[1] and model_type not in VERIFIED_RECURRENT:
            raise LoadError(
                f"{where}: unsupported: {model_type} has recurrent layers that ReDrafter's tree "
                f"verification is not tested on (tested: {', '.join(sorted(VERIFIED_RECURRENT))})"
            )
        return
    caches = model.make_cache()
    for i, cache in enumerate(caches):
        parts = cache.caches if isinstance(cache, CacheList) else (cache,)
        name = next((type(c).__name__ for c in parts if not isinstance(c, SUPPORTED_CACHES)), None)
        if name is None:
            continue
        layers = getattr(model, "layers", None) or []
        kind = _layer_kind(layers[i]) if i < len(layers) else name
        what = (
            f"attention over chunks ({name}), which ReDrafter's tree masks do not do"
            if name == "ChunkedKVCache"
            else f"a layer cache ReDrafter cannot verify trees with ({name})"
        )
        raise LoadError(
            f"{where}: unsupported: {config.get('model_type')} layer {i} is {kind}, {what}; "
            "ReDrafter runs models whose layers are attention (full or sliding-window) or "
            "recurrent (Gated DeltaNet, Mamba, short convolution) layers"
        )


def _layer_kind(layer: nn.Module) -> str:
    """The class name of what makes ``layer`` special (e.g. GatedDeltaNet, MambaBlock): its
    first submodule that is no norm, MLP or attention; else the layer's own class."""
    if isinstance(layer, nn.Module):
        for name, child in layer.children().items():
            if isinstance(child, nn.Module) and not COMMON_PARTS.search(name):
                if not COMMON_PARTS.search(type(child).__name__):
                    return type(child).__name__
    return type(layer).__name__


def check_attention(config: dict[str, Any], where: Path) -> None:
    """Refuse dynamic RoPE scaling: it rescales by the sequence length, which a tree of
    per-token positions does not have."""
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    if kind == "dynamic":
        raise LoadError(f"{where}: unsupported: dynamic RoPE scaling (rope_scaling)")


def check_structure(model: nn.Module, where: Path) -> None:
    """Raise LoadError unless ``model`` has what the verify forward uses: ``model.model`` (or
    ``model.backbone``) with an embedding and ``layers`` (its own ``__call__`` runs the
    layers), and an output projection (``lm_head`` or a tied embedding)."""
    inner = getattr(model, "model", None) or getattr(model, "backbone", None)
    missing = []
    if inner is None:
        missing = ["model"]
    else:
        if not (hasattr(inner, "embed_tokens") or hasattr(inner, "embeddings")):
            missing.append("model.embed_tokens")
        if not hasattr(inner, "layers"):
            missing.append("model.layers")
    if not missing and not hasattr(model, "lm_head"):
        head_owner = getattr(model, "language_model", None)
        if not hasattr(head_owner, "lm_head") and not hasattr(llm.embedding(model), "as_linear"):
            missing.append("lm_head")
    if missing:
        raise LoadError(
            f"{where}: unsupported architecture (missing submodules: {', '.join(missing)})"
        )
