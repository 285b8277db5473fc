"""`redrafter-mlx generate`: one prompt in, text to stdout, stats to stderr (or one JSON object)."""

from __future__ import annotations

import argparse
import json
import sys

from redrafter_mlx.cli import flags, sharding
from redrafter_mlx.cli.flags import fail
from redrafter_mlx.cli.progress import SaidIfSlow
from redrafter_mlx.core.decode.step import PhaseTimer
from redrafter_mlx.core.decode.stream import GenerationStats
from redrafter_mlx.core.serving.distributed import session_for
from redrafter_mlx.io import runtime as rt
from redrafter_mlx.io.templates import check_text, read_stdin
from redrafter_mlx.tuning.profiles import follow_context, resolve_shape

EXAMPLES = """examples:
  redrafter-mlx generate --prompt "What is the capital of France?"
  redrafter-mlx generate --prompt "Write a haiku about the sea." --beam-width 2 --beam-length 4
  redrafter-mlx generate --autoregressive --prompt "Tell me a joke." --json
  redrafter-mlx generate --prompt "$(head -c 1500 README.md) Summarise the text above." --lookup 4
  echo "Summarise: MLX is an array framework." | redrafter-mlx generate --prompt - --temp 0.7
  redrafter-mlx generate --model models/demo --prompt "Hi!" --max-tokens 16   # see demo-model
  redrafter-mlx generate --model mlx-community/Qwen3-0.6B-4bit --prompt "Name three colours."
  mlx.launch --hostfile hosts.json -- redrafter-mlx generate --shard tensor --prompt "Hi"
"""


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Generate text with ReDrafter speculative decoding (lossless).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    flags.add_model_args(parser)
    parser.add_argument("--prompt", required=True, help='user message ("-" reads stdin)')
    parser.add_argument("--system", help="system prompt")
    parser.add_argument("--raw", action="store_true", help="no chat template: prompt is raw text")
    flags.add_decode_args(parser)
    flags.add_speculation_args(parser)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument(
        "--timing",
        action="store_true",
        help="per-phase seconds of the ReDrafter steps (draft, pack, verify, accept, compact; "
        "evaluates at phase boundaries: adds syncs)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object, no stream")
    sharding.add_shard_arg(parser)
    return parser


def stats_dict(stats: GenerationStats, phase_seconds: dict[str, float] | None) -> dict:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "generation_tokens": stats.generation_tokens,
        "steps": stats.steps,
        "tokens_per_step": round(stats.tokens_per_step, 4),
        "generation_tps": round(stats.generation_tps, 3),
        "prompt_tps": round(stats.prompt_tps, 3),
        "peak_memory_gb": round(stats.peak_memory_gb, 4),
        "mean_tree_size": round(stats.mean_tree_size, 3),
        "syncs_per_step": round(stats.syncs_per_step, 3),
        "accept_histogram": {str(k): v for k, v in sorted(stats.accept_histogram.items())},
        "accepted_from": stats.accepted_shares(),
        "phase_seconds": phase_seconds,
    }


@flags.reports_errors
def main(args: argparse.Namespace) -> None:
    where = "stdin" if args.prompt == "-" else "--prompt"
    prompt = check_text(read_stdin() if args.prompt == "-" else args.prompt, where)
    if args.system:
        check_text(args.system, "--system")
    for stop in args.stop:
        check_text(stop, "--stop")
    if any(not stop for stop in args.stop):
        fail("--stop needs a non-empty string")
    if not prompt.strip():
        fail("empty prompt" + (" on stdin" if args.prompt == "-" else ""))
    # without a drafter (none found, or --drafter none) it speculates with lookup beams alone
    runtime = sharding.load_runtime(args, need_drafter=False)  # rank 0 alone returns
    flags.say_drafter(runtime, json_mode=args.json, autoregressive=args.autoregressive)
    overrides = flags.shape_overrides(args)
    shape, source = flags.lookup_when_no_drafter(
        runtime,
        *resolve_shape(runtime, overrides=overrides, temp=args.temp),
    )
    timing = args.timing and not args.autoregressive  # the phases are a ReDrafter step's
    mode = runtime.mode(shape, autoregressive=args.autoregressive)
    decoding = rt.decoding(
        runtime, shape, temp=args.temp, top_p=args.top_p, top_k=args.top_k, mode=mode
    )
    with SaidIfSlow("compiling the decode step (once per model and shape)"):
        session = session_for(runtime.decoder, runtime.tokenizer, decoding, seed=args.seed)
    follow_context(session, runtime, source, temp=args.temp)
    if args.raw:
        ids = runtime.tokenizer.encode(prompt)
    else:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        ids = rt.encode_chat(runtime, messages + [{"role": "user", "content": prompt}])
    if runtime.max_context and len(ids) >= runtime.max_context:
        fail(f"prompt is {len(ids)} tokens; the model's context is {runtime.max_context}")
    # the prompt's context band may decode plainly (the plan's plain_from, a profile's bands)
    plain_here = mode.speculative and not session.decoding_at(len(ids)).mode.speculative
    if plain_here:
        mode = session.decoding_at(len(ids)).mode
    if not args.json:
        note = f" ({source})" if mode.speculative else ""
        if plain_here:
            trees = " (trees where they measure faster)" if session.adaptive else ""
            note = f" (plain from this context length{trees}: {source})"
        if ignored := flags.ignored_when_autoregressive(args):
            note += f" (ignored: {', '.join(ignored)})"
        timing_on = " (timing on: evaluates at phase boundaries, adds syncs)" if timing else ""
        described = mode.describe(shape, flags.drafter_name(runtime))
        print(f"[{described}{note}]{timing_on}", file=sys.stderr)
    text, tokens = [], []
    timer = PhaseTimer(timing)
    for response in session.generate(
        ids, max_tokens=args.max_tokens, stop_strings=tuple(args.stop), timer=timer
    ):
        text.append(response.text)
        tokens.extend(response.tokens)
        if not args.json:
            print(response.text, end="", flush=True)
    stats = response.stats
    phases = timer.seconds if timing else None
    result = {
        "text": "".join(text),
        "tokens": tokens,
        "mode": mode.value,
        "finish_reason": response.finish_reason,
        **stats_dict(stats, phases),
    }
    if timing:
        result["timing_note"] = "phase timing evaluates at phase boundaries (extra syncs)"
    if mode.speculative:
        result |= {
            "beam_width": shape.width,
            "beam_length": shape.length,
            "min_prob": shape.min_prob,
            "search_width": shape.searched,
            "lookup": shape.lookup,
            "shape_source": source,
            "drafter_type": runtime.drafter.kind if runtime.drafter is not None else None,
            "drafter": flags.drafter_json(runtime),
        }
    if args.json:
        print(json.dumps(result))
        return
    print()  # the answer's last line, on stdout: a piped answer ends with a newline
    if response.finish_reason == "context":
        print(
            f"[stopped: the model's {runtime.max_context}-token context is full]", file=sys.stderr
        )
    print(
        f"[{stats.generation_tokens} tokens, {stats.generation_tps:.1f} tok/s, "
        f"{stats.tokens_per_step:.2f} tokens/step, prompt {stats.prompt_tps:.0f} tok/s]",
        file=sys.stderr,
    )
    if phases:
        print(f"[seconds per phase: {phase_line(phases)}]", file=sys.stderr)


def phase_line(phases: dict[str, float]) -> str:
    """``draft 0.120 (9%), pack ...``: each phase's seconds and share of their sum."""
    total = sum(phases.values()) or 1.0
    return ", ".join(f"{k} {v:.3f} ({100 * v / total:.0f}%)" for k, v in phases.items())
