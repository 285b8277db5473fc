"""Shared fixtures: tiny random Llama targets and drafters (no network, float32); the builders
behind them are in tests/support."""

from __future__ import annotations

import os

import mlx.core as mx
import pytest

# Builders re-exported for test modules written before tests/support (import from support).
from support import (  # noqa: F401
    chat_session,
    decoding_of,
    make_runtime,
    run_steps,
    shared_data,
    tiny_llama,
    toy_tokenizer,
    verifier_for,
)

from redrafter_mlx.core.drafter import random_drafter


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
