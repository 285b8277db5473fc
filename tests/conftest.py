"""Shared fixtures: tiny random Llama targets and drafters (no network, float32); the builders
behind them are in tests/support."""

from __future__ import annotations

import faulthandler
import os

import mlx.core as mx
import pytest
from support import tiny_llama
from support.serving import QUEUE_SIZE, SHAPE, serving

from redrafter_mlx.core.decode.mode import Mode
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.drafters.redrafter import random_drafter
from redrafter_mlx.core.serving.session import Session


def pytest_collection_modifyitems(config, items):
    """``soak`` tests run only when asked (``-m soak``): .ci/run runs them after make test."""
    if "soak" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="soak tests run only when asked: pytest -m soak (.ci/run does)")
    for item in items:
        if "soak" in item.keywords:
            item.add_marker(skip)


# A test still running after this long is stuck, not slow (the slowest take about two minutes):
# every thread's stack goes to stderr and the session ends, so CI fails in minutes with the place
# it stuck rather than at its own limit with nothing said. faulthandler's watchdog is a C thread:
# it fires even while a native call holds the GIL.
STUCK_AFTER_S = float(os.environ.get("REDRAFTER_TEST_STUCK_AFTER", "900"))


REAL_STDERR = pytest.StashKey()


def pytest_configure(config):
    """The session's real stderr, kept while no capture is active (during a test, fd 2 is
    pytest's capture file, which a process that exits mid-test never shows)."""
    config.stash[REAL_STDERR] = os.fdopen(os.dup(2), "w")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    faulthandler.dump_traceback_later(STUCK_AFTER_S, exit=True, file=item.config.stash[REAL_STDERR])
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="session", autouse=True)
def own_redrafter_cache(tmp_path_factory):
    """A cache of the test session's own (``$REDRAFTER_CACHE``, subprocesses too): `train`
    records every drafter it writes there for discovery, and a test's must not be found by
    the user's commands. Its ``models`` and native builds are the user's: the embedded model
    converts once, and the CPU kernels build once per source and compiler, not per session
    (builds are keyed by both and checked before use: backend/cpu/native.py)."""
    from redrafter_mlx.core.paths import cache_dir

    own = tmp_path_factory.mktemp("redrafter-cache")
    for shared in ("models", "kernels", "blas"):
        folder = cache_dir() / shared
        folder.mkdir(parents=True, exist_ok=True)
        (own / shared).symlink_to(folder.resolve(), target_is_directory=True)
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


# The embedded model served over HTTP, and its own answers (test_serve, test_fuzz_http)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("openai")
    log = tmp_path_factory.mktemp("serve") / "server.log"
    # the serial server: its tests count queued requests (test_batch_http serves batched)
    with serving(log, "--queue-size", str(QUEUE_SIZE), "--max-batch", "1", *SHAPE) as served:
        yield served


@pytest.fixture(scope="module")
def runtime():
    """The embedded model, loaded in this process."""
    from redrafter_mlx.io import runtime as rt

    return rt.load_runtime(None, None, need_drafter=False)


@pytest.fixture(scope="module")
def reference(runtime):
    """The library's greedy plain decoding in this process: what `generate` prints."""
    from redrafter_mlx.io import runtime as rt

    plain = rt.decoding(runtime, BeamShape(1, 2), mode=Mode.AUTOREGRESSIVE)

    def answer(prompt, max_tokens: int) -> tuple[str, str]:
        if isinstance(prompt, str):
            ids = runtime.tokenizer.encode(prompt)
        else:
            ids = rt.encode_chat(runtime, prompt)
        session = Session(runtime.decoder, runtime.tokenizer, plain, warm=False)
        steps = list(session.generate(ids, max_tokens=max_tokens))
        return "".join(s.text for s in steps), steps[-1].finish_reason

    return answer
