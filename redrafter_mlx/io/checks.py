"""Checks of a target model folder before and after mlx-lm builds it: one-line
:class:`LoadError` messages naming the file and the problem (used by loading and converting).
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

import mlx.nn as nn

from redrafter_mlx.core.errors import LoadError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
ATTN_ATTRS = ("q_proj", "k_proj", "v_proj", "o_proj", "rope", "n_heads", "n_kv_heads", "scale")
LAYER_ATTRS = ("self_attn", "input_layernorm", "post_attention_layernorm", "mlp")


def one_line(text: object) -> str:
    """Collapse an exception message to a single line."""
    return " ".join(str(text).split())


def looks_like_hub_id(text: str) -> bool:
    """True for ``owner/name`` strings that are not local paths."""
    if text.startswith((".", "/", "~")) or text.count("/") != 1:
        return False
    return re.fullmatch(r"[\w.-]+/[\w.-]+", text) is not None


def check_safetensors(path: Path) -> None:
    """Raise LoadError if ``path`` is not a complete safetensors file (checks header + size)."""
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


def resolve_path(path_or_repo: str | Path) -> Path:
    """A local folder, or a Hugging Face hub id downloaded with mlx-lm's ``_download``."""
    path = Path(path_or_repo).expanduser()
    if path.exists():
        return path
    if not looks_like_hub_id(str(path_or_repo)):
        raise LoadError(f"{path_or_repo}: no such file or directory")
    from mlx_lm.utils import _download

    try:
        return _download(str(path_or_repo))
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
        config = load_config(path)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoadError(f"{cfg_file}: not valid JSON ({one_line(e)})") from e
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise LoadError(
            f"{cfg_file}: unsupported architecture model_type={model_type!r} "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    check_attention(config, cfg_file)
    return config


def check_attention(config: dict[str, Any], where: Path) -> None:
    """Refuse what the verify forward (explicit masks, per-token RoPE offsets) does not do:
    sliding-window layers and dynamic RoPE scaling (it needs the sequence length)."""
    if "sliding_attention" in (config.get("layer_types") or []):
        raise LoadError(f"{where}: unsupported: sliding-window attention layers (layer_types)")
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    if kind == "dynamic":
        raise LoadError(f"{where}: unsupported: dynamic RoPE scaling (rope_scaling)")


def check_structure(model: nn.Module, where: Path) -> None:
    """Raise LoadError unless ``model`` has the Llama-shaped submodules the verify forward uses."""
    inner = getattr(model, "model", None)
    missing = [a for a in ("embed_tokens", "layers", "norm") if not hasattr(inner, a)]
    if not missing:
        layer = inner.layers[0] if inner.layers else None
        missing += [a for a in LAYER_ATTRS if not hasattr(layer, a)]
        attn = getattr(layer, "self_attn", None)
        missing += [f"self_attn.{a}" for a in ATTN_ATTRS if not hasattr(attn, a)]
    tied = getattr(getattr(model, "args", None), "tie_word_embeddings", False)
    if not hasattr(model, "lm_head") and not tied:
        missing.append("lm_head")
    if missing:
        raise LoadError(
            f"{where}: unsupported architecture (missing submodules: {', '.join(missing)})"
        )
