"""Shared fixtures: tiny random Llama targets and drafters (no network, float32)."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_map
from mlx_lm.models import llama

from redrafter_mlx.core.drafter import random_drafter

# The workspace's shared data folder next to the checkout (``../shared/data``).
SHARED = Path(os.environ.get("REDRAFTER_SHARED", Path(__file__).resolve().parents[2] / "shared"))


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


@pytest.fixture(scope="session", autouse=True)
def own_redrafter_cache(tmp_path_factory):
    """A cache of the test session's own (``$REDRAFTER_CACHE``, subprocesses too): `train`
    records every drafter it writes there for discovery, and a test's must not be found by
    the user's commands. Its ``models`` is the user's (the embedded model converts once)."""
    from redrafter_mlx.core.paths import cache_dir

    models = cache_dir() / "models"
    models.mkdir(parents=True, exist_ok=True)
    own = tmp_path_factory.mktemp("redrafter-cache")
    (own / "models").symlink_to(models.resolve(), target_is_directory=True)
    before = os.environ.get("REDRAFTER_CACHE")
    os.environ["REDRAFTER_CACHE"] = str(own)
    yield own
    if before is None:
        del os.environ["REDRAFTER_CACHE"]
    else:
        os.environ["REDRAFTER_CACHE"] = before


@pytest.fixture(scope="session")
def target():
    return tiny_llama()


@pytest.fixture(scope="session")
def drafter(target):
    return random_drafter(target.args.hidden_size, target.args.vocab_size, seed=1)


@pytest.fixture
def traces(monkeypatch):
    """Functions compiled from now on append themselves here each time mlx traces them."""
    seen, real_compile = [], mx.compile

    def counting_compile(fun, *args, **kwargs):
        def traced(*inputs):
            seen.append(fun)  # the Python body runs only while mlx traces
            return fun(*inputs)

        return real_compile(traced, *args, **kwargs)

    monkeypatch.setattr(mx, "compile", counting_compile)
    return seen


def toy_tokenizer():
    """A 64-word HF tokenizer ("w0".."w63", EOS "w63") with a chat template, mlx-lm wrapped."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
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
    return TokenizerWrapper(hf)
