"""Serving for the tests: a generation service over a tiny target (:func:`tiny_service`), and
the real server, `serve --port 0` on the embedded model in a process of its own
(:func:`serving`, a :class:`Served` to talk to it), with module fixtures for one server, the
model loaded in this process, and the library's own answers to compare with."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from redrafter_mlx.backend.cpu import blas
from redrafter_mlx.core.decode.mode import Mode
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.drafters.beam_search import BeamDrafter
from redrafter_mlx.core.serving.service import Engine, GenerationService
from redrafter_mlx.core.serving.session import Session
from support import decoder_for, decoding_of, toy_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def tiny_service(
    target, drafter=None, *, queue_size=4, max_context=None, plan=None, **cache_bounds
) -> GenerationService:
    """A started service over the tiny target; prompts are token ids."""
    shape = BeamShape(2, 3)
    beams = None if drafter is None else BeamDrafter(drafter, target.model.embed_tokens)

    def setup() -> Engine:
        decoder = decoder_for(target, beams, plan, max_context)
        mode = Mode.REDRAFTER if beams is not None else Mode.AUTOREGRESSIVE
        return Engine(decoder, toy_tokenizer(), list, mode, shape, shape)

    service = GenerationService(setup, queue_size=queue_size, **cache_bounds)
    service.start()
    return service


def reference_tokens(target, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy autoregressive tokens from an empty cache."""
    session = Session(decoder_for(target), toy_tokenizer(), decoding_of(), warm=False)
    return [t for step in session.generate(prompt, max_tokens=max_tokens) for t in step.tokens]


def run(job, timeout: float = 120) -> tuple[list[int], str | None]:
    """A job's tokens and finish reason (queue.Empty when it is silent for ``timeout`` s)."""
    job.start(timeout=timeout)
    steps = list(job.steps(timeout=timeout))
    return [t for s in steps for t in s.tokens], steps[-1].finish_reason


SHAPE = [
    "--beam-width",
    "1",
    "--beam-length",
    "3",
    "--min-prob",
    "0",
    "--search-width",
    "1",
    "--lookup",
    "0",
]
QUEUE_SIZE = 4
MODEL = "smollm2-135m-instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Write a long story about a dragon who learns to cook."}]


def env() -> dict:
    e = dict(os.environ)
    if os.path.exists(blas.OPENBLAS):
        e["LD_PRELOAD"] = blas.OPENBLAS
    return e


@dataclass
class Served:
    url: str  # http://127.0.0.1:PORT
    log: Path
    pid: int | None = None  # the server process (its memory is watched by the soak test)

    def client(self, **options):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", timeout=120, **options)

    def request(self, path: str, body=None, *, method="POST", headers=None):
        """(status, headers, JSON body) of one raw HTTP request."""
        parts = urlsplit(self.url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
        data = body if isinstance(body, bytes | None) else json.dumps(body).encode()
        conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        payload = response.read()
        conn.close()
        return response.status, response.headers, json.loads(payload)  # names in any case

    def health(self) -> dict:
        return self.request("/health", method="GET")[2]


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@contextlib.contextmanager
def serving(
    log: Path,
    *args: str,
    ready_line: str = "serving the OpenAI API at",
    command: list[str] | None = None,
):
    """A `serve --port 0` process with ``args`` (or ``command`` with them), its stderr into
    ``log``: its :class:`Served` once ``ready_line`` (then the URL) is printed; stopped
    after."""
    command = [*(command or [sys.executable, "-m", "redrafter_mlx", "serve", "--port", "0"]), *args]
    with open(log, "w") as stderr:  # a file, not a pipe: nobody reads it while tests run
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env(),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    found = []

    def ready() -> bool:
        assert process.poll() is None, f"the server exited:\n{log.read_text()}"
        found[:] = re.findall(rf"{ready_line} (http://[^/\s]+)", log.read_text())
        return bool(found)

    try:
        wait_until(ready, 180, "the server to start")
        yield Served(found[0], log, process.pid)
    finally:
        process.terminate()
        process.wait(timeout=30)


WIRE_SERVER = [sys.executable, str(ROOT / "tests" / "support" / "wire_server.py")]


def wire_serving(log: Path, *args: str):
    """:func:`serving` of the HTTP server with no model behind it (``wire_server.py``):
    every API's checks and refusals, a 503 for what passes them; starts in a second."""
    return serving(log, *args, command=WIRE_SERVER)
