"""Tokens/s against context length: the default decoding (what ``generate`` and ``chat`` run:
the shape per context band, plain decoding where no shape pays), ReDrafter at that shape at
every length, our plain decoding and mlx-lm's generate, interleaved, on summarisation
requests over the project's own docs.

For each context length (prompt tokens, chat template included) the methods answer the
same prompt ``--repetitions`` times in rotated order; figures are medians. Each method pays
for the prompt once (its first answer: prefill tokens/s and the time to the first token);
later answers reuse the cached prompt (ours: the session's prefix reuse; mlx-lm: its prompt
cache trimmed back), so a repetition costs only the answer. Writes JSON:

    .venv/bin/python benchmarks/long_context.py --out benchmarks/results/long_context.json
    .venv/bin/python benchmarks/long_context.py --quick    # a dry run: short prompts, 8 tokens

Past the embedded model's 8K (``--stand-in 4``): the same weights with linear RoPE scaling
(position interpolation) by 4, so 32K positions fall inside the 8K it was trained on, with the
shipped drafter; mlx-lm answers only up to ``--mlx-lm-up-to`` tokens (its prefill of 32K
tokens here would take about an hour):

    .venv/bin/python benchmarks/long_context.py --stand-in 4 --lengths 32000 --mlx-lm-up-to 8000
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from redrafter_mlx.backend.cpu.blas import reexec_with_blas

if __name__ == "__main__":
    reexec_with_blas()  # before MLX loads: the BLAS the console script runs with

import mlx.core as mx  # noqa: E402

from redrafter_mlx.core.decode.mode import Mode  # noqa: E402
from redrafter_mlx.core.decode.shape import BeamShape  # noqa: E402
from redrafter_mlx.core.serving.session import Session  # noqa: E402
from redrafter_mlx.io import runtime as rt  # noqa: E402
from redrafter_mlx.io.embedded import default_drafter_path, default_model_path  # noqa: E402
from redrafter_mlx.tuning.measure import environment  # noqa: E402
from redrafter_mlx.tuning.profiles import follow_context, resolve_shape  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# appended sources leave shorter prompts as they were (the body is cut from the start)
SOURCES = [
    "README.md",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
    "benchmarks/HISTORY.md",  # for the stand-in's 32K (the README before it was split)
]
ASK = "Summarise the following documentation in five short bullet points.\n\n"
DEFAULT, REDRAFTER, AUTOREGRESSIVE, MLX_LM = "default", "redrafter", "autoregressive", "mlx-lm"


def docs_prompt(runtime, length: int) -> list[int]:
    """A chat prompt of about ``length`` tokens: the request, then as much of the docs as fits."""
    text = "\n\n".join((ROOT / name).read_text() for name in SOURCES)
    body = runtime.tokenizer.encode(text, add_special_tokens=False)
    overhead = len(rt.encode_chat(runtime, [{"role": "user", "content": ASK}]))
    content = ASK + runtime.tokenizer.decode(body[: max(length - overhead, 1)])
    return rt.encode_chat(runtime, [{"role": "user", "content": content}])


class Ours:
    """Our decode loop in one session per prompt: its first answer pays for the prompt, later
    ones reuse all of it but the last token."""

    def __init__(self, runtime, decoding):
        self.session = Session(runtime.decoder, runtime.tokenizer, decoding, warm=False)

    def answer(self, prompt: list[int], decoding, max_tokens: int) -> dict:
        """``decoding`` None: the session's own choice (its bands, and past the plan's
        ``plain_from`` each step's mode by the speed each got: ``core/decode/adaptive.py``)."""
        times, tokens, last = [], [], None
        for last in self.session.generate(prompt, max_tokens=max_tokens, decoding=decoding):
            times.append(time.perf_counter())
            tokens += last.tokens
        stats = last.stats
        return {
            "tokens": tokens,
            "tps": (len(tokens) - 1) / (times[-1] - times[0]),
            "prompt_tokens_fed": stats.prompt_tokens,
            "prompt_seconds": stats.prompt_seconds,
            "steps": stats.steps,
            "tree_steps": sum(size > 1 for size in stats.tree_sizes),
        }


class MlxLm:
    """mlx-lm's ``stream_generate`` with a prompt cache: the first answer fills it, later ones
    trim it back to the prompt less its last token and feed that token."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.cache = None

    def answer(self, prompt: list[int], max_tokens: int) -> dict:
        import mlx_lm
        from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
        from mlx_lm.sample_utils import make_sampler

        if self.cache is None:
            self.cache, fed = make_prompt_cache(self.runtime.model), prompt
        else:
            trim_prompt_cache(self.cache, self.cache[0].offset - (len(prompt) - 1))
            fed = prompt[-1:]
        tic = time.perf_counter()
        stream = mlx_lm.stream_generate(
            self.runtime.model,
            self.runtime.tokenizer,
            fed,
            max_tokens=max_tokens,
            sampler=make_sampler(0.0),
            prompt_cache=self.cache,
        )
        times, tokens = [], []
        for response in stream:
            times.append(time.perf_counter())
            if response.finish_reason != "stop":  # mlx-lm emits the EOS token; we never do
                tokens.append(response.token)
        times = times[: len(tokens)]
        return {
            "tokens": tokens,
            "tps": (len(tokens) - 1) / (times[-1] - times[0]),
            "prompt_tokens_fed": len(fed),
            "prompt_seconds": times[0] - tic,
            "steps": len(tokens) - 1,
        }


def stand_in(factor: float, folder: Path) -> Path:
    """The embedded model in ``folder`` (its files linked) with linear RoPE scaling by
    ``factor`` and a context ``factor`` times as long."""
    source = default_model_path()
    for item in source.iterdir():
        if item.name != "config.json":
            (folder / item.name).symlink_to(item)
    config = json.loads((source / "config.json").read_text())
    config["rope_scaling"] = {"type": "linear", "factor": factor}
    config["max_position_embeddings"] = int(config["max_position_embeddings"] * factor)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def run_length(runtime, length: int, shape: BeamShape, source: str, args) -> dict:
    prompt = docs_prompt(runtime, length)
    ours_ar = rt.decoding(runtime, shape, mode=Mode.AUTOREGRESSIVE)
    ours_rd = rt.decoding(runtime, shape)
    ours = Ours(runtime, ours_rd)
    follow_context(ours.session, runtime, source)  # the bands generate and chat follow
    ours_default = ours.session.decoding_at(len(prompt))
    adaptive = ours.session.adaptive
    mlx = MlxLm(runtime)
    methods = {
        DEFAULT: lambda: ours.answer(prompt, None, args.max_tokens),
        REDRAFTER: lambda: ours.answer(prompt, ours_rd, args.max_tokens),
        AUTOREGRESSIVE: lambda: ours.answer(prompt, ours_ar, args.max_tokens),
        MLX_LM: lambda: mlx.answer(prompt, args.max_tokens),
    }
    if args.mlx_lm_up_to is not None and len(prompt) > args.mlx_lm_up_to:
        del methods[MLX_LM]
    names = list(methods)
    runs = {name: [] for name in names}
    for rep in range(args.repetitions + 1):  # rep 0 pays for the prompts and warms up
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            runs[name].append(methods[name]())
            r = runs[name][-1]
            print(
                f"  {length:5d} rep {rep} {name:14s} {r['tps']:6.2f} tok/s "
                f"({len(r['tokens'])} tokens, {r['steps']} steps)",
                file=sys.stderr,
                flush=True,
            )
    row = summarize(prompt, runs)
    speculates = ours_default.mode.speculative
    row["default_decoding"] = ours_default.shape.label if speculates else "plain"
    if adaptive is not None and len(prompt) >= adaptive.start:
        row["default_decoding"] = f"adaptive: plain or {adaptive.speculative.shape.label}"
        row["default_tree_steps"] = [r["tree_steps"] for r in runs[DEFAULT]]
    return row


def summarize(prompt: list[int], runs: dict) -> dict:
    """Medians of the timed answers (rep 0 left out) and who paid for the prompt: our one
    session's first answer, mlx-lm's first."""
    timed = {name: r[1:] for name, r in runs.items()}
    reference = timed[AUTOREGRESSIVE][0]["tokens"]
    row = {
        "prompt_tokens": len(prompt),
        "exact": all(
            r["tokens"] == reference for name in (DEFAULT, REDRAFTER) for r in timed[name]
        ),
        "mlx_lm_same_tokens": all(r["tokens"] == reference for r in timed.get(MLX_LM, [])),
        "methods": {},
    }
    ours_first = max((runs[name][0] for name in runs if name != MLX_LM), key=_fed)
    ar = statistics.median(r["tps"] for r in timed[AUTOREGRESSIVE])
    for name, rs in timed.items():
        first = runs[MLX_LM][0] if name == MLX_LM else ours_first
        tps = statistics.median(r["tps"] for r in rs)
        row["methods"][name] = {
            "tps": tps,
            "x_autoregressive": tps / ar,
            "tokens_per_step": statistics.median(
                (len(r["tokens"]) - 1) / max(r["steps"], 1) for r in rs
            ),
            "all_tps": [r["tps"] for r in rs],
            "prefill_tps": _fed(first) / first["prompt_seconds"],
            "time_to_first_token": first["prompt_seconds"],
        }
    return row


def _fed(run: dict) -> int:
    return run["prompt_tokens_fed"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="512,2048,4096,8000", help="prompt tokens, comma-separated")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repetitions", type=int, default=3, help="timed answers per method")
    p.add_argument("--beam-width", type=int)
    p.add_argument("--beam-length", type=int)
    p.add_argument("--lookup", type=int)
    p.add_argument(
        "--quick", action="store_true", help="a dry run: 2 short prompts, 8 tokens, 1 rep"
    )
    p.add_argument(
        "--stand-in",
        type=float,
        metavar="FACTOR",
        help="the embedded model with linear RoPE scaling by FACTOR (a context FACTOR x 8K)",
    )
    p.add_argument(
        "--mlx-lm-up-to", type=int, metavar="TOKENS", help="run mlx-lm only up to this prompt"
    )
    p.add_argument("--out")
    args = p.parse_args()
    if args.quick:
        args.lengths, args.max_tokens, args.repetitions = "200,600", 8, 1
    with tempfile.TemporaryDirectory() as folder:
        model = None if args.stand_in is None else str(stand_in(args.stand_in, Path(folder)))
        drafter = None if args.stand_in is None else str(default_drafter_path())
        runtime = rt.load_runtime(model, drafter, need_drafter=True)
        run(runtime, args)


def run(runtime, args) -> None:
    overrides = {"width": args.beam_width, "length": args.beam_length, "lookup": args.lookup}
    shape, source = resolve_shape(runtime, overrides=overrides)
    for decoding in (
        rt.decoding(runtime, shape),
        rt.decoding(runtime, shape, mode=Mode.AUTOREGRESSIVE),
    ):
        runtime.decoder.warm_up(decoding)
    print(f"shape {shape.describe()} ({source})", file=sys.stderr)
    rows = {}
    for length in (int(x) for x in args.lengths.split(",")):
        rows[length] = run_length(runtime, length, shape, source, args)
        mx.clear_cache()
        m = rows[length]["methods"]
        peer = (
            f"mlx-lm {m[MLX_LM]['tps']:.2f} tok/s, prefill {m[MLX_LM]['prefill_tps']:.0f}"
            if MLX_LM in m
            else "mlx-lm not run"
        )
        print(
            f"{rows[length]['prompt_tokens']:5d} tokens: default "
            f"({rows[length]['default_decoding']}) {m[DEFAULT]['tps']:.2f} "
            f"({m[DEFAULT]['x_autoregressive']:.2f}x), ReDrafter {m[REDRAFTER]['tps']:.2f} "
            f"({m[REDRAFTER]['x_autoregressive']:.2f}x, {m[REDRAFTER]['tokens_per_step']:.2f} "
            f"tok/step), AR {m[AUTOREGRESSIVE]['tps']:.2f} tok/s, prefill ours "
            f"{m[AUTOREGRESSIVE]['prefill_tps']:.0f}; {peer}; exact {rows[length]['exact']}",
            flush=True,
        )
    report = {
        "environment": environment(runtime),
        "shape": shape.describe(),
        "shape_source": source,
        "settings": vars(args),
        "lengths": rows,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
