"""What a sharded target costs per step and how link latency moves tokens/s and the speculative
gain: one process, then 2 ranks (ring backend, localhost) with tensor and pipeline sharding,
each with a delay added to every exchange.

Two processes on one machine exchange through loopback in microseconds, which hides the
network. The delay models a link: at each exchange point of the target's forward (every
``mx.distributed`` all-sum, all-gather, send and receive the sharded model calls) each rank
evaluates the exchange's input, sleeps ``--delays`` ms, then exchanges. That is a blocking
round trip of that latency at each point (the lazy graph is cut there, as a real link's wait
would stall it); it models latency only, not bandwidth.

Per setting, after a warm-up answer: autoregressive answers (a one-token step per token) and
speculative answers (the same greedy output, a tree step per step), timed by the decode loop's
own stats. The gain is speculative tokens/s over autoregressive tokens/s. The target is a
random Qwen2 (mlx-lm's class; ``--hidden``, ``--layers``) with lookup beams only, as no
trained drafter exists for it: its greedy output repeats, which lookup beams predict, so its
tokens/step stands in for a drafter's (it is printed with the results).

    sleep infinity | .venv/bin/python benchmarks/shard_latency.py \\
        --out benchmarks/results/shard_latency.json

(``sleep infinity |``: mlx.launch polls a closed stdin in a busy loop that takes a core.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"
PROMPT = [1, 450, 4996, 310, 278, 3186, 338, 263, 5650, 310, 278, 3186, 338]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/shard_latency.json")
    p.add_argument("--delays", default="0,0.1,0.5,2", help="ms added per exchange")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=48, help="tokens per timed answer")
    p.add_argument("--answers", type=int, default=2, help="timed answers per mode")
    p.add_argument("--shape", default="1,4,2", help="W,L,K of the speculative steps")
    p.add_argument("--port", type=int, default=39400)
    p.add_argument("--rank-run", nargs=3, metavar=("MODEL", "SHARD", "DELAY"), help="internal")
    return p.parse_args()


def make_model(folder: Path, hidden: int, layers: int) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from support import families  # the tests' tiny mlx-lm folders

    families.BASE.update(
        hidden_size=hidden, num_hidden_layers=layers, intermediate_size=3 * hidden,
        num_attention_heads=8, num_key_value_heads=4,
    )  # fmt: skip
    tokenizer = ROOT.parent / "shared" / "data" / "vicuna-7b-v1.3-tokenizer"
    return families.model_folder("qwen2", folder, tokenizer)


def delay_exchanges(ms: float) -> None:
    """Every exchange the model makes waits ``ms`` first (see the module's docstring)."""
    import mlx.core as mx

    if not ms:
        return
    dist = mx.distributed
    for name in ("all_sum", "all_gather", "send", "recv_like"):
        real = getattr(dist, name)

        def delayed(x, *args, _real=real, **kwargs):
            mx.eval(x)
            time.sleep(ms / 1e3)
            return _real(x, *args, **kwargs)

        setattr(dist, name, delayed)


def timed(session, decoding, tokens: int, answers: int) -> dict:
    """Tokens/s, tokens/step and ms/step over ``answers`` answers (after one untimed)."""
    totals = {"tokens": 0, "steps": 0, "seconds": 0.0}
    for k in range(answers + 1):
        ids = PROMPT + [100 + k]  # no cached prefix: each answer's prompt differs at its end
        session.reset()
        *_, last = session.generate(ids, max_tokens=tokens, decoding=decoding)
        stats = last.stats
        if k:
            totals["tokens"] += stats.generation_tokens
            totals["steps"] += stats.steps
            totals["seconds"] += stats.generation_tokens / stats.generation_tps
    return {
        "tokens_per_s": totals["tokens"] / totals["seconds"],
        "tokens_per_step": totals["tokens"] / totals["steps"],
        "ms_per_step": 1e3 * totals["seconds"] / totals["steps"],
    }


def rank_run(model: str, shard: str, delay: float, args: argparse.Namespace) -> None:
    from redrafter_mlx.core.decode.mode import Mode
    from redrafter_mlx.core.decode.shape import BeamShape
    from redrafter_mlx.core.decode.step import Decoding
    from redrafter_mlx.core.serving.distributed import follow, session_for

    width, length, lookup = (int(x) for x in args.shape.split(","))
    shape = BeamShape(width=width, length=length, lookup=lookup)
    if shard == "none":
        from redrafter_mlx.io.runtime import load_runtime

        runtime, orders = load_runtime(model, "none", need_drafter=False), None
    else:
        from redrafter_mlx.io.sharded import load_runtime

        runtime, orders = load_runtime(model, "none", shard, need_drafter=False)
    delay_exchanges(delay)
    if orders is not None and not orders.lead:
        follow(runtime.decoder, runtime.tokenizer, orders)
        return
    result = {"shard": shard, "ranks": 1 if orders is None else orders.size, "delay_ms": delay}
    for mode in (Mode.AUTOREGRESSIVE, Mode.LOOKUP):
        decoding = Decoding(mode, shape)
        runtime.decoder.warm_up(decoding)
        session = session_for(runtime.decoder, runtime.tokenizer, decoding, warm=False)
        result[mode.value] = timed(session, decoding, args.tokens, args.answers)
    result["gain"] = result["lookup"]["tokens_per_s"] / result["autoregressive"]["tokens_per_s"]
    if orders is not None:
        orders.stop()
    print("RESULT " + json.dumps(result), flush=True)


def launch(model: Path, shard: str, delay: float, args: argparse.Namespace) -> dict:
    me = [sys.executable, __file__, *sys.argv[1:], "--rank-run", str(model), shard, str(delay)]
    if shard == "none":
        command = me
    else:
        hosts = ["--hosts", "127.0.0.1", "-n", "2", "--backend", "ring", "-p", str(args.port)]
        command = [sys.executable, "-c", LAUNCH, *hosts, "--", *me]
        args.port += 10
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=out, stderr=err, text=True
        )  # stdin stays open: mlx.launch polls a closed one in a busy loop
        try:
            proc.wait(1800)
        finally:
            proc.kill()
            proc.stdin.close()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    lines = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
    if not lines:
        raise SystemExit(f"{shard} {delay} ms failed:\n{stdout}\n{stderr}")
    return json.loads(lines[0][len("RESULT ") :])


def main() -> None:
    args = parse()
    if args.rank_run:
        model, shard, delay = args.rank_run
        rank_run(model, shard, float(delay), args)
        return
    delays = [float(x) for x in args.delays.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "model", args.hidden, args.layers)
        runs = [launch(model, "none", 0.0, args)]
        for shard in ("tensor", "pipeline"):
            runs += [launch(model, shard, d, args) for d in delays]
    for r in runs:
        one, tree = r["autoregressive"], r["lookup"]
        print(
            f"{r['shard']:>8} x{r['ranks']} +{r['delay_ms']:>4} ms: one-token step "
            f"{one['ms_per_step']:6.1f} ms ({one['tokens_per_s']:5.1f} tok/s), tree step "
            f"{tree['ms_per_step']:6.1f} ms ({tree['tokens_per_step']:.2f} tok/step, "
            f"{tree['tokens_per_s']:5.1f} tok/s), gain {r['gain']:.2f}x"
        )
    record = {"args": {k: v for k, v in vars(args).items() if k != "rank_run"}, "runs": runs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(out)


if __name__ == "__main__":
    main()
