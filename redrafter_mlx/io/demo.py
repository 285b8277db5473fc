"""A tiny random model to try the own-model path offline: mlx-lm's own classes at a small size
(attention-only families, and hybrids whose recurrent layers the tree forward verifies),
the embedded SmolLM2's tokenizer and chat template, written as an mlx-lm folder.

Its answers are noise (its weights are random); what it shows is the path a real model takes:
``generate``, ``chat``, ``train`` and ``eval-drafter`` with ``--model DIR``, in seconds.
"""

from __future__ import annotations

import json
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
# Gated DeltaNet layers (Qwen3.5): grouped key heads, a 4-wide convolution
GATED_DELTA = {
    "head_dim": 16,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
}
FAMILIES = {
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
    "qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "head_dim": 16},
    # Hybrids (recurrent-state layers among attention layers), as io/checks.py verifies them:
    # Gated DeltaNet, short convolutions, Mamba2 (tests/support/families.py tests these)
    "qwen3_5": {
        "model_type": "qwen3_5",
        "num_hidden_layers": 4,
        "full_attention_interval": 2,
        **GATED_DELTA,
    },
    "lfm2": {
        "model_type": "lfm2",
        "num_hidden_layers": 3,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 64,
        "block_ff_dim": 128,
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "full_attn_idxs": [1],
    },
    "nemotron_h": {
        "model_type": "nemotron_h",
        "hybrid_override_pattern": ["M", "*", "-", "M"],
        "num_hidden_layers": 4,
        "attention_bias": False,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "mamba_proj_bias": False,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 1,
        "mlp_bias": False,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
        "head_dim": 16,
    },
    "falcon_h1": {
        "model_type": "falcon_h1",
        "head_dim": 16,
        "mamba_d_conv": 4,
        "mamba_d_head": 16,
        "mamba_d_ssm": 64,
        "mamba_d_state": 16,
        "mamba_n_heads": 4,
        "mamba_n_groups": 1,
    },
}
# A Qwen/Hermes-style chat template that takes tools, for ``agent``: mlx-lm finds its
# ``json_tools`` parser in it (``<tool_call>`` and ``tool_call.name``).
AGENT_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}<|im_start|>assistant
{{ message.content or '' }}
{%- for tool_call in message.tool_calls or [] %}
{%- if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}
<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role != 'system' %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

AGENT_CONTEXT = 131072  # what coding agents' 10-30K-token requests need, with room to grow

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


def write_demo_model(
    out: str | Path,
    *,
    family: str = "llama",
    seed: int = 0,
    force: bool = False,
    agent: bool = False,
):
    """Write the demo model folder ``out`` (``config.json``, ``model.safetensors``, the
    tokenizer files and ``chats.jsonl``) atomically; returns its path. ``agent``: with a chat
    template that takes tools (:data:`AGENT_TEMPLATE`) and a context of
    :data:`AGENT_CONTEXT` tokens, so that coding agents' requests are served (their answers
    are noise too)."""
    gguf = embedded_gguf()
    tensors, meta = read_gguf(gguf)
    config = demo_config(family, gguf_config(meta, tensors, gguf))
    if agent:
        config["max_position_embeddings"] = AGENT_CONTEXT
    model_class, args_class = model_classes(config, Path(out))
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    mx.eval(model.parameters())
    with staged_output(out, force=force) as tmp:
        save_folder(tmp, model, config)
        write_gguf_tokenizer(meta, config, tmp, gguf)
        if agent:
            _set_chat_template(tmp, AGENT_TEMPLATE)
        shutil.copy(DEMO_CHATS, tmp / CHATS_NAME)
    return Path(out)


def _set_chat_template(folder: Path, template: str) -> None:
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "chat_template": template}, indent=2))
