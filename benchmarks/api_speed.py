"""The Python API against the command line: the same prompt, shape and token budget, each run
in a fresh process as a user runs it (the API imported first, no LD_PRELOAD given; the CLI
through its console script), alternating, medians of the decoding's own tokens/s::

    .venv/bin/python benchmarks/api_speed.py --out benchmarks/results/api_speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

PROMPT = "Write a short story about a robot who learns to paint."
API = """
import json, sys
from redrafter_mlx import load, stream_generate
from redrafter_mlx.backend.cpu.blas import blas_in_use
model, tokenizer = load()
messages = [{"role": "user", "content": sys.argv[1]}]
prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
for r in stream_generate(model, tokenizer, prompt, max_tokens=int(sys.argv[2]), beam_width=1,
                         beam_length=2, lookup=1):
    pass
print(json.dumps({"tps": r.generation_tps, "tokens": r.generation_tokens, "blas": blas_in_use()}))
"""


def run_api(max_tokens: int, env: dict) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", API, PROMPT, str(max_tokens)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.splitlines()[-1])


def run_cli(max_tokens: int, env: dict) -> dict:
    cli = Path(sys.executable).with_name("redrafter-mlx")
    flags = ["--beam-width", "1", "--beam-length", "2", "--lookup", "1", "--json"]
    done = subprocess.run(
        [str(cli), "generate", "--prompt", PROMPT, "--max-tokens", str(max_tokens), *flags],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    out = json.loads(done.stdout)
    return {"tps": out["generation_tps"], "tokens": out["generation_tokens"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # as a user starts Python
    runs = {"api": [], "cli": []}
    for rep in range(args.repetitions):
        order = ("api", "cli") if rep % 2 == 0 else ("cli", "api")
        for name in order:
            runs[name].append((run_api if name == "api" else run_cli)(args.max_tokens, env))
    result = {
        name: {
            "median_tps": round(statistics.median(r["tps"] for r in rows), 2),
            "tps": [round(r["tps"], 2) for r in rows],
            "tokens": [r["tokens"] for r in rows],
        }
        for name, rows in runs.items()
    }
    result["api_blas"] = runs["api"][0]["blas"]
    result["ratio_api_to_cli"] = round(result["api"]["median_tps"] / result["cli"]["median_tps"], 3)
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
