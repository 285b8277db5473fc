"""A tiny random model to try the own-model path offline: mlx-lm's own classes at a small size,
the embedded SmolLM2's tokenizer and chat template, written as an mlx-lm folder.

Its answers are noise (its weights are random); what it shows is the path a real model takes:
``generate``, ``chat``, ``train`` and ``eval-drafter`` with ``--model DIR``, in seconds.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx

from redrafter_mlx.io.checks import model_classes
from redrafter_mlx.io.convert import (
    gguf_config,
    read_gguf,
    save_folder,
    staged_output,
    write_gguf_tokenizer,
)
from redrafter_mlx.io.embedded import embedded_gguf

# Sizes: the smallest that keep grouped K/V heads; the vocabulary is the tokenizer's.
SIZES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}
FAMILIES = {
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
    "qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "head_dim": 16},
}
# A few short conversations written beside the model, so that `train --data` has something to
# distil offline (the default corpus is a 125 MB optional download).
DEMO_CHATS = Path(__file__).resolve().parent.parent / "data" / "demo_chats.jsonl"
CHATS_NAME = "chats.jsonl"


def demo_config(family: str, embedded: dict) -> dict:
    """``config.json`` of the demo model: :data:`SIZES` in ``family``'s layout, with the
    embedded model's vocabulary, special token ids and RoPE base."""
    shared = ("vocab_size", "bos_token_id", "eos_token_id", "rms_norm_eps", "rope_theta")
    return {
        **{k: embedded[k] for k in shared if k in embedded},
        **SIZES,
        **FAMILIES[family],
        "torch_dtype": "float32",
    }


def write_demo_model(out: str | Path, *, family: str = "llama", seed: int = 0, force: bool = False):
    """Write the demo model folder ``out`` (``config.json``, ``model.safetensors``, the
    tokenizer files and ``chats.jsonl``) atomically; returns its path."""
    gguf = embedded_gguf()
    tensors, meta = read_gguf(gguf)
    config = demo_config(family, gguf_config(meta, tensors, gguf))
    model_class, args_class = model_classes(config, Path(out))
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    mx.eval(model.parameters())
    with staged_output(out, force=force) as tmp:
        save_folder(tmp, model, config)
        write_gguf_tokenizer(meta, config, tmp, gguf)
        shutil.copy(DEMO_CHATS, tmp / CHATS_NAME)
    return Path(out)
