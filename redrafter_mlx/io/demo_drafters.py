"""Tiny random drafters of the field's types for a demo model (``demo-model --drafter``): each
written as its authors' repositories hold one, so that loading, generating, chatting, serving
and benchmarking with that type can be rehearsed offline before downloading gigabytes.

Their proposals are noise (random weights): the target's answer is unchanged, only few drafts
are accepted. Layouts: EAGLE-3 as speculators writes it (``speculators_model_type``,
``transformer_layer_config``, a draft vocabulary), DFlash as z-lab's (``dflash_config``, no
embedding or head of its own), DFlash2 as z-lab's (DFlash's plus each layer's convolutions and
the candidate selector), a Qwen3.5 MTP head as mlx-vlm's split folder (``qwen3_5_mtp``).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from redrafter_mlx.core.errors import ConfigError
from redrafter_mlx.io.convert import staged_output

KINDS = ("eagle3", "dflash", "dflash2", "mtp")
HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 4, 2, 16, 128
DRAFT_VOCAB = 2048  # EAGLE-3's draft vocabulary: the first ids (a real one keeps the commonest)


class _Random:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def weight(self, *shape: int, scale: float = 0.1) -> mx.array:
        return mx.array(self.rng.normal(0, scale, shape).astype(np.float32))

    def norm(self, n: int, offset: float = 1.0) -> mx.array:
        return mx.array((offset + self.rng.normal(0, 0.1, n)).astype(np.float32))


def _attention(r: _Random, p: str, hidden: int, *, width: int | None = None, gated=False):
    """A decoder layer's attention and MLP tensors under prefix ``p``."""
    width = width or hidden
    queries = (2 if gated else 1) * HEADS * HEAD_DIM
    return {
        p + "input_layernorm.weight": r.norm(hidden),
        p + "post_attention_layernorm.weight": r.norm(hidden),
        p + "self_attn.q_proj.weight": r.weight(queries, width),
        p + "self_attn.k_proj.weight": r.weight(KV_HEADS * HEAD_DIM, width),
        p + "self_attn.v_proj.weight": r.weight(KV_HEADS * HEAD_DIM, width),
        p + "self_attn.o_proj.weight": r.weight(hidden, HEADS * HEAD_DIM),
        p + "mlp.gate_proj.weight": r.weight(INTERMEDIATE, hidden),
        p + "mlp.up_proj.weight": r.weight(INTERMEDIATE, hidden),
        p + "mlp.down_proj.weight": r.weight(hidden, INTERMEDIATE),
    }


def _layer_config(target: dict) -> dict:
    return {
        "hidden_size": target["hidden_size"],
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-6,
        "vocab_size": target["vocab_size"],
        "rope_theta": 10000.0,
    }


def eagle3(target: dict, r: _Random) -> tuple[dict, dict]:
    """One decoder layer over the fused features of 3 target layers (first, middle, last)."""
    hidden, vocab, layers = target["hidden_size"], target["vocab_size"], target["layers"]
    draft = min(DRAFT_VOCAB, vocab)
    t2d = np.zeros(vocab, bool)
    t2d[:draft] = True
    tensors = {
        "fc.weight": r.weight(hidden, 3 * hidden),
        "norm.weight": r.norm(hidden),
        "lm_head.weight": r.weight(draft, hidden),
        "d2t": mx.array(np.zeros(draft, np.int64)),  # draft id i is target id i + d2t[i]
        "t2d": mx.array(t2d),
        "layers.0.hidden_norm.weight": r.norm(hidden),
        **_attention(r, "layers.0.", hidden, width=2 * hidden),
    }
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "draft_vocab_size": draft,
        "norm_before_residual": True,
        "target_hidden_size": hidden,
        "eagle_aux_hidden_state_layer_ids": [0, layers // 2, layers - 1],
        "transformer_layer_config": {
            "model_type": "llama",
            "num_hidden_layers": 1,
            **_layer_config(target),
        },
    }
    return config, tensors


def dflash(target: dict, r: _Random) -> tuple[dict, dict]:
    """Two Qwen3 layers drafting a block of 8 from the features of 2 target layers."""
    hidden, layers = target["hidden_size"], target["layers"]
    ids = [0, layers - 1]
    tensors = {
        "fc.weight": r.weight(hidden, len(ids) * hidden),
        "hidden_norm.weight": r.norm(hidden),
        "norm.weight": r.norm(hidden),
    }
    for i in range(2):
        p = f"layers.{i}."
        tensors |= _attention(r, p, hidden)
        tensors[p + "self_attn.q_norm.weight"] = r.norm(HEAD_DIM)
        tensors[p + "self_attn.k_norm.weight"] = r.norm(HEAD_DIM)
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "num_hidden_layers": 2,
        **_layer_config(target),
        "max_position_embeddings": target["context"],
        "tie_word_embeddings": True,
        "block_size": 8,
        "num_target_layers": len(ids),
        "dflash_config": {"mask_token_id": target["vocab_size"] - 1, "target_layer_ids": ids},
    }
    return config, tensors


def dflash2(target: dict, r: _Random) -> tuple[dict, dict]:
    """DFlash's drafter with a grouped dynamic convolution around each layer's attention and
    MLP and a low-rank candidate selector over the top 8 candidates (z-lab's DFlash2)."""
    kernel, group, rank = 3, 16, 8
    config, tensors = dflash(target, r)
    hidden, vocab = target["hidden_size"], target["vocab_size"]
    for i in range(config["num_hidden_layers"]):
        for conv in ("attention_conv", "mlp_conv"):
            p = f"layers.{i}.{conv}."
            tensors[p + "base_kernel"] = r.weight(2, kernel, hidden, scale=0.5)
            tensors[p + "kernel_projection.weight"] = r.weight(2 * kernel * hidden // group, hidden)
    tensors |= {
        "candidate_selector.predecessor_codebook": r.weight(vocab, rank, scale=1.0),
        "candidate_selector.successor_codebook": r.weight(vocab, rank, scale=1.0),
        "candidate_selector.hidden_projection.weight": r.weight(rank, hidden, scale=0.5),
    }
    config["architectures"] = ["DFlash2DraftModel"]
    config["dflash_config"] |= {
        "conv_kernel_size": kernel,
        "conv_group_size": group,
        "selector_rank": rank,
        "selector_top_k": 8,
    }
    return config, tensors


def mtp(target: dict, r: _Random) -> tuple[dict, dict]:
    """A Qwen3.5 MTP head (one gated-attention layer) as mlx-vlm's splitter writes it."""
    hidden = target["hidden_size"]
    tensors = {
        "fc.weight": r.weight(hidden, 2 * hidden),
        "pre_fc_norm_embedding.weight": r.norm(hidden),
        "pre_fc_norm_hidden.weight": r.norm(hidden),
        "norm.weight": r.norm(hidden),
        **_attention(r, "layers.0.", hidden, gated=True),
        "layers.0.self_attn.q_norm.weight": r.norm(HEAD_DIM),
        "layers.0.self_attn.k_norm.weight": r.norm(HEAD_DIM),
    }
    text = {
        "model_type": "qwen3_5",
        "num_hidden_layers": target["layers"],
        **_layer_config(target),
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 2,
        "max_position_embeddings": target["context"],
        "tie_word_embeddings": True,
        "mtp_num_hidden_layers": 1,
    }
    return {"model_type": "qwen3_5_mtp", "text_config": text}, tensors


WRITERS = {"eagle3": eagle3, "dflash": dflash, "dflash2": dflash2, "mtp": mtp}


def write_demo_drafter(out: str | Path, model: str | Path, kind: str, *, seed: int = 0) -> Path:
    """Write a random ``kind`` drafter (:data:`KINDS`) for the model folder ``model`` into
    ``out`` (atomically); returns its path."""
    if kind not in WRITERS:
        raise ConfigError(f"--drafter {kind!r}: one of {', '.join(KINDS)}")
    config_file = Path(model) / "config.json"
    try:
        config = json.loads(config_file.read_text())
        target = {
            "hidden_size": int(config["hidden_size"]),
            "vocab_size": int(config["vocab_size"]),
            "layers": int(config["num_hidden_layers"]),
            "context": int(config.get("max_position_embeddings", 2048)),
        }
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{config_file}: not a model config ({e})") from None
    drafter_config, tensors = WRITERS[kind](target, _Random(seed))
    with staged_output(out, force=True) as tmp:
        mx.save_safetensors(str(tmp / "model.safetensors"), tensors)
        (tmp / "config.json").write_text(json.dumps(drafter_config, indent=2))
    return Path(out)
