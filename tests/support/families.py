"""Tiny random configs of the mlx-lm families ReDrafter's verify forward is tested on.

Each is an HF-style ``config.json`` dict, instantiated through mlx-lm's own ``ModelArgs`` and
``Model``. Sizes are the smallest that keep each family's features: grouped K/V heads, MoE
routing, sliding windows shorter than the test sequences (so masking by position is
exercised), soft-capping, NoPE layers.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step

from redrafter_mlx.backend.plan import CPU_PLAN, GENERIC_PLAN
from redrafter_mlx.cli import main
from redrafter_mlx.core.decode.source import SearchSource
from redrafter_mlx.io.demo import FAMILIES as DEMO_FAMILIES
from redrafter_mlx.io.demo import GATED_DELTA
from support import run_steps

VOCAB = 97
BASE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": VOCAB,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}

FAMILIES: dict[str, dict] = {
    "llama": {"model_type": "llama"},
    "llama3": {
        "model_type": "llama",
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "tie_word_embeddings": True,
    },
    "mistral": {"model_type": "mistral", "head_dim": 16},
    "ministral": {  # Llama layers with alternating sliding-window attention
        "model_type": "mistral",
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 5,
    },
    "qwen2": {"model_type": "qwen2", "tie_word_embeddings": True},
    "qwen3": {"model_type": "qwen3", "head_dim": 16, "tie_word_embeddings": True},
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
    },
    "gemma2": {
        "model_type": "gemma2",
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    "gemma3_text": {
        "model_type": "gemma3_text",
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": 5,
        "sliding_window_pattern": 2,
        "num_hidden_layers": 4,
    },
    "phi3": {"model_type": "phi3"},
    "mixtral": {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
    "smollm3": {"model_type": "smollm3", "no_rope_layer_interval": 2},
}


# Hybrid families: attention layers among layers with recurrent state (Gated DeltaNet, short
# convolutions, Mamba2), and Mamba2 alone. Sizes keep every state array small but non-trivial
# (grouped heads, a convolution wider than one token).
HYBRIDS: dict[str, dict] = {
    # the demo model's layouts (`redrafter-mlx demo-model --family`), so both are tested
    "qwen3_5": DEMO_FAMILIES["qwen3_5"],
    "qwen3_5_moe": {
        "model_type": "qwen3_5_moe",
        "num_hidden_layers": 2,
        "full_attention_interval": 2,
        **GATED_DELTA,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    },
    "qwen3_next": {
        "model_type": "qwen3_next",
        "num_hidden_layers": 2,
        "full_attention_interval": 2,
        **GATED_DELTA,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 32,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "partial_rotary_factor": 0.5,
    },
    "lfm2": {**DEMO_FAMILIES["lfm2"], "block_ff_dim": 96},
    "lfm2_moe": {
        "model_type": "lfm2_moe",
        "num_hidden_layers": 3,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "use_expert_bias": True,
        "num_dense_layers": 1,
        "full_attn_idxs": [1],
    },
    "granitemoehybrid": {
        "model_type": "granitemoehybrid",
        "num_hidden_layers": 3,
        "layer_types": ["mamba", "attention", "mamba"],
        "attention_bias": False,
        "embedding_multiplier": 2.0,
        "attention_multiplier": 0.25,
        "logits_scaling": 2.0,
        "residual_multiplier": 0.5,
        "mamba_n_heads": 4,
        "mamba_d_head": 16,
        "mamba_proj_bias": False,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_n_groups": 1,
        "mamba_conv_bias": True,
        "shared_intermediate_size": 64,
        "position_embedding_type": "rope",
    },
    "nemotron_h": DEMO_FAMILIES["nemotron_h"],
    "falcon_h1": {
        **DEMO_FAMILIES["falcon_h1"],
        "num_hidden_layers": 2,
        "tie_word_embeddings": True,
    },
    "mamba2": {
        "model_type": "mamba2",
        "num_heads": 4,
        "head_dim": 32,
        "state_size": 16,
        "layer_norm_epsilon": 1e-5,
        "conv_kernel": 4,
        "n_groups": 1,
        "use_bias": False,
        "use_conv_bias": True,
        "tie_word_embeddings": True,
        "time_step_limit": [0.0, 100.0],
        "time_step_rank": "auto",
    },
    "mamba": {
        "model_type": "mamba",
        "state_size": 8,
        "conv_kernel": 4,
        "use_bias": False,
        "use_conv_bias": True,
        "time_step_rank": 8,
    },
    "jamba": {
        "model_type": "jamba",
        "num_hidden_layers": 2,
        "attn_layer_offset": 1,
        "attn_layer_period": 2,
        "expert_layer_offset": 1,
        "expert_layer_period": 2,
        "mamba_d_conv": 4,
        "mamba_d_state": 8,
        "mamba_expand": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
    },
}


def config(family: str) -> dict:
    return {**BASE, **FAMILIES.get(family, HYBRIDS.get(family))}


def build(family: str, seed: int = 0) -> nn.Module:
    """The family's tiny model with random weights (float32, evaluated)."""
    return build_config(config(family), seed)


def build_config(cfg: dict, seed: int = 0) -> nn.Module:
    """mlx-lm's model for ``cfg`` with random weights, random norms included."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(cfg)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(cfg))
    # norms start at ones (Gemma's at zero): random ones exercise them
    params = [
        (k, mx.random.normal(v.shape) * 0.5)
        for k, v in tree_flatten(model.parameters())
        if "norm" in k
    ]
    model.load_weights(params, strict=False)
    mx.eval(model.parameters())
    return model


def save(model: nn.Module, cfg: dict, out: Path) -> Path:
    """Save ``model`` as an mlx-lm folder (weights + config, no tokenizer)."""
    from mlx_lm.utils import save_config, save_model

    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model)
    save_config(dict(cfg), config_path=out / "config.json")
    return out


def read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def model_folder(family: str, out: Path, tokenizer: Path, seed: int = 0) -> Path:
    """The family's tiny model as an mlx-lm folder with ``tokenizer``'s files (a SentencePiece
    tokenizer; a ChatML chat template is added, so prompts go through the tokenizer's own
    template) and a vocabulary of the tokenizer's size."""
    import shutil

    vocab = json.loads((tokenizer / "tokenizer_config.json").read_text()).get("vocab_size", 32000)
    cfg = {**config(family), "vocab_size": vocab, "eos_token_id": 2, "bos_token_id": 1}
    model = build_config(cfg, seed)
    save(model, cfg, out)
    for f in tokenizer.iterdir():
        shutil.copy(f, out / f.name)
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "chat_template": CHATML}))
    return out


def exchanges(sharegpt: Path, out: Path) -> Path:
    """Each (human, gpt) exchange of a ShareGPT file as a conversation of its own (JSONL): the
    tiny file holds one long conversation, and training holds whole conversations out."""
    lines = []
    for record in json.loads(sharegpt.read_text()):
        turns = record["conversations"]
        for i in range(0, len(turns) - 1, 2):
            lines.append(json.dumps({"conversations": turns[i : i + 2]}))
    out.write_text("\n".join(lines) + "\n")
    return out


# ----------------------------------------------------------------------------------------------
# what the family tests share: plans, references, oracles, folders, commands

PLANS = {"generic": GENERIC_PLAN, "cpu": CPU_PLAN}
PREFIX = [3, 14, 15, 9, 26, 5, 35]  # longer than gemma3_text's test window (5)


def random_beams(rng: np.random.Generator, width: int, length: int, vocab: int) -> np.ndarray:
    """``(W, L)`` beams sharing their root and, often, more of a prefix (a real tree)."""
    beams = rng.integers(0, vocab, (width, length))
    beams[:, 0] = beams[0, 0]
    for w in range(1, width):
        shared = rng.integers(0, length)
        beams[w, :shared] = beams[rng.integers(0, w), :shared]
    return beams


def mlx_lm_greedy(model, prompt: list[int], n: int) -> list[int]:
    steps = generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda x: x.argmax(-1))
    return [int(token) for token, _ in steps]


class PartOracle(SearchSource):
    """Drafts the target's own continuation for a random number of tokens in one beam (a
    random row), then tokens that cannot match, so each step accepts a known count and its
    path is compacted out of the tree."""

    kind = "oracle"

    def __init__(self, continuation: list[int], vocab: int, seed: int):
        self.continuation, self.vocab = continuation, vocab
        self.rng, self.start = np.random.default_rng(seed), 0

    def search(self, context, pending, *, width, length, min_prob=0.0, search_width=0):
        want = np.array(self.continuation[self.start : self.start + length])
        want = np.pad(want, (0, length - len(want)))
        beams = (want + self.rng.integers(1, self.vocab, (width, length))) % self.vocab
        beams[:, 0] = want[0]
        good = int(self.rng.integers(0, length))  # drafted tokens that match
        beams[self.rng.integers(0, width), : good + 1] = want[: good + 1]
        self.start += good + 1
        return mx.array(beams), None, 0


TOKENIZER = "vicuna-7b-v1.3-tokenizer"  # SentencePiece; the folders get a ChatML template
PROMPTS = ["Write a haiku about the sea.", "What is 17 times 3?"]


def train_flags(model: Path, data: Path, root: Path) -> list[str]:
    return [
        "train",
        *("--model", str(model), "--data", str(data)),
        *("--out", str(root / "drafter"), "--cache-dir", str(root / "cache")),
        *("--heldout", "1", "--max-tokens", "4000", "--head", "own", "--draft-vocab", "64"),
        *("--exit-dim", "64", "--batch-size", "32", "--epochs", "6", "--eval-every", "100"),
        *("--seed", "0", "--quiet"),
    ]


QUANTIZED = {"4bit": (64, 4, "affine"), "8bit": (64, 8, "affine"), "mxfp4": (32, 4, "mxfp4")}


def quantized_folder(name: str, kind: str, out: Path) -> Path:
    """The family's tiny model quantized by mlx-lm and saved as a folder (as mlx-community
    publishes them: the ``quantization`` block in config.json)."""
    from mlx_lm.utils import quantize_model

    group_size, bits, mode = QUANTIZED[kind]
    model = build(name)
    _, cfg = quantize_model(model, config(name), group_size, bits, mode=mode)
    return save(model, cfg, out)


def ours(model, prompt: list[int], n: int, drafter=None, shape=None, plan=None) -> list[int]:
    got = []
    for step in run_steps(model, prompt, drafter, shape, plan=plan):
        got += step.tokens
        if len(got) >= n:
            return got[:n]


def run_json(capsys, argv: list[str]) -> dict:
    capsys.readouterr()
    main(argv)
    return json.loads(capsys.readouterr().out)
