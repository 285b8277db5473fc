"""What the tests share: tiny random Llama targets, a toy tokenizer, decoders, decodings and
runtimes built over them (no network, float32). Test modules import builders from here (and
from its modules: families, chat, decoding, serving, distributed, tool_model), never from one
another; pytest fixtures stay in conftest.py."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map
from mlx_lm.models import llama

# The workspace's shared data folder next to the checkout (``../shared/data``).
SHARED = Path(os.environ.get("REDRAFTER_SHARED", Path(__file__).resolve().parents[3] / "shared"))


def readme_python_example() -> str:
    """The first ``python`` block of the README's "Python API" section."""
    readme = Path(__file__).resolve().parents[2] / "README.md"
    section = readme.read_text().split("## Python API", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def shared_data(relative: str) -> Path:
    """A file or folder of the shared data; skips the calling test when it is missing."""
    path = SHARED / "data" / relative
    if not path.exists():
        pytest.skip(f"shared test data missing: {path} (set REDRAFTER_SHARED)")
    return path


def tiny_llama(
    seed: int = 0,
    vocab: int = 64,
    hidden: int = 64,
    layers: int = 2,
    tie: bool = False,
    scale: float = 4.0,
    **overrides,
) -> llama.Model:
    """A random Llama whose greedy continuations vary (weights scaled up from the init);
    ``overrides``: more ``llama.ModelArgs`` fields (RoPE settings)."""
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=2 * hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        tie_word_embeddings=tie,
        max_position_embeddings=4096,
        **overrides,
    )
    model = llama.Model(args)
    model.update(tree_map(lambda p: p * scale if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    return model


def toy_hf_tokenizer():
    """A 64-word HF tokenizer ("w0".."w63", EOS "w63") with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w63", unk_token="w0")
    hf.chat_template = (
        "{% for m in messages %}w2 {{ m['content'] }} w3 {% endfor %}"
        "{% if add_generation_prompt %}w4{% endif %}"
    )
    return hf


def toy_tokenizer():
    """:func:`toy_hf_tokenizer`, mlx-lm wrapped."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return TokenizerWrapper(toy_hf_tokenizer())


_VERIFIERS: dict = {}  # built once per (model, drafter, plan, context): forwards compile once


def tiny_model_folder(out: Path, *, bits: int | None = None) -> Path:
    """The tiny Llama as an mlx-lm folder with the toy tokenizer; ``bits``: quantized as
    ``mlx_lm.convert -q`` leaves it (quantized layers, ``quantization`` in config.json)."""
    import mlx.nn as nn

    from support.families import save

    model = tiny_llama()
    cfg = {**dict(vars(model.args)), "architectures": ["LlamaForCausalLM"]}
    if bits:
        nn.quantize(model, group_size=32, bits=bits)
        cfg["quantization"] = {"group_size": 32, "bits": bits}
    save(model, cfg, out)
    toy_hf_tokenizer().save_pretrained(str(out))
    return out


def decoder_for(model, drafter=None, plan=None, max_context=None):
    """The :class:`Decoder` of ``model`` and ``drafter`` on ``plan`` (default: generic),
    shared by the tests that ask for the same one (the key's objects are kept alive)."""
    from redrafter_mlx.backend.plan import GENERIC_PLAN, build_decoder

    plan = GENERIC_PLAN if plan is None else plan
    key = (id(model), id(drafter), plan, max_context)
    if key not in _VERIFIERS:
        built = build_decoder(model, drafter, plan=plan, max_context=max_context)
        _VERIFIERS[key] = (model, drafter, built)
    return _VERIFIERS[key][2]


def decoding_of(drafter=None, shape=None, sampler=None, *, autoregressive=False):
    """The :class:`Decoding` of a run with ``drafter`` (or None) at ``shape``."""
    from redrafter_mlx.core.decode.accept import greedy
    from redrafter_mlx.core.decode.mode import Mode
    from redrafter_mlx.core.decode.shape import BeamShape
    from redrafter_mlx.core.decode.step import Decoding

    shape = BeamShape() if shape is None else shape
    autoregressive = autoregressive or (drafter is None and not shape.lookup)
    mode = Mode.choose(drafter=drafter is not None, shape=shape, autoregressive=autoregressive)
    return Decoding(mode, shape, greedy if sampler is None else sampler)


def run_steps(
    model,
    prompt,
    drafter=None,
    shape=None,
    sampler=None,
    *,
    plan=None,
    max_context=None,
    cache=None,
    autoregressive=False,
):
    """The decode loop's steps (the prefill's first token first) for ``prompt``."""
    from redrafter_mlx.core.decode.stream import decode_steps

    decoder = decoder_for(model, drafter, plan, max_context)
    decoding = decoding_of(drafter, shape, sampler, autoregressive=autoregressive)
    cache = decoder.new_sequence() if cache is None else cache
    return decode_steps(decoder, cache, prompt, decoding)


def make_runtime(model, tokenizer, config, drafter=None, model_id="tiny", drafter_id=None):
    """A :class:`Runtime` as ``load_runtime`` builds it, over an in-memory model."""
    from redrafter_mlx.backend.plan import build_decoder
    from redrafter_mlx.io.runtime import Runtime

    decoder = build_decoder(model, drafter, max_context=config.get("max_position_embeddings"))
    return Runtime(decoder.model, tokenizer, config, drafter, model_id, drafter_id, decoder)


def chat_session(
    model,
    drafter=None,
    shape=None,
    template=None,
    *,
    plan=None,
    max_context=None,
    autoregressive=False,
    **kwargs,
):
    """A chat over ``model`` (autoregressive without a drafter unless the shape has lookup
    beams), warmed up as the command's is."""
    from redrafter_mlx.cli.chat import ChatSession
    from redrafter_mlx.core.serving.session import Session

    decoder = decoder_for(model, drafter, plan, max_context)
    decoding = decoding_of(drafter, shape, autoregressive=autoregressive)
    tokenizer = kwargs.pop("tokenizer")
    return ChatSession(Session(decoder, tokenizer, decoding), template, **kwargs)


LETTERS = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")


def write_conversations(path: Path, n: int, seed: int = 0) -> None:
    """``n`` two-exchange ShareGPT conversations, written as a JSON array cut off mid-way."""
    rng = np.random.default_rng(seed)

    def text(k):
        return " ".join("".join(rng.choice(LETTERS, rng.integers(2, 7))) for _ in range(k))

    convs = [
        {
            "id": str(i),
            "conversations": [
                {"from": "human", "value": text(3)},
                {"from": "gpt", "value": text(12)},
                {"from": "human", "value": text(2)},
                {"from": "gpt", "value": text(8)},
            ],
        }
        for i in range(n + 1)
    ]
    full = json.dumps(convs, indent=1)
    path.write_text(full[: full.rindex('"from": "gpt"')])  # the last conversation is cut off
