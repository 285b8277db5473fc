"""Tokens/s through `redrafter-mlx serve` against the library in one run: the HTTP overhead
per token.

This process loads the model and decodes each prompt with the library (a ``Session``, one
KV cache reused from request to request as the server's is); a server started from the same
checkout at the same beam shape answers the same prompts, whole (one JSON response) and
streamed (server-sent events). Each prompt goes twice through each side, in the same order
(the library's runs mirror "whole" then "streamed"), so both caches hold the same tokens before
each pair of runs and prefill the same. One side computes at a time: the other waits. Greedy:
the texts must be equal (``exact``).

Per pair: wall seconds from the call (library) or from sending the request (server) to the
last token or byte, and their difference per generated token; decode tokens/s from the first
to the last token, as `bench` counts it. Medians over prompts and repetitions:

    PYTHONPATH=. .venv/bin/python benchmarks/serve_overhead.py \\
        --out benchmarks/results/serve_overhead.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from redrafter_mlx.backend.cpu.blas import reexec_with_blas

reexec_with_blas()  # before MLX loads: the BLAS the console script (and so the server) runs with

from redrafter_mlx.core.decode.shape import SHAPE_FIELDS  # noqa: E402
from redrafter_mlx.core.serving.session import Session  # noqa: E402
from redrafter_mlx.io import runtime as rt  # noqa: E402
from redrafter_mlx.io.prompts import load_prompts  # noqa: E402
from redrafter_mlx.tuning.measure import environment  # noqa: E402
from redrafter_mlx.tuning.profiles import resolve_shape  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHAPE_FLAGS = ("--beam-width", "--beam-length", "--min-prob", "--search-width", "--lookup")


def library_run(runtime, session: Session, messages: list[dict], max_tokens: int) -> dict:
    """One greedy answer through the library, the cache reused as the server reuses its own."""
    tic = time.perf_counter()
    ids = rt.encode_chat(runtime, messages)
    parts, stamps = [], []
    for step in session.generate(ids, max_tokens=max_tokens):
        parts.append(step.text)
        stamps += [time.perf_counter()] * len(step.tokens)
    return timing("".join(parts), step.stats.generation_tokens, tic, stamps)


def server_run(port: int, messages: list[dict], max_tokens: int, *, stream: bool) -> dict:
    """One greedy answer through the server: whole, or streamed (tokens counted per chunk)."""
    body = {"messages": messages, "max_tokens": max_tokens, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    tic = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body).encode())
    response = conn.getresponse()
    if not stream:
        answer = json.loads(response.read())
        done = time.perf_counter()
        conn.close()
        tokens = answer["usage"]["completion_tokens"]
        text = answer["choices"][0]["message"]["content"]
        return timing(text, tokens, tic, [done]) | server_side(answer["usage"])
    parts, stamps, usage = [], [], None
    for line in response:
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[6:])
        if event.get("usage"):
            usage = event["usage"]
        if event["choices"] and event["choices"][0]["delta"].get("content"):
            parts.append(event["choices"][0]["delta"]["content"])
            stamps.append(time.perf_counter())
    conn.close()
    return timing("".join(parts), usage["completion_tokens"], tic, stamps) | server_side(usage)


def timing(text: str, tokens: int, tic: float, stamps: list[float]) -> dict:
    """Wall seconds to the last token; decode tokens/s from the first to the last token (a
    stream's chunks carry a step's tokens each: first to last chunk, tokens after the first)."""
    decode = stamps[-1] - stamps[0] if len(stamps) > 1 else None
    return {
        "text": text,
        "tokens": tokens,
        "wall_s": stamps[-1] - tic,
        "decode_tps": (tokens - 1) / decode if decode else None,
    }


def server_side(usage: dict) -> dict:
    """What the server measured inside its worker: the decode loop's own seconds."""
    block = usage["redrafter"]
    return {
        "server_generation_tps": block["generation_tps"],
        "server_decode_s": block["prompt_seconds"] + block["generation_seconds"],
        "steps": block["steps"],
    }


def start_server(args, shape) -> tuple[subprocess.Popen, int, Path]:
    """``redrafter-mlx serve`` of this checkout on a free port, at ``shape``; waits until ready."""
    log = Path(tempfile.mkdtemp(prefix="serve-overhead-")) / "server.log"
    command = [sys.executable, "-m", "redrafter_mlx", "serve", "--port", "0"]
    command += ["--max-tokens", str(args.max_tokens)]
    for flag, value in zip(SHAPE_FLAGS, (getattr(shape, f) for f in SHAPE_FIELDS), strict=True):
        command += [flag, str(max(value, shape.width) if flag == "--search-width" else value)]
    for flag in ("model", "drafter"):
        if getattr(args, flag):
            command += [f"--{flag}", getattr(args, flag)]
    with open(log, "w") as stderr:
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        found = re.search(r"serving the OpenAI API at http://[^:]+:(\d+)/v1", log.read_text())
        if found:
            return process, int(found.group(1)), log
        if process.poll() is not None:
            raise SystemExit(f"the server exited:\n{log.read_text()}")
        time.sleep(0.2)
    process.kill()
    raise SystemExit("the server did not start within 10 minutes")


def median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def summary(pairs: list[dict]) -> dict:
    """Medians per kind (whole, streamed): both sides' tokens/s and the overhead per token."""
    out = {}
    for kind in ("whole", "stream"):
        rows = [p for p in pairs if p["kind"] == kind]
        lib = [p["library"] for p in rows]
        srv = [p["server"] for p in rows]
        per_token = [
            (s["wall_s"] - b["wall_s"]) / s["tokens"] * 1e3 for s, b in zip(srv, lib, strict=True)
        ]
        # the same request's wall time minus the server's own decode loop: HTTP, JSON, the
        # template, the hand-over between threads (no run-to-run noise in it)
        outside = [(s["wall_s"] - s["server_decode_s"]) / s["tokens"] * 1e3 for s in srv]
        out[kind] = {
            "runs": len(rows),
            "library_wall_tps": statistics.median(b["tokens"] / b["wall_s"] for b in lib),
            "server_wall_tps": statistics.median(s["tokens"] / s["wall_s"] for s in srv),
            "library_decode_tps": median(lib, "decode_tps"),
            "server_decode_tps": median(srv, "decode_tps"),
            "server_reported_generation_tps": median(srv, "server_generation_tps"),
            "overhead_ms_per_token": statistics.median(per_token),
            "overhead_ms_per_token_range": [min(per_token), max(per_token)],
            "outside_decode_ms_per_token": statistics.median(outside),
            "outside_decode_ms_per_token_range": [min(outside), max(outside)],
            "exact": all(s["text"] == b["text"] for s, b in zip(srv, lib, strict=True)),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--drafter")
    p.add_argument("--prompts", help="JSONL prompts (default: the shipped MT-Bench)")
    p.add_argument("--num-prompts", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repetitions", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/serve_overhead.json")
    args = p.parse_args()
    runtime = rt.load_runtime(args.model, args.drafter, need_drafter=True)
    shape, source = resolve_shape(runtime)  # the server gets it as flags: the very same shape
    session = Session(runtime.decoder, runtime.tokenizer, rt.decoding(runtime, shape))  # warmed
    conversations = load_prompts(args.prompts, args.num_prompts, 1)
    process, port, log = start_server(args, shape)
    pairs = []
    try:
        for rep in range(args.repetitions):
            for case, conversation in enumerate(conversations):
                messages = [{"role": "user", "content": conversation[0]}]
                for kind in ("whole", "stream"):
                    pair = {"kind": kind, "case": case, "rep": rep}
                    server_first = (rep + case) % 2 == 1  # alternate who goes first
                    sides = ("server", "library") if server_first else ("library", "server")
                    for side in sides:
                        if side == "library":
                            pair[side] = library_run(runtime, session, messages, args.max_tokens)
                        else:
                            stream = kind == "stream"
                            pair[side] = server_run(port, messages, args.max_tokens, stream=stream)
                    pairs.append(pair)
                    lib, srv = pair["library"], pair["server"]
                    print(
                        f"rep {rep} prompt {case} {kind:6}: {srv['tokens']} tokens, library "
                        f"{lib['wall_s']:.3f} s, server {srv['wall_s']:.3f} s "
                        f"({srv['server_decode_s']:.3f} s decoding), "
                        f"{(srv['wall_s'] - lib['wall_s']) / srv['tokens'] * 1e3:+.2f} ms/token",
                        flush=True,
                    )
    finally:
        process.terminate()
        process.wait(timeout=60)
    result = {
        "shape": shape.label,
        "shape_source": source,
        "settings": vars(args),
        "environment": environment(runtime),
        "summary": summary(pairs),
        "pairs": pairs,
        "server_log": log.read_text().splitlines()[:2],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()
