"""Conversion of HF folders / hub ids (safetensors or PyTorch .bin), GGUF files and ReDrafter
drafter checkpoints to this project's MLX folders (the `redrafter-mlx convert` command's work).

Outputs are written to a temporary sibling directory and renamed into place only on success.
Every failure is a :class:`ConversionError` whose message is one line naming the file.
"""

from __future__ import annotations

import contextlib
import json
import pickle
import shutil
import sys
import zipfile
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from redrafter_mlx.core.atomic import is_disk_full, staged_dir
from redrafter_mlx.core.drafters.redrafter import MODEL_TYPE as DRAFTER_TYPE
from redrafter_mlx.core.drafters.redrafter import Drafter, DrafterArgs, tensor_shapes
from redrafter_mlx.core.errors import ConversionError, LoadError
from redrafter_mlx.io.checks import (
    check_safetensors,
    check_structure,
    looks_like_hub_id,
    model_classes,
    one_line,
    read_config,
    resolve_path,
)

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
TOKENIZER_GLOBS = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "*.jinja",
    "chat_template.json",
)
HUB_PATTERNS = ["*.json", "tokenizer.model", "*.txt", "*.jinja"]


# ----------------------------------------------------------------------------------------------
# Output staging and progress


@contextlib.contextmanager
def staged_output(out: str | Path, *, force: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of ``out``; rename it to ``out`` on success, remove on failure."""
    if not str(out).strip():
        raise ConversionError("--out is empty: name the output folder")
    out = Path(out).expanduser().absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        _check_replaceable(out, force)
    try:
        with staged_dir(out) as tmp:  # removed on any failure: nothing half-written stays
            yield tmp
    except (OSError, RuntimeError) as e:
        if not is_disk_full(e, where=out.parent):
            raise
        raise ConversionError(f"{out}: no space left on the device (nothing was written)") from None


def _check_replaceable(out: Path, force: bool) -> None:
    """``--force`` replaces an earlier conversion's output (a folder with a config.json) and
    nothing else: never a file, the working folder or a folder above it."""
    if not force:
        raise ConversionError(f"{out}: output already exists (use --force to overwrite)")
    if not out.is_dir():
        raise ConversionError(f"{out}: is a file, not an earlier output folder")
    cwd = Path.cwd().resolve()
    if out.resolve() in (cwd, *cwd.parents):
        raise ConversionError(f"{out}: --force would replace the working folder or one above it")
    if not (out / "config.json").is_file():
        raise ConversionError(
            f"{out}: not an earlier output (no config.json); --force only replaces those"
        )


@contextlib.contextmanager
def progress(description: str, total: int | None) -> Iterator[Any]:
    """A rich progress bar on stderr; yields a callable ``advance(n=1)``."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    cols = [
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    ]
    with Progress(*cols, console=console, transient=True, disable=not console.is_terminal) as p:
        task = p.add_task(description, total=total)
        yield lambda n=1: p.advance(task, n)


# ----------------------------------------------------------------------------------------------
# PyTorch checkpoints without torch: a restricted unpickler over torch's zip format


class _Storage:
    """Stand-in for ``torch.<Type>Storage`` classes: only carries the numpy dtype."""

    def __init__(self, name: str, dtype: str) -> None:
        self.name, self.dtype = name, dtype


STORAGES = {
    f"{n}Storage": _Storage(f"{n}Storage", d)
    for n, d in [
        ("Float", "float32"),
        ("Double", "float64"),
        ("Half", "float16"),
        ("BFloat16", "bfloat16"),
        ("Long", "int64"),
        ("Int", "int32"),
        ("Short", "int16"),
        ("Char", "int8"),
        ("Byte", "uint8"),
        ("Bool", "bool"),
    ]
}


def _bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    return (raw.astype(np.uint32) << 16).view(np.float32)


def _rebuild_tensor(storage, offset, size, stride, *_args) -> np.ndarray:
    """``torch._utils._rebuild_tensor_v2`` for numpy: a strided view copied out of the storage."""
    itemsize = storage.dtype.itemsize
    if len(size) and min(size) == 0:
        return np.zeros(tuple(size), dtype=storage.dtype)
    view = np.lib.stride_tricks.as_strided(
        storage[offset:], shape=tuple(size), strides=tuple(s * itemsize for s in stride)
    )
    return np.array(view)


def _rebuild_parameter(data, *_args) -> np.ndarray:
    return data


REBUILD = "rebuild"
ALLOWED_GLOBALS = {
    ("torch._utils", "_rebuild_tensor_v2"): REBUILD,
    ("torch._utils", "_rebuild_tensor"): REBUILD,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("collections", "OrderedDict"): OrderedDict,
    **{("torch", name): s for name, s in STORAGES.items()},
}


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickle a torch zip checkpoint's ``data.pkl`` allowing only tensor-rebuild globals."""

    def __init__(self, file, archive: zipfile.ZipFile, prefix: str, source: Path) -> None:
        super().__init__(file)
        self.archive, self.prefix, self.source = archive, prefix, source
        self.storages: dict[str, tuple[np.ndarray, bool]] = {}
        self.bf16: set[int] = set()

    def find_class(self, module: str, name: str):
        fn = ALLOWED_GLOBALS.get((module, name))
        if fn is None:
            raise ConversionError(
                f"{self.source}: refusing to unpickle {module}.{name} (only tensors are allowed)"
            )
        return self.rebuild if fn == REBUILD else fn

    def rebuild(self, storage: tuple[np.ndarray, bool], *args) -> np.ndarray:
        """Rebuild a tensor; remembers which results came from bfloat16 storages."""
        arr = _rebuild_tensor(storage[0], *args)
        if storage[1]:
            self.bf16.add(id(arr))
        return arr

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise ConversionError(f"{self.source}: unsupported persistent id {pid!r:.60}")
        storage_type, key = pid[1], str(pid[2])
        if not isinstance(storage_type, _Storage):
            raise ConversionError(f"{self.source}: unsupported storage type {storage_type!r:.60}")
        if key not in self.storages:
            try:
                raw = self.archive.read(f"{self.prefix}data/{key}")
            except KeyError as e:
                raise ConversionError(f"{self.source}: missing tensor data entry {key}") from e
            if storage_type.dtype == "bfloat16":
                arr = _bf16_to_f32(np.frombuffer(raw, dtype="<u2"))
            else:
                arr = np.frombuffer(raw, dtype=np.dtype(storage_type.dtype).newbyteorder("<"))
            self.storages[key] = (arr, storage_type.dtype == "bfloat16")
        return self.storages[key]


def read_torch_checkpoint(path: Path) -> dict[str, mx.array]:
    """Read a PyTorch zip checkpoint (``torch.save`` format) into MLX arrays without torch."""
    if not zipfile.is_zipfile(path):
        raise ConversionError(
            f"{path}: not a zip-format PyTorch checkpoint (legacy or corrupt; re-save with "
            "torch>=1.6 or use safetensors)"
        )
    try:
        with zipfile.ZipFile(path) as archive:
            pkl = [n for n in archive.namelist() if n.endswith("data.pkl")]
            if not pkl:
                raise ConversionError(f"{path}: no data.pkl in the archive")
            prefix = pkl[0][: -len("data.pkl")]
            with archive.open(pkl[0]) as f:
                unpickler = RestrictedUnpickler(f, archive, prefix, path)
                obj = unpickler.load()
    except ConversionError:
        raise
    except Exception as e:
        raise ConversionError(f"{path}: cannot read PyTorch checkpoint ({one_line(e)})") from e
    if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        raise ConversionError(f"{path}: checkpoint is not a state dict")
    out = {}
    for k, v in obj.items():
        if not isinstance(v, np.ndarray):
            continue
        a = mx.array(v)
        out[k] = a.astype(mx.bfloat16) if id(v) in unpickler.bf16 else a
    return out


# ----------------------------------------------------------------------------------------------
# Hugging Face folders / hub ids


HUB_CONNECT_SECONDS = 3  # the hub answers in well under this when there is a network


def _fetch_hf(src: str) -> Path:
    """Local folder as is; a hub id through ``huggingface_hub.snapshot_download``, or from the
    hub cache alone when offline (``HF_HUB_OFFLINE``, or the hub cannot be reached: checked
    first, since huggingface_hub retries a dead network for ~25 s before failing)."""
    path = Path(src).expanduser()
    if path.exists():
        return path
    if not looks_like_hub_id(src):
        raise ConversionError(f"{src}: no such file or directory")
    from huggingface_hub import constants, list_repo_files, snapshot_download

    offline = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else _hub_unreachable()
    if offline:
        return _cached_snapshot(src, offline)
    try:
        files = list_repo_files(src)
        weights = (
            ["*.safetensors"]
            if any(f.endswith(".safetensors") for f in files)
            else ["*.bin", "*.pt"]
        )
        return Path(snapshot_download(src, allow_patterns=HUB_PATTERNS + weights))
    except Exception as e:
        raise ConversionError(
            f"{src}: cannot download from the Hugging Face hub ({one_line(e)})"
        ) from e


def _hub_unreachable() -> str | None:
    """Why the hub's endpoint cannot be reached (no DNS, no route, no answer in
    HUB_CONNECT_SECONDS), or None when it can."""
    import socket
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    endpoint = urlsplit(constants.ENDPOINT)
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=HUB_CONNECT_SECONDS).close()
    except OSError as e:
        return f"{endpoint.hostname} cannot be reached: {e.strerror or e}"
    return None


def _cached_snapshot(src: str, offline: str) -> Path:
    """``src`` from the local hub cache; ConversionError suggesting local input if absent."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(src, local_files_only=True))
    except Exception:
        raise ConversionError(
            f"{src}: not in the Hugging Face cache and offline ({offline}): convert a local "
            "model folder or a .gguf file instead (--src path/to/model)"
        ) from None


def read_hf_weights(path: Path) -> dict[str, mx.array]:
    """All tensors of a HF folder: ``model*.safetensors`` or ``pytorch_model*.bin``."""
    files = (
        sorted(path.glob("model*.safetensors"))
        or sorted(path.glob("*.safetensors"))
        or sorted(path.glob("pytorch_model*.bin"))
    )
    if not files:
        raise ConversionError(f"{path}: no *.safetensors or pytorch_model*.bin weights")
    weights: dict[str, mx.array] = {}
    with progress(f"reading {path.name}", len(files)) as advance:
        for f in files:
            if f.suffix == ".safetensors":
                try:
                    check_safetensors(f)
                    weights.update(mx.load(str(f)))
                except LoadError as e:
                    raise ConversionError(str(e)) from e
                except Exception as e:
                    raise ConversionError(f"{f}: unreadable safetensors ({one_line(e)})") from e
            else:
                weights.update(read_torch_checkpoint(f))
            advance()
    return weights


def _read_config(path: Path) -> dict[str, Any]:
    try:
        return read_config(path)
    except LoadError as e:
        raise ConversionError(str(e)) from e


def build_model(config: dict[str, Any], where: Path) -> nn.Module:
    """Instantiate the mlx-lm model for ``config`` and check its Llama shape."""
    try:
        model_class, args_class = model_classes(config, where)
        model = model_class(args_class.from_dict(config))
        check_structure(model, where)
    except LoadError as e:
        raise ConversionError(str(e)) from e
    except Exception as e:
        raise ConversionError(f"{where}: unsupported architecture ({one_line(e)})") from e
    return model


def cast_floats(weights: dict[str, mx.array], dtype: str) -> dict[str, mx.array]:
    """Cast floating-point tensors to ``dtype`` (quantized uint32 tensors are left alone)."""
    if dtype not in DTYPES:
        raise ConversionError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    target = DTYPES[dtype]
    return {
        k: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) else v
        for k, v in weights.items()
    }


def load_into(model: nn.Module, weights: dict[str, mx.array], where: Path) -> None:
    """Strict ``load_weights`` with a one-line error on missing/extra/mis-shaped tensors."""
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ConversionError(f"{where}: weights do not match config.json ({one_line(e)})") from e
    mx.eval(model.parameters())


def save_folder(out: Path, model: nn.Module, config: dict[str, Any]) -> None:
    """Write weights + config with mlx-lm's helpers."""
    from mlx_lm.utils import save_config, save_model

    save_model(out, model)
    save_config(dict(config), config_path=out / "config.json")


def copy_tokenizer(src: Path, out: Path) -> None:
    """Copy the tokenizer and generation config files next to the converted weights."""
    for pattern in TOKENIZER_GLOBS:
        for f in src.glob(pattern):
            shutil.copy(f, out / f.name)


def quantize_weights(model: nn.Module, config: dict, bits: int | None, group_size: int = 64):
    """Quantize with mlx-lm (affine); returns the new config."""
    if bits is None:
        return config
    if bits not in (4, 8):
        raise ConversionError(f"unsupported --quantize {bits} (choose 4 or 8)")
    from mlx_lm.utils import quantize_model

    with contextlib.redirect_stdout(sys.stderr):
        _, config = quantize_model(model, config, group_size=group_size, bits=bits)
    return config


def convert_hf(
    src: str | Path,
    out: str | Path,
    *,
    dtype: str = "float16",
    quantize: int | None = None,
    force: bool = False,
) -> Path:
    """Convert a HF folder or hub id (safetensors or .bin shards) to an mlx-lm folder."""
    path = _fetch_hf(str(src))
    config = _read_config(path)
    weights = read_hf_weights(path)
    # HF's default is untied; mlx-lm's llama default is tied (it would drop lm_head.weight)
    config.setdefault("tie_word_embeddings", "lm_head.weight" not in weights)
    model = build_model(config, path)
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    load_into(model, cast_floats(weights, dtype), path)
    config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    config["torch_dtype"] = dtype
    config = quantize_weights(model, config, quantize)
    with staged_output(out, force=force) as tmp:
        save_folder(tmp, model, config)
        copy_tokenizer(path, tmp)
    return Path(out)


# ----------------------------------------------------------------------------------------------
# GGUF


GGUF_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def gguf_name(name: str) -> str | None:
    """llama.cpp tensor name -> mlx-lm llama name (``None`` for tensors we drop)."""
    base, _, leaf = name.rpartition(".")
    if base == "token_embd":
        return f"model.embed_tokens.{leaf}"
    if base == "output_norm":
        return f"model.norm.{leaf}"
    if base == "output":
        return f"lm_head.{leaf}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in GGUF_NAMES:
        return f"model.layers.{parts[1]}.{GGUF_NAMES[parts[2]]}.{leaf}"
    return None


def _meta(meta: dict, key: str, default: Any = None) -> Any:
    v = meta.get(key, default)
    if isinstance(v, mx.array):
        return v.item() if v.ndim == 0 else v.tolist()
    return v


def read_gguf(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Read a GGUF file with MLX; one-line error when it is missing or unreadable."""
    if not path.is_file():
        raise ConversionError(f"{path}: no such file")
    if (magic := _magic(path)) != b"GGUF":
        raise ConversionError(f"{path}: unreadable GGUF (bad magic {magic!r})")
    try:
        return mx.load(str(path), return_metadata=True)
    except Exception as e:
        raise ConversionError(f"{path}: unreadable GGUF ({one_line(e)})") from e


def gguf_config(meta: dict, tensors: dict, path: Path) -> dict[str, Any]:
    """mlx-lm llama config.json from ``llama.*`` metadata."""
    arch = _meta(meta, "general.architecture")
    if arch != "llama":
        raise ConversionError(f"{path}: unsupported GGUF architecture {arch!r} (only llama)")
    if "rope_freqs.weight" in tensors:
        raise ConversionError(f"{path}: llama3-style rope_freqs scaling is not supported")
    try:
        hidden = int(_meta(meta, "llama.embedding_length"))
        heads = int(_meta(meta, "llama.attention.head_count"))
        config = {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": hidden,
            "intermediate_size": int(_meta(meta, "llama.feed_forward_length")),
            "num_hidden_layers": int(_meta(meta, "llama.block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(_meta(meta, "llama.attention.head_count_kv", heads)),
            "rms_norm_eps": float(_meta(meta, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": float(_meta(meta, "llama.rope.freq_base", 10000.0)),
            "max_position_embeddings": int(_meta(meta, "llama.context_length", 4096)),
            "vocab_size": int(tensors["token_embd.weight"].shape[0]),
            "tie_word_embeddings": "output.weight" not in tensors,
            "rope_traditional": False,
            "attention_bias": False,
            "mlp_bias": False,
        }
    except (KeyError, TypeError) as e:
        raise ConversionError(f"{path}: GGUF metadata lacks {one_line(e)}") from e
    if (hd := _meta(meta, "llama.attention.key_length")) and hd != hidden // heads:
        config["head_dim"] = int(hd)
    factor = _meta(meta, "llama.rope.scaling.factor")
    if factor and _meta(meta, "llama.rope.scaling.type", "none") == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(factor)}
    for key in ("bos", "eos"):
        if (tid := _meta(meta, f"tokenizer.ggml.{key}_token_id")) is not None:
            config[f"{key}_token_id"] = int(tid)
    return config


def unpermute_rows(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's per-head Q/K row permutation (interleaved -> half-split RoPE layout)."""
    d = w.shape[0]
    perm = mx.arange(d).reshape(n_heads, d // n_heads // 2, 2).swapaxes(1, 2).reshape(-1)
    return w[perm]


def gguf_weights(tensors: dict, config: dict, path: Path) -> dict[str, mx.array]:
    """Rename GGUF tensors to mlx-lm names and un-permute Q/K (works on quantized rows too)."""
    out = {}
    for name, w in tensors.items():
        new = gguf_name(name)
        if new is None:
            raise ConversionError(f"{path}: unexpected GGUF tensor {name!r}")
        if ".attn_q." in name:
            w = unpermute_rows(w, config["num_attention_heads"])
        elif ".attn_k." in name:
            w = unpermute_rows(w, config["num_key_value_heads"])
        out[new] = w
    return out


GGUF_GROUP = 32  # the group size of GGUF's block quantizations, as kept by mlx


def _bits(weight: mx.array, scales: mx.array) -> int:
    """Bits per value of a quantized triple: packed uint32 columns over input dimensions."""
    return weight.shape[-1] * 32 // (scales.shape[-1] * GGUF_GROUP)


def quant_bits(weights: dict[str, mx.array]) -> set[tuple[int, int]]:
    """The ``(bits, group_size)`` pairs of the quantized triples in ``weights``."""
    return {
        (_bits(weights[k[: -len("scales")] + "weight"], scales), GGUF_GROUP)
        for k, scales in weights.items()
        if k.endswith(".scales")
    }


def _layer_quant(prefix: str, weights: dict[str, mx.array]) -> dict | bool:
    """Per-layer quantization parameters of a kept GGUF triple (``False``: not quantized)."""
    scales = weights.get(f"{prefix}.scales")
    if scales is None:
        return False
    bits = _bits(weights[f"{prefix}.weight"], scales)
    return {"group_size": GGUF_GROUP, "bits": bits, "mode": "affine"}


def dequantize_all(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Replace each quantized triple by its float32 dequantized weight."""
    quantized = {k[: -len(".scales")] for k in weights if k.endswith(".scales")}
    out = {}
    for k, v in weights.items():
        base, _, leaf = k.rpartition(".")
        if base not in quantized:
            out[k] = v
        elif leaf == "weight":
            s, b = weights[f"{base}.scales"], weights[f"{base}.biases"]
            s, b = s.astype(mx.float32), b.astype(mx.float32)
            out[k] = mx.dequantize(v, s, b, GGUF_GROUP, _bits(v, s))
    return out


def convert_gguf(
    path: str | Path,
    out: str | Path,
    *,
    dtype: str = "float16",
    quantize: int | None = None,
    force: bool = False,
) -> Path:
    """Convert a llama GGUF file (float, Q4_0, Q4_1 or Q8_0 tensors) to an mlx-lm folder."""
    path = Path(path).expanduser()
    tensors, meta = read_gguf(path)
    config = gguf_config(meta, tensors, path)
    weights = gguf_weights(tensors, config, path)
    kinds = quant_bits(weights)
    # keep llama.cpp's blocks when they are already at the requested width (8-bit tensors such
    # as a Q8_0 embedding are kept too); anything else is dequantized (and requantized)
    keep = (
        quantize is not None
        and bool(kinds)
        and all(g == 32 and b in (quantize, 8) for b, g in kinds)
    )
    if not keep:
        weights = dequantize_all(weights)
    model = build_model(config, path)
    if keep:
        nn.quantize(
            model,
            group_size=32,
            bits=quantize,
            class_predicate=lambda p, m: _layer_quant(p, weights),
        )
        config["quantization"] = {"group_size": 32, "bits": quantize, "mode": "affine"}
    load_into(model, cast_floats(weights, dtype), path)
    config["torch_dtype"] = dtype
    if not keep:
        config = quantize_weights(model, config, quantize)
    with staged_output(out, force=force) as tmp:
        save_folder(tmp, model, config)
        write_gguf_tokenizer(meta, config, tmp, path)
    return Path(out)


def _tokenizer_from_gguf(meta: dict, path: Path):
    """A `tokenizers.Tokenizer` (GPT-2 byte-level BPE) rebuilt from GGUF metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    tokens = list(_meta(meta, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in _meta(meta, "tokenizer.ggml.merges", [])]
    types = _meta(meta, "tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if _meta(meta, "tokenizer.ggml.pre") == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    bos = _meta(meta, "tokenizer.ggml.bos_token_id")
    if _meta(meta, "tokenizer.ggml.add_bos_token") and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A",
            pair=f"{tokens[bos]} $A $B",
            special_tokens=[(tokens[bos], bos)],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [
        AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == 3
    ]
    user = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i, t in enumerate(types)
        if t == 4
    ]
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    return tok, tokens


def write_gguf_tokenizer(meta: dict, config: dict, out: Path, path: Path) -> None:
    """Write tokenizer.json + configs rebuilt from GGUF metadata (nothing if it has none)."""
    model = _meta(meta, "tokenizer.ggml.model")
    if model is None:
        print(f"warning: {path}: no tokenizer in the GGUF metadata", file=sys.stderr)
        return
    if model != "gpt2":
        raise ConversionError(f"{path}: unsupported GGUF tokenizer model {model!r} (only gpt2 BPE)")
    tok, tokens = _tokenizer_from_gguf(meta, path)
    tok.save(str(out / "tokenizer.json"))
    names = {}
    for key in ("bos", "eos", "unknown", "padding"):
        tid = _meta(meta, f"tokenizer.ggml.{key}_token_id")
        if tid is not None and 0 <= tid < len(tokens):
            names[{"unknown": "unk", "padding": "pad"}.get(key, key)] = tokens[tid]
    special_map = {f"{k}_token": v for k, v in names.items()}
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_map,
        "add_bos_token": bool(_meta(meta, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.get("max_position_embeddings", 2048),
    }
    if (template := _meta(meta, "tokenizer.chat_template")) is not None:
        tok_cfg["chat_template"] = template
    _write_json(out / "tokenizer_config.json", tok_cfg)
    _write_json(out / "special_tokens_map.json", special_map)
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    _write_json(out / "generation_config.json", gen)


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)


# ----------------------------------------------------------------------------------------------
# ReDrafter drafter checkpoints


def canonical_drafter_name(key: str) -> str | None:
    """Rename reference-variant keys to canonical names; ``None`` for tensors to drop."""
    for prefix in ("module.", "drafter."):
        if key.startswith(prefix):
            key = key[len(prefix) :]
    if key.startswith("emb_norm."):
        return None
    if key.startswith("lm_heads."):
        key = "lm_head." + key[len("lm_heads.") :]
    if key.startswith("input_projs."):
        rest = key[len("input_projs.") :]
        key = "input_proj." + (rest[2:] if rest.startswith("0.") else rest)
    return key


def _drafter_files(src: Path) -> tuple[Path, Path]:
    folder = src if src.is_dir() else src.parent
    cfg = folder / "config.json"
    if not src.exists():
        raise ConversionError(f"{src}: no such file or directory")
    if not cfg.is_file():
        raise ConversionError(f"{cfg}: missing config.json")
    if src.is_file():
        return cfg, src
    for name in ("model.safetensors", "model.pt", "pytorch_model.bin"):
        if (folder / name).is_file():
            return cfg, folder / name
    raise ConversionError(f"{folder}: no model.safetensors or model.pt")


def _read_drafter_tensors(wfile: Path) -> dict[str, mx.array]:
    if wfile.suffix == ".safetensors":
        try:
            check_safetensors(wfile)
            return mx.load(str(wfile))
        except LoadError as e:
            raise ConversionError(str(e)) from e
        except Exception as e:
            raise ConversionError(f"{wfile}: unreadable safetensors ({one_line(e)})") from e
    return read_torch_checkpoint(wfile)


def drafter_config(raw: dict[str, Any], weights: dict[str, mx.array], cfg: Path) -> dict:
    """The canonical drafter config; defaults inferred from the tensors where absent."""
    if raw.get("model_type", DRAFTER_TYPE) != DRAFTER_TYPE:
        raise ConversionError(f"{cfg}: model_type {raw.get('model_type')!r} is not a drafter")
    try:
        hidden, vocab = int(raw["hidden_size"]), int(raw["vocab_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise ConversionError(f"{cfg}: drafter config lacks {one_line(e)}") from e
    n = sum(1 for k in weights if k.startswith("lm_head.") and k.endswith(".linear.weight"))
    config = {
        "model_type": DRAFTER_TYPE,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "exit_dim": int(raw.get("exit_dim") or 2 * hidden),
        "num_draft_layers": int(raw.get("num_draft_layers", n)),
        "rnn": bool(raw.get("rnn", "rnn_u.weight" in weights)),
    }
    # this project's extensions (a draft vocabulary subset, a head scored by the target's rows)
    if raw.get("draft_vocab_size"):
        config["draft_vocab_size"] = int(raw["draft_vocab_size"])
    if raw.get("head", "own") != "own":
        config["head"] = str(raw["head"])
    return config


def validate_drafter(weights: dict[str, mx.array], config: dict, wfile: Path) -> None:
    """One-line error for missing, unexpected or mis-shaped drafter tensors."""
    want = tensor_shapes(DrafterArgs.from_dict(config))
    missing = sorted(set(want) - set(weights))
    extra = sorted(set(weights) - set(want))
    bad = [
        f"{k} {tuple(weights[k].shape)} != {want[k]}"
        for k in want
        if k in weights and tuple(weights[k].shape) != want[k]
    ]
    problems = (
        ([f"missing {', '.join(missing)}"] if missing else [])
        + ([f"unexpected {', '.join(extra)}"] if extra else [])
        + bad
    )
    if problems:
        raise ConversionError(
            f"{wfile}: drafter tensors do not match config: " + "; ".join(problems)
        )
    try:
        Drafter(DrafterArgs.from_dict(config)).load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ConversionError(f"{wfile}: drafter weights rejected ({one_line(e)})") from e


def target_config_dims(target: str | Path) -> tuple[int, int]:
    """``(hidden_size, vocab_size)`` from a target folder's config.json (or a GGUF's metadata)."""
    path = Path(target).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        tensors, meta = read_gguf(path)
        cfg = gguf_config(meta, tensors, path)
    else:
        try:
            cfg = _read_config(resolve_path(str(target)))
        except LoadError as e:
            raise ConversionError(str(e)) from e
    return int(cfg["hidden_size"]), int(cfg["vocab_size"])


def convert_drafter(
    src: str | Path,
    out: str | Path,
    *,
    target: str | Path | None = None,
    dtype: str = "float32",
    force: bool = False,
) -> Path:
    """Convert a ReDrafter drafter checkpoint to this project's drafter folder."""
    src = Path(src).expanduser()
    cfg_file, wfile = _drafter_files(src)
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConversionError(f"{cfg_file}: not valid JSON ({one_line(e)})") from e
    weights = {}
    for k, v in _read_drafter_tensors(wfile).items():
        if (name := canonical_drafter_name(k)) is not None:
            weights[name] = v
    config = drafter_config(raw, weights, cfg_file)
    validate_drafter(weights, config, wfile)
    if target is not None:
        th, tv = target_config_dims(target)
        if (th, tv) != (config["hidden_size"], config["vocab_size"]):
            raise ConversionError(
                f"{src}: drafter (hidden_size {config['hidden_size']}, vocab_size "
                f"{config['vocab_size']}) does not fit target {target} (hidden_size {th}, "
                f"vocab_size {tv})"
            )
    weights = cast_floats(weights, dtype)
    with staged_output(out, force=force) as tmp:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        _write_json(tmp / "config.json", config)
    return Path(out)


# ----------------------------------------------------------------------------------------------
# Dispatch + CLI


def is_drafter_folder(path: Path) -> bool:
    """True when ``path`` holds a drafter config.json."""
    cfg = (path if path.is_dir() else path.parent) / "config.json"
    try:
        return json.loads(cfg.read_text()).get("model_type") == DRAFTER_TYPE
    except (OSError, json.JSONDecodeError, AttributeError):
        return False


def _magic(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(4)


def convert(
    src: str | Path,
    out: str | Path,
    *,
    dtype: str | None = None,
    quantize: int | None = None,
    drafter: bool = False,
    target: str | Path | None = None,
    force: bool = False,
) -> Path:
    """Convert ``src`` (GGUF file, drafter checkpoint, HF folder or hub id) into ``out``."""
    if not str(src).strip():
        raise ConversionError("--src is empty: name a GGUF file, checkpoint folder or hub id")
    path = Path(src).expanduser()
    target_dir = Path(out).expanduser().resolve()
    if path.exists() and target_dir in (path.resolve(), *path.resolve().parents):
        raise ConversionError(f"--src {src} is inside --out {out}: that would replace the source")
    if drafter or (path.exists() and is_drafter_folder(path)):
        if quantize:
            raise ConversionError("drafters are not quantized (they are small): drop --quantize")
        return convert_drafter(path, out, target=target, dtype=dtype or "float32", force=force)
    if path.suffix == ".gguf" or (path.is_file() and _magic(path) == b"GGUF"):
        return convert_gguf(path, out, dtype=dtype or "float16", quantize=quantize, force=force)
    return convert_hf(str(src), out, dtype=dtype or "float16", quantize=quantize, force=force)


__all__ = [
    "ConversionError",
    "convert",
    "convert_drafter",
    "convert_gguf",
    "convert_hf",
    "read_torch_checkpoint",
]
