"""Drafter folders of every type, loaded as the decode step's sources: :func:`create_drafter`,
the one place that asks which type a folder is (``TYPES``: one line per type), and the loaders
of the types the field ships (EAGLE-3, P-EAGLE, DFlash, DFlash2, DSpark, Qwen3.5 MTP heads)
from their layouts.

A drafter folder's type is read from its ``config.json``: first the type it declares
(``io/drafter_types``: a type no loader takes is refused in one line naming it); else
``speculators_model_type`` or ``model_type`` ``eagle3`` (RedHatAI ``*-speculator.eagle3``,
SGLang / AngelSlim EAGLE-3, and the folders mlx-vlm converts them into) is EAGLE-3; a
``dflash_config`` or a ``DFlash*`` architecture (z-lab ``*-DFlash``) or
``speculators_model_type`` ``dflash`` is DFlash, but a ``DFlash2*`` architecture, type
``dflash2`` or a ``dflash_config`` with a candidate selector is DFlash2, and one with a Markov
head DSpark; ``model_type`` ``qwen3_5_mtp`` (mlx-vlm's split folder) or a config declaring
``mtp_num_hidden_layers`` (an original Qwen3.5 checkpoint, its ``mtp.*`` tensors) is a native
MTP head; anything else is left to ReDrafter's loader. A drafter that does not fit its target
is refused in one line naming what differs: hidden size, vocabulary, or the target layers it
reads.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.nemotron_h import ModelArgs as NemotronArgs
from mlx_lm.models.qwen3_5 import TextModelArgs

from redrafter_mlx.core.decode.llm import (
    cache_layout,
    embedding,
    head_linear,
    inner_model,
    lm_head,
    target_dims,
)
from redrafter_mlx.core.decode.source import Source
from redrafter_mlx.core.drafters import checked
from redrafter_mlx.core.drafters.beam_search import BeamDrafter
from redrafter_mlx.core.drafters.dflash import DFlash, DFlashArgs, DFlashDrafter, Scaled
from redrafter_mlx.core.drafters.dflash2 import DFlash2, DFlash2Args, DFlash2Drafter
from redrafter_mlx.core.drafters.dspark import MODEL_TYPE as DSPARK
from redrafter_mlx.core.drafters.dspark import DSpark, DSparkArgs, DSparkDrafter
from redrafter_mlx.core.drafters.eagle3 import MODEL_TYPE as EAGLE3
from redrafter_mlx.core.drafters.eagle3 import Eagle3, Eagle3Args, Eagle3Drafter
from redrafter_mlx.core.drafters.gemma4_assistant import (
    FULL,
    SLIDING,
    Assistant,
    AssistantArgs,
    AssistantDrafter,
)
from redrafter_mlx.core.drafters.gemma4_assistant import MODEL_TYPE as GEMMA4_ASSISTANT
from redrafter_mlx.core.drafters.mtp import MODEL_TYPE as MTP_MODEL_TYPE
from redrafter_mlx.core.drafters.mtp import MTPDrafter, MTPHead
from redrafter_mlx.core.drafters.nemotron_mtp import MODEL_TYPE as NEMOTRON_MTP
from redrafter_mlx.core.drafters.nemotron_mtp import (
    NemotronMTPDrafter,
    NemotronMTPHead,
    head_pattern,
)
from redrafter_mlx.core.drafters.redrafter import load_drafter
from redrafter_mlx.core.errors import DrafterError
from redrafter_mlx.io import drafter_types

REDRAFTER = "redrafter"
DFLASH = "dflash"
DFLASH2 = "dflash2"
MTP = "mtp"
PEAGLE = "peagle"
KIND_NAMES = {
    EAGLE3: "EAGLE-3", DFLASH: "DFlash", DFLASH2: "DFlash2", MTP: "MTP", REDRAFTER: "ReDrafter",
    DSPARK: "DSpark", PEAGLE: "P-EAGLE", GEMMA4_ASSISTANT: "Gemma 4 assistant",
    NEMOTRON_MTP: "Nemotron-H MTP",
}  # fmt: skip


def create_drafter(folder: Path | str, target: nn.Module, dtype: mx.Dtype | None = None) -> Source:
    """The drafter in ``folder`` as the decode step's source, loaded by its type's loader
    (:func:`drafter_kind`) and checked against ``target``; its weights cast to ``dtype`` when
    given. DrafterError (one line) for a folder its type's loader refuses, or of a type no
    loader takes (``io/drafter_types``: named, never read as another type)."""
    found = drafter_types.declared(_config(folder) or {})
    if found and found[1].kind is None:
        raise DrafterError(f"{folder}: {drafter_types.refusal(*found)}")
    kind = drafter_kind(folder)
    load = next((load for name, _, load in TYPES if name == kind), load_redrafter)
    return load(folder, target, dtype)


def drafter_kind(folder: Path | str) -> str:
    """The type of the drafter in ``folder``: the kind of the type its ``config.json``
    declares (``io/drafter_types``; a type no loader takes is named by its key), else the
    first of ``TYPES`` whose test it passes, else ``"redrafter"`` (every other config)."""
    config = _config(folder)
    if config is None:
        return REDRAFTER
    if found := drafter_types.declared(config):
        return found[1].kind or found[0]
    return next((kind for kind, test, _ in TYPES if test(config)), REDRAFTER)


def _config(folder: Path | str) -> dict | None:
    """``folder``'s ``config.json`` when it is a JSON object (None: unreadable or not one)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _is_eagle3(config: dict) -> bool:
    return EAGLE3 in (config.get("speculators_model_type"), config.get("model_type"))


def _is_mtp(config: dict) -> bool:
    """mlx-vlm's split folder, or a Qwen3.5 checkpoint with its MTP head."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    # a tuple, not a set: a hand-edited type may be a list (unhashable); any layer count but
    # none or 0, even a malformed one, is a head for load_mtp to check
    types = (config.get("speculators_model_type"), config.get("model_type"))
    return MTP_MODEL_TYPE in types or text.get("mtp_num_hidden_layers") not in (None, 0)


def _is_dflash(config: dict) -> bool:
    """z-lab's (a ``dflash_config`` or a ``DFlash*`` architecture) or speculators'; never
    a DFlash2 folder (whose tensors DFlash's loader would call unknown)."""
    architectures = config.get("architectures") or []
    return not _is_dflash2(config) and (
        "dflash_config" in config
        or any("DFlash" in str(a) for a in architectures)
        or DFLASH in (config.get("speculators_model_type"), _method(config))
    )


def _is_dflash2(config: dict) -> bool:
    """A ``DFlash2*`` architecture (z-lab), type ``dflash2`` (speculators), or a
    ``dflash_config`` with DFlash2's own sizes (a convolution, a candidate selector)."""
    architectures = [str(a) for a in config.get("architectures") or []]
    dflash = config.get("dflash_config")
    own = isinstance(dflash, dict) and ("selector_top_k" in dflash or "conv_kernel_size" in dflash)
    types = (config.get("speculators_model_type"), config.get("model_type"), _method(config))
    return own or DFLASH2 in types or any("DFlash2" in a for a in architectures)


def _method(config: dict) -> object:
    """The ``speculative_config.method`` of speculators' Open Spec Config (None: none)."""
    spec = config.get("speculative_config")
    return spec.get("method") if isinstance(spec, dict) else None


def _declares(kind: str):
    """A ``TYPES`` test: whether a config declares a type ``kind``'s loader takes."""

    def test(config: dict) -> bool:
        found = drafter_types.declared(config)
        return found is not None and found[1].kind == kind

    return test


def load_redrafter(folder: Path | str, target: nn.Module, dtype: mx.Dtype | None = None):
    """A ReDrafter RNN drafter (``core/drafters/redrafter.py``'s folder) bound to ``target``'s
    embedding."""
    return BeamDrafter(load_drafter(folder, target, dtype), embedding(target))


def load_mtp(folder: Path | str, target: nn.Module, dtype: mx.Dtype | None = None):
    """An :class:`~redrafter_mlx.core.drafters.mtp.MTPDrafter` (dense or MoE) from a Qwen3.5 / 3.6
    checkpoint's ``mtp.*`` tensors or mlx-vlm's split ``qwen3_5_mtp`` folder, checked against
    ``target``."""
    folder = Path(folder)
    config_file = folder / "config.json"
    try:
        args, depth = _mtp_args(json.loads(config_file.read_text()))
    except (OSError, ValueError) as e:  # DrafterError is a ValueError
        raise DrafterError(f"{config_file}: not a Qwen3.5 MTP config ({e})") from None
    hidden, vocab = target_dims(target)
    if args.hidden_size != hidden:
        raise DrafterError(
            f"{folder}: MTP head has hidden size {args.hidden_size}, but the target's is {hidden}"
        )
    if args.vocab_size != vocab:
        raise DrafterError(
            f"{folder}: MTP head has vocabulary {args.vocab_size}, but the target's is {vocab}"
        )
    weights = {k[k.index("mtp.") :] if "mtp." in k else k: v for k, v in _weights(folder).items()}
    module = MTPHead(args, depth)
    _named(folder, module.load, weights)
    inner = inner_model(target)
    module.bind(embedding(target), inner.norm, lambda h: lm_head(target, h))
    if dtype is not None:
        module.set_dtype(dtype)
    mx.eval(module.parameters())
    return MTPDrafter(module, len(inner.layers) - 1)


# The sizes an MTP head is built from (mlx-lm's TextModelArgs divides by the heads unchecked)
MTP_SIZES = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "vocab_size", "head_dim",
)  # fmt: skip


MOE_SIZES = (
    "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size",
)  # fmt: skip


def _mtp_args(config: object) -> tuple[TextModelArgs, int]:
    """The head's args and depth from a Qwen3.5 config (its ``text_config`` when it has one),
    each size type-checked first (core/drafters/checked.py)."""
    if not isinstance(config, dict):
        raise DrafterError("not a JSON object")
    text = checked.section(config, "text_config") or config
    for name in MTP_SIZES:
        if text.get(name) is not None:
            checked.integer(name, text[name])
    args = TextModelArgs.from_dict(text)
    checked.heads(args.num_attention_heads, args.num_key_value_heads)
    if args.num_experts:  # a MoE head (Qwen3.5 / 3.6-35B-A3B): its expert sizes too
        for name in MOE_SIZES:
            checked.integer(name, getattr(args, name))
        if args.num_experts_per_tok > args.num_experts:
            raise DrafterError(
                f"num_experts_per_tok {args.num_experts_per_tok}: more than its"
                f" {args.num_experts} experts"
            )
    depth = checked.given(text, "mtp_num_hidden_layers", 1)
    return args, checked.integer("mtp_num_hidden_layers", depth)


def _named(folder: Path, load, *args) -> None:
    """``load(*args)``, its DrafterError naming ``folder`` (the module knows no path)."""
    try:
        load(*args)
    except DrafterError as e:
        raise DrafterError(f"{folder}: {e}") from None


def _weights(folder: Path) -> dict[str, mx.array]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise DrafterError(f"{folder}: no *.safetensors weights")
    weights = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except (ValueError, RuntimeError) as e:
            raise DrafterError(f"{f}: unreadable ({e})") from None
    return weights


def load_dflash(folder: Path | str, target: nn.Module, dtype: mx.Dtype | None = None):
    """A :class:`~redrafter_mlx.core.drafters.dflash.DFlashDrafter` from a z-lab / mlx-vlm /
    speculators folder, checked against ``target``; its weights cast to ``dtype`` when given."""
    return _load_dflash_family(folder, target, dtype, (DFlashArgs, DFlash, DFlashDrafter))


def load_dflash2(folder: Path | str, target: nn.Module, dtype: mx.Dtype | None = None):
    """A :class:`~redrafter_mlx.core.drafters.dflash2.DFlash2Drafter` from a z-lab / speculators
    folder, checked against ``target``; its weights cast to ``dtype`` when given."""
    return _load_dflash_family(folder, target, dtype, (DFlash2Args, DFlash2, DFlash2Drafter))


def _load_dflash_family(folder, target: nn.Module, dtype, classes: tuple):
    """A DFlash-family drafter of ``classes`` (args, module, source) from ``folder``."""
    args_class, module_class, source_class = classes
    folder = Path(folder)
    config_file = folder / "config.json"
    try:
        config = json.loads(config_file.read_text())
        if problem := _other_type(config, source_class.kind):
            raise DrafterError(problem)
        args = args_class.from_dict(config)
    except (OSError, ValueError) as e:
        raise DrafterError(f"{config_file}: {e}") from None
    if problem := _dflash_misfit(args, target):
        raise DrafterError(f"{folder}: {module_class.name} drafter {problem}")
    module = module_class(args)
    embed = embedding(target)
    # the block's input is the target's as its forward makes it (mlx-vlm's bind): Gemma's
    # scaled by sqrt(H); a checkpoint's own embedding replaces it, unscaled (as mlx-vlm's)
    if (scale := float(getattr(inner_model(target), "embed_scale", 1.0))) != 1.0:
        embed = Scaled(embed, scale)
    _named(folder, module.load, _weights(folder), embed, partial(head_linear, target))
    if dtype is not None:
        module.set_dtype(dtype)
    mx.eval(module.parameters())
    return source_class(module)


def _other_type(config: object, kind: str) -> str | None:
    """Why a folder declaring another type than ``kind``'s (``io/drafter_types``) is not read
    as one (None: it declares ``kind``, or nothing): a DSpark folder is never a DFlash one."""
    found = drafter_types.declared(config) if isinstance(config, dict) else None
    if found is None or found[1].kind == kind:
        return None
    if found[1].kind is None:
        return drafter_types.refusal(*found)
    return f"a {found[1].name} drafter, not {KIND_NAMES.get(kind, kind)}"


def load_dspark(folder: Path | str, target: nn.Module, dtype: mx.Dtype | None = None):
    """A :class:`~redrafter_mlx.core.drafters.dspark.DSparkDrafter` from an mlx-vlm / DeepSeek
    or speculators (``dspark``) folder: DFlash's loader with DSpark's args, module (its Markov
    head) and source (its tree)."""
    return _load_dflash_family(folder, target, dtype, (DSparkArgs, DSpark, DSparkDrafter))


def _dflash_misfit(args: DFlashArgs, target: nn.Module) -> str | None:
    """What of a DFlash-family drafter does not fit ``target``, in words (None: it fits)."""
    hidden, vocab = target_dims(target)
    layers = len(inner_model(target).layers)
    if args.hidden_size != hidden:
        return f"has hidden size {args.hidden_size}, but the target's is {hidden}"
    if args.vocab_size != vocab or not 0 <= args.mask_token_id < vocab:
        return f"has vocabulary {args.vocab_size}, but the target's is {vocab}"
    if max(args.target_layer_ids) >= layers:
        return f"reads target layers {args.target_layer_ids}, but the target has {layers} layers"
    return None


def _is_gemma4_assistant(config: dict) -> bool:
    return GEMMA4_ASSISTANT in (config.get("model_type"), config.get("speculators_model_type"))


def load_gemma4_assistant(folder: Path | str, target: nn.Module, dtype: mx.Dtype | None = None):
    """An :class:`~redrafter_mlx.core.drafters.gemma4_assistant.AssistantDrafter` from an HF /
    mlx-vlm ``gemma4_assistant`` folder, checked against ``target`` (a Gemma 4)."""
    folder = Path(folder)
    config_file = folder / "config.json"
    try:
        args = AssistantArgs.from_dict(json.loads(config_file.read_text()))
    except (OSError, ValueError, TypeError) as e:
        raise DrafterError(f"{config_file}: not a Gemma 4 assistant config ({e})") from None
    kv_layers = _shared_kv_layers(target)
    if problem := _assistant_misfit(args, target, kv_layers):
        raise DrafterError(f"{folder}: Gemma 4 assistant {problem}")
    module = Assistant(args)
    _named(folder, module.load, _weights(folder))
    module.bind(embedding(target), float(getattr(inner_model(target), "embed_scale", 1.0)))
    if dtype is not None:
        module.set_dtype(dtype)
    mx.eval(module.parameters())
    return AssistantDrafter(module, kv_layers, args.text.sliding_window)


def _shared_kv_layers(target: nn.Module) -> dict[str, int]:
    """``{layer type: K/V slot}`` of the last layer of each type that computes K/V (what a
    Gemma 4's K/V-shared layers, and its assistant, read); empty for another family."""
    layers = inner_model(target).layers
    found = {}
    # the cache stops at the first K/V-shared layer: zip stops with it
    for layer, slot in zip(layers, cache_layout(target), strict=False):
        kind = getattr(layer, "layer_type", None)
        if kind in (FULL, SLIDING) and hasattr(slot, "index"):
            found[kind] = slot.index
    return found


def _assistant_misfit(args: AssistantArgs, target: nn.Module, kv_layers: dict) -> str | None:
    """What of a Gemma 4 assistant does not fit ``target``, in words (None: it fits)."""
    hidden, vocab = target_dims(target)
    needed = {layer for layer in args.text.layer_types[: args.text.num_hidden_layers]}
    family = str(getattr(getattr(target, "args", None), "model_type", ""))
    if not kv_layers or not family.startswith("gemma4"):
        return f"drafts for Gemma 4 targets only (it reads their K/V), not {family or 'this'}"
    if args.backbone_hidden_size != hidden:
        return f"reads hidden size {args.backbone_hidden_size}, but the target's is {hidden}"
    if args.text.vocab_size != vocab:
        return f"has vocabulary {args.text.vocab_size}, but the target's is {vocab}"
    if args.use_ordered_embeddings and vocab % args.num_centroids:
        return f"splits a vocabulary of {vocab} into {args.num_centroids} clusters unevenly"
    if missing := sorted(needed - set(kv_layers)):
        return f"reads the target's {', '.join(missing)} K/V, which the target has none of"
    return None


def _is_nemotron_mtp(config: dict) -> bool:
    """mlx-vlm's split folder, or a Nemotron-H checkpoint declaring its MTP layer."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    if NEMOTRON_MTP in (config.get("model_type"), config.get("speculators_model_type")):
        return True
    return text.get("model_type") == "nemotron_h" and text.get("num_nextn_predict_layers") not in (
        None,
        0,
    )


def load_nemotron_mtp(folder: Path | str, target: nn.Module, dtype: mx.Dtype | None = None):
    """A :class:`~redrafter_mlx.core.drafters.nemotron_mtp.NemotronMTPDrafter` from a Nemotron-H
    checkpoint's ``mtp.*`` tensors or mlx-vlm's split ``nemotron_h_mtp`` folder, checked
    against ``target``."""
    folder = Path(folder)
    config_file = folder / "config.json"
    try:
        config = json.loads(config_file.read_text())
        text = checked.section(config, "text_config") or config
        layers = checked.integer("num_nextn_predict_layers", text.get("num_nextn_predict_layers"))
        if layers != 1:
            raise DrafterError(f"num_nextn_predict_layers {layers}: only 1 is supported")
        pattern = head_pattern(text)
        args = NemotronArgs.from_dict({**text, "hybrid_override_pattern": pattern})
    except (OSError, ValueError, TypeError) as e:  # DrafterError is a ValueError
        raise DrafterError(f"{config_file}: not a Nemotron-H MTP config ({e})") from None
    hidden, vocab = target_dims(target)
    inner = inner_model(target)
    if getattr(getattr(target, "args", None), "model_type", None) != "nemotron_h":
        raise DrafterError(f"{folder}: Nemotron-H MTP head drafts for Nemotron-H targets only")
    for name, ours, theirs in (("hidden size", args.hidden_size, hidden),
                               ("vocabulary", args.vocab_size, vocab)):  # fmt: skip
        if ours != theirs:
            raise DrafterError(
                f"{folder}: MTP head has {name} {ours}, but the target's is {theirs}"
            )
    module = NemotronMTPHead(args, pattern)
    _named(folder, module.load, _weights(folder))
    module.bind(embedding(target), inner.norm_f, lambda h: lm_head(target, h))
    if dtype is not None:
        module.set_dtype(dtype)
    mx.eval(module.parameters())
    return NemotronMTPDrafter(module, len(inner.layers) - 1)


def load_eagle3(folder: Path | str, target: nn.Module, dtype: mx.Dtype | None = None):
    """An :class:`~redrafter_mlx.core.drafters.eagle3.Eagle3Drafter` from a speculators / SGLang /
    mlx-vlm folder, checked against ``target``; its weights cast to ``dtype`` when given."""
    folder = Path(folder)
    config_file = folder / "config.json"
    layers = len(inner_model(target).layers)
    try:
        args = Eagle3Args.from_dict(json.loads(config_file.read_text()), target_layers=layers)
    except (OSError, ValueError) as e:
        raise DrafterError(f"{config_file}: {e}") from None
    if problem := misfit(args, target):
        raise DrafterError(f"{folder}: EAGLE-3 drafter {problem}")
    module = Eagle3(args)
    _named(folder, module.load, _weights(folder), embedding(target))
    if dtype is not None:
        module.set_dtype(dtype)
    mx.eval(module.parameters())
    return Eagle3Drafter(module)


def load_peagle(folder: Path | str, target: nn.Module, dtype: mx.Dtype | None = None):
    """A speculators P-EAGLE folder as an EAGLE-3 drafter drafting step by step: P-EAGLE is
    EAGLE-3's model trained to draft several tokens in one pass (from a learned
    ``mask_hidden``, unused here), with its own trained token embedding (used here)."""
    drafter = load_eagle3(folder, target, dtype)
    own = _weights(Path(folder)).get("embed_tokens.weight")
    if own is not None and own.shape == drafter.module.embed_tokens.weight.shape:
        drafter.module.embed_tokens = nn.Embedding(*own.shape)
        drafter.module.embed_tokens.weight = own if dtype is None else own.astype(dtype)
        mx.eval(drafter.module.embed_tokens.weight)  # lazy, it would run on the loading thread
    drafter.kind = PEAGLE
    return drafter


def misfit(args: Eagle3Args, target: nn.Module) -> str | None:
    """What of an EAGLE-3 drafter does not fit ``target``, in words (None: it fits)."""
    hidden, vocab = target_dims(target)
    layers = len(inner_model(target).layers)
    if args.target_hidden_size != hidden:
        return f"reads hidden size {args.target_hidden_size}, but the target's is {hidden}"
    if args.vocab_size != vocab:
        return f"has vocabulary {args.vocab_size}, but the target's is {vocab}"
    if len(args.taps) != 3:
        return f"reads {len(args.taps)} target layers (EAGLE-3 fuses 3)"
    if max(args.taps) >= layers:
        return f"reads target layers {list(args.taps)}, but the target has {layers} layers"
    return None


# Every drafter type but ReDrafter's (which takes every other folder): (name, whether a
# ``config.json`` is of this type, its loader), asked in this order. A new type is one line.
TYPES = (
    (EAGLE3, _is_eagle3, load_eagle3),
    (PEAGLE, _declares(PEAGLE), load_peagle),
    (MTP, _is_mtp, load_mtp),
    (DSPARK, _declares(DSPARK), load_dspark),
    (DFLASH2, _is_dflash2, load_dflash2),
    (DFLASH, _is_dflash, load_dflash),
    (GEMMA4_ASSISTANT, _is_gemma4_assistant, load_gemma4_assistant),
    (NEMOTRON_MTP, _is_nemotron_mtp, load_nemotron_mtp),
)
