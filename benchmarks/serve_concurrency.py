"""Aggregate throughput, latency and time to first token with 1, 2, 4 and 8 concurrent
clients, for three servers on the same weights, interleaved in one run: ours batching
(`serve --max-batch N`), ours serial (`serve --max-batch 1`: one request at a time, as before
issue 45) and mlx-lm's `mlx_lm.server` (continuous batching, no draft model).

Each round sends the same ``--requests`` greedy chat requests (MT-Bench first turns, streamed,
``--max-tokens`` each) from ``c`` client threads that each take the next prompt when their
answer ends; the servers take turns round by round (c = 1, then 2, ...; the server order
rotates each round). Per round: aggregate output tokens/s (all completion tokens over the
round's wall time), median and p95 request latency, median and p95 time to first token (the
first content chunk), and how many answers' texts equal the same server's answers at the first
concurrency level, and each other server's there. Only one server computes at a time; the
others idle. With ``--repetitions R`` each level runs R rounds per server, interleaved (the
order rotating), and a server's figures at a level are the medians of its R rounds (each
round's own under ``"runs"``): this machine's speed drifts 10-20 % within minutes.

``--prompt-tokens N`` sends long prompts instead of MT-Bench: request ``i`` summarises its own
slice of the docs (``README.md``, ``docs/*.md``: held-out text), about N tokens each, so no
two requests share a prefix a prompt cache could reuse. ``--baseline DIR`` adds our batching
server run from another checkout (e.g. ``git archive`` of an older commit unpacked in DIR),
interleaved with the rest; ``--servers`` picks which servers run.

    PYTHONPATH=. .venv/bin/python benchmarks/serve_concurrency.py \\
        --out benchmarks/results/serve_concurrency.json
    REDRAFTER_CPU_TUNING=0 PYTHONPATH=. .venv/bin/python benchmarks/serve_concurrency.py \\
        --clients 4 --requests 8 --prompt-tokens 1800 --servers ours-batched mlx-lm \\
        --mlx-lm-decode-concurrency 4 --baseline /tmp/before
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from redrafter_mlx.backend.cpu.blas import reexec_with_blas

reexec_with_blas()  # before MLX loads: the servers inherit the same BLAS

from redrafter_mlx.io.embedded import default_model_path  # noqa: E402
from redrafter_mlx.io.prompts import load_prompts  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MLX_LM, BASELINE = "mlx-lm", "ours-baseline"


def start(name: str, command: list[str], checkout: Path = ROOT) -> tuple[subprocess.Popen, int]:
    """Start a server on a free port (``{port}`` in ``command``), running the code of
    ``checkout``; wait until it answers."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = Path(tempfile.mkdtemp(prefix=f"concurrency-{name}-")) / "server.log"
    command = [c.replace("{port}", str(port)) for c in command]
    with open(log, "w") as stderr:
        env = os.environ | {"PYTHONPATH": str(checkout)}
        process = subprocess.Popen(command, cwd=checkout, env=env, stdout=stderr, stderr=stderr)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{name} exited:\n{log.read_text()}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/v1/models")
            if conn.getresponse().status == 200 and _ready(name, log):
                return process, port
        except OSError:
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit(f"{name} did not start")


def long_prompts(count: int, length: int, model: str) -> list[str]:
    """``count`` requests of about ``length`` tokens each: a summary asked of a slice of the
    docs, each request its own slice (starts spread over the text when it is too short for
    ``count`` disjoint ones)."""
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(Path(model))
    text = "\n\n".join(p.read_text() for p in [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md"))])
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < length + count:
        raise SystemExit(f"the docs hold {len(ids)} tokens: too few for --prompt-tokens {length}")
    step = min(length, (len(ids) - length) // max(count - 1, 1))
    ask = "\n\nSummarise the text above in five short bullet points."
    return [tokenizer.decode(ids[i * step : i * step + length]) + ask for i in range(count)]


def _ready(name: str, log: Path) -> bool:
    return name == MLX_LM or bool(re.search(r"serving the OpenAI API at", log.read_text()))


def ask(port: int, prompt: str, max_tokens: int) -> dict:
    """One streamed greedy chat request -> text, completion tokens, TTFT and latency."""
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
    tic = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body).encode())
    response = conn.getresponse()
    parts, first, usage, chunks = [], None, None, 0
    for line in response:
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[6:])
        usage = event.get("usage") or usage
        choices = event.get("choices") or []
        if choices and choices[0].get("delta", {}).get("content"):
            first = first or time.perf_counter()
            parts.append(choices[0]["delta"]["content"])
            chunks += 1
    done = time.perf_counter()
    conn.close()
    tokens = usage["completion_tokens"] if usage else chunks
    return {
        "text": "".join(parts),
        "tokens": tokens,
        "ttft_s": (first or done) - tic,
        "latency_s": done - tic,
    }


def run_clients(count: int, clients: int, answer) -> float:
    """``answer(i)`` for every ``i < count``, from ``clients`` threads that each take the next
    ``i`` when their answer ends -> wall seconds until the last has ended."""
    lock, todo = threading.Lock(), list(range(count))

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            answer(i)

    tic = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - tic


def round_of(port: int, prompts: list[str], clients: int, max_tokens: int) -> dict:
    """All ``prompts`` through ``clients`` concurrent clients -> the round's figures."""
    results: dict[int, dict] = {}

    def answer(i: int) -> None:
        results[i] = ask(port, prompts[i], max_tokens)

    wall = run_clients(len(prompts), clients, answer)
    rows = [results[i] for i in range(len(prompts))]
    return {
        "wall_s": wall,
        "tokens": sum(r["tokens"] for r in rows),
        "aggregate_tps": sum(r["tokens"] for r in rows) / wall,
        "latency_median_s": statistics.median(r["latency_s"] for r in rows),
        "latency_p95_s": p95([r["latency_s"] for r in rows]),
        "ttft_median_s": statistics.median(r["ttft_s"] for r in rows),
        "ttft_p95_s": p95([r["ttft_s"] for r in rows]),
        "texts": [r["text"] for r in rows],
    }


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def summary(name: str, rounds: list[dict]) -> dict:
    """A server's rounds at one level -> the medians of their figures, the fewest texts equal
    to each server's first answers (``same_texts_as_alone``: its own), and the rounds."""
    figures = {
        k: statistics.median(r[k] for r in rounds)
        for k, v in rounds[0].items()
        if isinstance(v, float | int)
    }
    same = {o: min(r["same_texts_as"][o] for r in rounds) for o in rounds[0]["same_texts_as"]}
    figures |= {"same_texts_as_alone": same[name], "same_texts_as": same}
    return figures | ({"runs": rounds} if len(rounds) > 1 else {})


def environment() -> dict:
    """What the numbers depend on: versions, BLAS, cores (the machine was shared: say so)."""
    import os

    import mlx.core as mx
    import mlx_lm

    blas = os.environ.get("LD_PRELOAD", "") or "the wheel's own"
    return {
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "blas": blas,
        "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        "cpus": os.cpu_count(),
        "device": str(mx.default_device()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--requests", type=int, default=8, help="requests per round")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=8, help="our batching server's")
    parser.add_argument("--repetitions", type=int, default=1, help="rounds per server and level")
    parser.add_argument("--prompt-tokens", type=int, default=0, help="long prompts (0: MT-Bench)")
    names = ["ours-batched", "ours-serial", MLX_LM]
    parser.add_argument("--servers", nargs="+", choices=names, default=names)
    parser.add_argument("--baseline", type=Path, default=None, help="another checkout's batching")
    parser.add_argument("--mlx-lm-decode-concurrency", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model = str(default_model_path())
    ours = [sys.executable, "-m", "redrafter_mlx", "serve", "--port", "{port}"]
    ours += ["--queue-size", "32", "--max-tokens", str(args.max_tokens)]
    mlx_lm = [sys.executable, "-m", "mlx_lm.server", "--model", model, "--port", "{port}"]
    if args.mlx_lm_decode_concurrency:
        mlx_lm += ["--decode-concurrency", str(args.mlx_lm_decode_concurrency)]
    commands = {
        "ours-batched": (ours + ["--max-batch", str(args.max_batch)], ROOT),
        "ours-serial": (ours + ["--max-batch", "1"], ROOT),
        MLX_LM: (mlx_lm, ROOT),
    }
    commands = {name: commands[name] for name in args.servers}
    if args.baseline:
        commands[BASELINE] = (ours + ["--max-batch", str(args.max_batch)], args.baseline.resolve())
    if args.prompt_tokens:
        prompts = long_prompts(args.requests, args.prompt_tokens, model)
    else:
        prompts = [turns[0] for turns in load_prompts(None, args.requests, 1)]
    servers = {name: start(name, *command) for name, command in commands.items()}
    for _, port in servers.values():  # a first request may build what a server builds lazily
        ask(port, "Hello", 8)
    runs: dict[str, dict[int, list[dict]]] = {name: {} for name in servers}
    turn = 0
    try:
        for clients in args.clients:
            for _ in range(args.repetitions):
                names = list(servers)
                names = names[turn % len(names) :] + names[: turn % len(names)]
                turn += 1
                for name in names:
                    figures = round_of(servers[name][1], prompts, clients, args.max_tokens)
                    runs[name].setdefault(clients, []).append(figures)
                    shown = {k: v for k, v in figures.items() if k != "texts"}
                    print(name, clients, json.dumps(shown), file=sys.stderr, flush=True)
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(timeout=60)
    first = {name: by_clients[args.clients[0]][0]["texts"] for name, by_clients in runs.items()}
    for by_clients in runs.values():
        for rounds in by_clients.values():
            for figures in rounds:
                texts = figures.pop("texts")
                figures["same_texts_as"] = {
                    other: sum(a == b for a, b in zip(texts, theirs, strict=True))
                    for other, theirs in first.items()
                }
    rounds = {
        name: {clients: summary(name, rs) for clients, rs in by_clients.items()}
        for name, by_clients in runs.items()
    }
    report = {
        "environment": environment(),
        "args": vars(args) | {"out": str(args.out)},
        "model": model,
        "rounds": rounds,
    }
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
