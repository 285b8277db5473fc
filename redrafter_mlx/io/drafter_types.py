"""Every drafter type the field publishes, as data: what a folder's ``config.json`` says it is
(:func:`declared`), its name in words, and whether a loader here takes it.

The types are mlx-vlm 0.7.10's drafter ``model_type`` values (its
``DRAFTER_KIND_BY_MODEL_TYPE``, and the DFlash folders it tells by architecture or
``dflash_config``) and speculators' ``speculators_model_type`` values. A folder of a type
no loader takes is refused in one line naming the type (``io/field_drafters``), never read
as another type's. Loading a new type is one row flipped to its kind here, plus its line in
``io/field_drafters.TYPES``.
"""

from __future__ import annotations

from typing import NamedTuple


class DrafterType(NamedTuple):
    """A type's name in words, the kind of the loader that takes it (None: none yet) and,
    for a type none takes, why (empty: not built yet)."""

    name: str
    kind: str | None
    why: str = ""


# Why GLM's MTP heads are not loaded (docs/drafters.md, Limits)
GLM4_MTP = (
    "no model to test it against (mlx-vlm 0.7.10 has only a splitter for GLM-4 heads, and"
    " mlx-lm 0.32's glm4_moe / glm4_moe_lite drop the head's weights)"
)
GLM5_MTP = (
    "its layer is GLM-5's MLA attention with a sparse indexer, each with its own cache along"
    " the accepted tokens, which no drafter here keeps yet"
)
GLM5_NEXT = "mlx-lm 0.32 has no glm5_next target to draft for"
# a model's own checkpoint declaring next-token-prediction layers: why its head is not loaded
NEXTN_WHY = {"glm4_moe": GLM4_MTP, "glm4_moe_lite": GLM4_MTP, "glm_moe_dsa": GLM5_MTP}


# type (mlx-vlm's model_type, or "speculators:" + speculators_model_type) -> DrafterType
TYPES = {
    "eagle3": DrafterType("EAGLE-3", "eagle3"),
    "qwen3_5_mtp": DrafterType("Qwen3.5 MTP", "mtp"),
    "qwen3_dflash": DrafterType("DFlash", "dflash"),
    "dspark": DrafterType("DSpark", "dspark"),
    "qwen3_dspark": DrafterType("DSpark", "dspark"),
    "dflash2": DrafterType("DFlash2", "dflash2"),
    "gemma4_dflash": DrafterType("Gemma 4 DFlash", "dflash"),
    "laguna": DrafterType("Laguna DFlash", None),
    "gemma4_dspark": DrafterType("Gemma 4 DSpark", None),
    "deepseek_v4_dspark": DrafterType("DeepSeek-V4 DSpark", None),
    "muse_glimmer_assistant": DrafterType("Muse Glimmer assistant", None),
    "gemma4_assistant": DrafterType("Gemma 4 assistant MTP", "gemma4_assistant"),
    "gemma4_unified_assistant": DrafterType("Gemma 4 unified assistant MTP", None),
    "deepseek_v4_mtp": DrafterType("DeepSeek-V4 MTP", None),
    "nemotron_h_mtp": DrafterType("Nemotron-H MTP", "nemotron_h_mtp"),
    "glm4_moe_lite_mtp": DrafterType("GLM-4 MoE Lite MTP", None, GLM4_MTP),
    "glm5_next_mtp": DrafterType("GLM-5 Next MTP", None, GLM5_NEXT),
    "glm_moe_dsa_mtp": DrafterType("GLM MoE DSA MTP", None, GLM5_MTP),
    "hy_v4_mtp": DrafterType("Hunyuan V4 MTP", None),
    "inkling_mtp": DrafterType("Inkling MTP", None),
    "qwen4_exp_mtp": DrafterType("Qwen4 MTP", None),
    "speculators:eagle3": DrafterType("EAGLE-3", "eagle3"),
    "speculators:peagle": DrafterType("P-EAGLE", "peagle"),
    "speculators:dflash": DrafterType("DFlash (speculators)", "dflash"),
    "speculators:dflash2": DrafterType("DFlash2 (speculators)", "dflash2"),
    "speculators:dspark": DrafterType("DSpark (speculators)", "dspark"),
    "speculators:eagle": DrafterType("EAGLE (speculators)", None),
    "speculators:mtp": DrafterType("MTP (speculators)", None),
}

# Architectures that name a type whatever the model_type says (mlx-vlm's get_model_type)
ARCHITECTURES = {
    "DFlash2DraftModel": "dflash2",
    "Gemma4DSparkModel": "gemma4_dspark",
    "Qwen3DSparkModel": "dspark",
}


def declared(config: dict) -> tuple[str, DrafterType] | None:
    """The type ``config`` declares and its row (an unknown speculators type gets a row that
    loads nothing); None when it declares no type listed here (a ReDrafter folder, a
    checkpoint's own MTP head)."""
    speculators = config.get("speculators_model_type")
    if not isinstance(speculators, str):  # speculators' Open Spec Config names its method
        spec = config.get("speculative_config")
        speculators = spec.get("method") if isinstance(spec, dict) else None
    if isinstance(speculators, str) and speculators:
        key = f"speculators:{speculators}"
        return key, TYPES.get(key, DrafterType(f"speculators {speculators!r}", None))
    key = _mlx_vlm_type(config)
    if key in TYPES:
        return key, TYPES[key]
    if _nextn_layers(config):  # a model's own checkpoint with its MTP head (DeepSeek, GLM)
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
        if "nemotron_h" in (key, text.get("model_type")):  # Nemotron-H's: a loader takes it
            return "nemotron_h_mtp", TYPES["nemotron_h_mtp"]
        why = NEXTN_WHY.get(str(key), "")
        return str(key), DrafterType(f"{key} MTP head (num_nextn_predict_layers)", None, why)
    return None


def _nextn_layers(config: dict) -> bool:
    """Whether ``config`` (or its ``text_config``) declares next-token-prediction layers
    (and no ``mtp_num_hidden_layers``: Qwen3.5's head, which a loader here takes)."""
    text = config.get("text_config")
    sections = (config, text if isinstance(text, dict) else {})
    if any("mtp_num_hidden_layers" in section for section in sections):
        return False
    for section in sections:
        count = section.get("num_nextn_predict_layers")
        if isinstance(count, int) and not isinstance(count, bool) and count > 0:
            return True
    return False


def _mlx_vlm_type(config: dict) -> str | None:
    """``config``'s drafter type as mlx-vlm 0.7.10 normalises it: an architecture that names
    one, else a ``dflash_config`` (DSpark's when it has a Markov head, DFlash2's with its own
    sizes), else ``model_type``."""
    architectures = config.get("architectures")
    for name in architectures if isinstance(architectures, list) else ():
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
        if "DSpark" in str(name):  # never read as DFlash: DSpark's loader says what it lacks
            return "dspark"
    model_type = config.get("model_type")
    model_type = model_type.lower() if isinstance(model_type, str) else None
    dflash = config.get("dflash_config")
    if isinstance(dflash, dict):
        rank = dflash.get("markov_rank", config.get("markov_rank"))
        if dflash.get("projector_type") == "dspark" or (isinstance(rank, int) and rank > 0):
            return "dspark"
        if any(name in dflash for name in ("selector_top_k", "conv_kernel_size")):
            return "dflash2"  # DFlash2's own sizes: its convolutions, its candidate selector
        # a converted folder keeps its normalised type; a type not listed is DFlash's test's
        return model_type if model_type in TYPES else f"{model_type}_dflash"
    return model_type


def refusal(key: str, kind: DrafterType) -> str:
    """The one line a folder of a type no loader takes is refused with (and why, when
    known)."""
    source = "speculators_model_type" if key.startswith("speculators:") else "type"
    line = f"{kind.name} drafter: not supported yet ({source} {key.split(':')[-1]!r})"
    return f"{line}: {kind.why}" if kind.why else line
