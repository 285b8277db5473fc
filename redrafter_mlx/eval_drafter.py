"""`redrafter-mlx eval-drafter`: mean tokens per step of a drafter in the real greedy decode loop.

For each beam shape (W, L, and search width S) of the grid, every prompt is decoded greedily
with ReDrafter for ``--max-tokens`` new tokens (or until end of sequence); tokens/step is the
number of tokens the speculative steps emitted divided by the number of steps (the prefill's
first token is not counted). The reported mean is pooled over prompts (total tokens / total
steps). No timing.

``--simulate`` is the cheap variant for sweeps: each prompt is decoded once by the real loop (at
W 2, L 5) to get its greedy path; every (W, L) is then replayed along that path from the drafter's
beams at each position, with no further target passes. Greedy decoding is exact, so the counts
equal the real loop's up to floating-point near-ties.

Default prompts: the MT-Bench first turns. MT-Bench is for final reports only; choose drafters and
hyper-parameters on held-out training-distribution prompts (``train`` writes
``heldout_prompts.jsonl`` into its cache folder).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

from redrafter_mlx import atomic
from redrafter_mlx import runtime as rt
from redrafter_mlx.data import MT_BENCH
from redrafter_mlx.decode import BeamShape, shape_grid
from redrafter_mlx.draft import check_width
from redrafter_mlx.templates import apply_chat_template

PATH_SHAPE = (2, 5)  # beam shape of the real loop that decodes greedy paths for --simulate

EPILOG = """examples:
  # the shipped SmolLM2 drafter on 10 MT-Bench first turns, W 1-4 x L 3-5 (real decode loop)
  redrafter-mlx eval-drafter --num-prompts 10

  # 40 MT-Bench first turns (every 2nd: 5 per category), replayed along greedy paths
  redrafter-mlx eval-drafter --num-prompts 40 --every 2 --simulate --paths-cache runs/mtb.json

  # one shape, held-out ShareGPT prompts written by `train`, JSON output
  redrafter-mlx eval-drafter --drafter runs/drafter --prompts runs/cache/heldout_prompts.jsonl \\
      --beam-width 2 --beam-length 5 --json

  # 4 beams picked from a 16-beam search against the plain 4-beam search, L 5
  redrafter-mlx eval-drafter --simulate --beam-width 4 --beam-length 5 --search-width 1,16
"""


def user_prompt_ids(tokenizer, text: str) -> list[int]:
    """One user turn with the model's chat template (Vicuna's for Vicuna) and a generation
    prompt: the prompts every evaluation decodes from."""
    return apply_chat_template(tokenizer, [{"role": "user", "content": text}])


def decode_one(decoder, prompt_ids: list[int], max_tokens: int, eos: set[int]) -> dict:
    """Greedy ReDrafter decode of one prompt -> ``{"tokens", "steps", "ids"}`` (first token
    from the prefill excluded from tokens and steps, included in ids)."""
    steps = decoder.speculative(decoder.new_cache(), prompt_ids)
    first = next(steps).tokens
    ids, tokens, count = list(first), 0, 0
    if first[0] in eos:
        return {"tokens": 0, "steps": 0, "ids": ids}
    for step in steps:
        emitted = step.tokens
        for j, tok in enumerate(emitted):
            if tok in eos:
                emitted = emitted[: j + 1]
                break
        ids += emitted
        tokens += len(emitted)
        count += 1
        if emitted[-1] in eos or len(ids) >= max_tokens:
            break
    # the last step may overshoot max_tokens by up to L - 1 tokens, by how much depends on the
    # shape: compare outputs over the first max_tokens only
    return {"tokens": tokens, "steps": count, "ids": ids[:max_tokens]}


def evaluate(
    model,
    tokenizer,
    drafter,
    prompts: list[str],
    widths: list[int],
    lengths: list[int],
    max_tokens: int,
    progress=None,
    search_widths: tuple[int, ...] = (0,),
) -> list[dict]:
    """Tokens/step per (W, L, S) over ``prompts``: one row per shape."""
    from redrafter_mlx.accept import greedy
    from redrafter_mlx.decode import Decoder
    from redrafter_mlx.draft import BeamDrafter
    from redrafter_mlx.load import eos_ids

    eos = eos_ids(tokenizer)
    encoded = [user_prompt_ids(tokenizer, p) for p in prompts]
    beams = BeamDrafter(drafter, embed=model.model.embed_tokens)
    rows = []
    for shape in shape_grid(widths, lengths, search_widths=search_widths):
        dec = Decoder(model, greedy, drafter=beams, shape=shape)
        runs = []
        for ids in encoded:
            runs.append(decode_one(dec, ids, max_tokens, eos))
            if progress:
                progress()
        rows.append(summarize(shape, runs))
    return rows


def summarize(shape: BeamShape, runs: list[dict]) -> dict:
    tokens, steps = sum(r["tokens"] for r in runs), sum(r["steps"] for r in runs)
    per_prompt = [round(r["tokens"] / r["steps"], 3) if r["steps"] else None for r in runs]
    digest = hashlib.sha1(json.dumps([r["ids"] for r in runs]).encode()).hexdigest()[:12]
    return {
        "width": shape.width,
        "length": shape.length,
        "search_width": shape.searched,
        "tokens": tokens,
        "steps": steps,
        "tokens_per_step": round(tokens / steps, 3) if steps else None,
        "per_prompt": per_prompt,
        "output_digest": digest,
    }


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Mean tokens/step of a drafter with the real greedy ReDrafter decode loop, "
        "per beam shape (W, L).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", help="target model (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", help="drafter folder (default: the shipped SmolLM2 drafter)")
    p.add_argument(
        "--prompts",
        default=str(MT_BENCH),
        help="JSONL prompts: first of 'turns', or 'prompt'/'text' (default: MT-Bench)",
    )
    p.add_argument("--num-prompts", type=rt.at_least(1), default=10)
    p.add_argument(
        "--every",
        type=rt.at_least(1),
        default=1,
        help="use every k-th prompt of the file (spread over MT-Bench categories)",
    )
    p.add_argument("--max-tokens", type=rt.at_least(1), default=128, help="new tokens per prompt")
    p.add_argument(
        "--max-prompt-tokens", type=rt.at_least(1), default=1024, help="skip longer prompts"
    )
    p.add_argument(
        "--beam-width", type=rt.widths, default=[1, 2, 3, 4], help="W list (default: 1,2,3,4)"
    )
    p.add_argument(
        "--beam-length", type=rt.lengths, default=[3, 4, 5], help="L list (default: 3,4,5)"
    )
    p.add_argument(
        "--search-width",
        type=rt.widths,
        default=[0],
        help="also search with S beams and verify the W of them with the most expected "
        "accepted tokens, e.g. 1,16 (S <= W: plain beam search; default: plain only)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--simulate",
        action="store_true",
        help="replay steps along each prompt's greedy path instead of running the "
        "decode loop (same counts up to float near-ties, far cheaper: for sweeps)",
    )
    p.add_argument("--paths-cache", help="with --simulate: JSON file caching greedy paths")
    return p


def main(args: argparse.Namespace) -> None:
    from redrafter_mlx import llm
    from redrafter_mlx.autotune import fingerprint
    from redrafter_mlx.bench import read_prompts

    texts = [turns[0] for turns in read_prompts(args.prompts, None, 1)]
    if args.paths_cache and not args.simulate:
        rt.fail("--paths-cache is read and written by --simulate only: add --simulate")
    if args.paths_cache:
        rt.check_writable(Path(args.paths_cache).parent, "--paths-cache")
    runtime = rt.load_runtime(args.model, args.drafter, need_drafter=True)
    model, tokenizer, drafter = runtime.model, runtime.tokenizer, runtime.drafter.drafter
    args.model, args.drafter = runtime.model_id, runtime.drafter_id
    shapes = shape_grid(args.beam_width, args.beam_length, search_widths=args.search_width)
    for shape in shapes:
        try:
            check_width(drafter, shape.searched)
        except ValueError as e:
            rt.fail(f"{shape.describe()}: {e}")
    prompts = [
        p
        for p in texts[:: args.every]
        if p.strip() and len(tokenizer.encode(p)) <= args.max_prompt_tokens
    ][: args.num_prompts]
    if not prompts:
        rt.fail(
            f"{args.prompts}: no prompt of at most --max-prompt-tokens {args.max_prompt_tokens}"
        )
    # the target's greedy paths depend on its weights (folder + files) and dtype
    target_id = f"{args.model} {fingerprint(args.model)} {llm.compute_dtype(model)}"
    try:
        rows = run_with_progress(model, tokenizer, drafter, prompts, args, len(shapes), target_id)
    except OSError as e:  # e.g. an unwritable --paths-cache
        rt.fail(rt.os_error_text(e))
    except PathsCacheError as e:
        rt.fail(str(e))
    report = {
        "model": str(args.model),
        "drafter": str(args.drafter),
        "prompts": args.prompts,
        "num_prompts": len(prompts),
        "every": args.every,
        "max_tokens": args.max_tokens,
        "simulated": args.simulate,
        "results": rows,
    }
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_table(report)


def run_with_progress(
    model, tokenizer, drafter, prompts, args, num_shapes: int, target_id: str = ""
) -> list[dict]:
    from rich.progress import Progress

    total = len(prompts) * num_shapes
    with Progress(transient=True) as bar:
        task = bar.add_task("decoding", total=total)
        if args.simulate:
            return simulate_grid(
                model,
                tokenizer,
                drafter,
                prompts,
                args.beam_width,
                args.beam_length,
                args.max_tokens,
                args.paths_cache,
                progress=lambda n: bar.advance(task, n),
                target_id=target_id,
                search_widths=args.search_width,
            )
        return evaluate(
            model,
            tokenizer,
            drafter,
            prompts,
            args.beam_width,
            args.beam_length,
            args.max_tokens,
            progress=lambda: bar.advance(task),
            search_widths=args.search_width,
        )


def print_table(report: dict) -> None:
    """Tokens/step as a W x L grid (rich table)."""
    from rich.console import Console
    from rich.table import Table

    rows = report["results"]
    searches = sorted({(r["width"], r["search_width"]) for r in rows})
    lengths = sorted({r["length"] for r in rows})
    cell = {(r["width"], r["search_width"], r["length"]): r["tokens_per_step"] for r in rows}
    mode = "simulated" if report.get("simulated") else "greedy decode loop"
    table = Table(title="mean tokens/step")
    table.add_column("W \\ L")
    for length in lengths:
        table.add_column(f"L={length}", justify="right")
    for w, searched in searches:
        label = f"W={w}" + (f" search {searched}" if searched > w else "")
        table.add_row(label, *(f"{cell.get((w, searched, n)) or 0:.2f}" for n in lengths))
    Console().print(table)
    Console().print(f"{report['num_prompts']} prompts x {report['max_tokens']} new tokens, {mode}")
    for r in rows:
        if r.get("real_tokens_per_step") is not None:
            Console().print(
                f"W={r['width']} L={r['length']}: real decode loop "
                f"{r['real_tokens_per_step']:.3f} tokens/step, simulated "
                f"{r['tokens_per_step']:.3f}"
            )
    digests = {r["output_digest"] for r in rows}
    note = "identical" if len(digests) == 1 else "DIFFER (near-tie argmax flips?)"
    Console().print(f"greedy outputs across shapes: {note}")


# ----------------------------------------------------------------------------- simulation


def greedy_path(
    model,
    prompt_ids: list[int],
    max_tokens: int,
    eos: set[int],
    drafter=None,
    count_until: int | None = None,
):
    """The target's greedy continuation of ``prompt_ids`` (``max_tokens`` new tokens or up to
    end of sequence) -> ``(ids (N,) prompt + continuation, hidden (N, H), real)`` where
    ``hidden[j]`` is the teacher-forced final-norm hidden state after ``ids[: j + 1]``.

    With a :class:`BeamDrafter` the path is decoded by the real speculative loop at
    :data:`PATH_SHAPE` (same tokens, fewer passes) and ``real`` holds that loop's own
    ``{"tokens", "steps"}`` counted like :func:`decode_one` up to ``count_until`` new tokens;
    otherwise ``real`` is None.
    """
    from redrafter_mlx.accept import greedy
    from redrafter_mlx.decode import Decoder

    dec = Decoder(model, greedy, drafter=drafter, shape=BeamShape(*PATH_SHAPE))
    ids, real = list(prompt_ids), None
    steps = dec.speculative if drafter else dec.autoregressive
    counted = {"tokens": 0, "steps": 0}
    for k, step in enumerate(steps(dec.new_cache(), prompt_ids)):
        ids += step.tokens
        new = len(ids) - len(prompt_ids)
        if drafter and real is None and k > 0:
            emitted = step.tokens
            hit = [j for j, t in enumerate(emitted) if t in eos]
            counted["tokens"] += hit[0] + 1 if hit else len(emitted)
            counted["steps"] += 1
            if hit or new >= (count_until or max_tokens):
                real = dict(counted)
        if any(t in eos for t in step.tokens) or new >= max_tokens:
            break
    if drafter and real is None:
        real = dict(counted)
    for j in range(len(prompt_ids), len(ids)):
        if ids[j] in eos:
            ids = ids[: j + 1]
            break
    ids = ids[: len(prompt_ids) + max_tokens]
    return ids, path_hidden(model, ids), real


def path_hidden(model, ids: list[int]):
    """The target's final-norm hidden (n, H) over a whole path of n token ids, one forward on
    mlx-lm's modules (path lengths vary: nothing to compile)."""
    import mlx.core as mx

    from redrafter_mlx import llm

    n = len(ids)
    return llm.forward(
        model,
        mx.array(ids),
        mx.arange(n),
        llm.chain_mask(0, n),
        llm.make_cache(model),
        compiled=False,
    )


def beams_everywhere(
    drafter, embed, contexts, pendings, width: int, depth: int, search_width: int = 0
) -> list:
    """The drafter's beam search from every position of a path at once.

    ``contexts (T, H)``, ``pendings (T,)`` -> for d = 1..depth, ``(beams (T, W, d + 1), drafted
    tokens' log-probs (T, W, d))`` (numpy):
    the same search as :func:`redrafter_mlx.draft.beam_search` (first expansion from one live
    beam, top ``max(W, search_width)`` by cumulative log-prob, best first, then
    :func:`redrafter_mlx.draft.narrow` to W), batched over the T positions. Beam search keeps
    the same beams at every depth whatever the final length, so a length-L search is the depth
    L - 1 slice.
    """
    import mlx.core as mx
    import numpy as np

    from redrafter_mlx.draft import narrow

    final_width, width = width, max(width, search_width)
    t, h = contexts.shape
    vocab = drafter.args.draft_vocab
    beams = pendings.astype(mx.int32).reshape(t, 1, 1)
    token_logprobs = mx.zeros((t, 1, 0))
    scores = mx.zeros((t, 1))
    state = mx.zeros((t, 1, h), contexts.dtype)
    out = []
    for _ in range(depth):
        b = beams.shape[1]
        state = drafter.rnn_step(
            state.reshape(t * b, h), embed(beams[:, :, -1].reshape(-1))
        ).reshape(t, b, h)
        ctx = mx.broadcast_to(contexts[:, None], (t, b, h)).reshape(t * b, h)
        logits = drafter.logits(ctx, state.reshape(t * b, h)).astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        flat = (scores[..., None] + logp.reshape(t, b, vocab)).reshape(t, b * vocab)
        top = mx.argpartition(-flat, kth=width - 1, axis=-1)[:, :width]
        top = mx.take_along_axis(top, mx.argsort(-mx.take_along_axis(flat, top, -1), -1), -1)
        source, index = top // vocab, top % vocab
        tokens = drafter.draft_ids(index).astype(mx.int32)
        picked = mx.take_along_axis(logp.reshape(t, b * vocab), top, axis=-1)
        beams = mx.concatenate(
            [mx.take_along_axis(beams, source[..., None], axis=1), tokens[..., None]], axis=-1
        )
        token_logprobs = mx.concatenate(
            [mx.take_along_axis(token_logprobs, source[..., None], axis=1), picked[..., None]],
            axis=-1,
        )
        scores = mx.take_along_axis(flat, top, axis=-1)
        state = mx.take_along_axis(state, source[..., None], axis=1)
        verified = narrow(beams, token_logprobs, final_width)
        mx.eval(beams, token_logprobs, scores, state, *verified)
        out.append(tuple(np.array(a) for a in verified))
    return out


def simulate(beams_at, ids: list[int], n_prompt: int, max_tokens: int, length: int) -> dict:
    """Greedy ReDrafter steps replayed along a known greedy path (see :func:`greedy_path`).

    ``beams_at (T, W, L)`` are the beams drafted from ``(hidden[j - 1], ids[j])`` for
    ``j = n_prompt + r`` (row r). Each step drafts at the pending position t, accepts the
    longest beam prefix matching the path and emits it plus the target's next token. Greedy
    decoding is exact, so this equals the real loop's count up to floating-point near-ties
    (tree vs chain attention, batched vs single-row drafting), without any target pass.
    """
    import numpy as np

    path = np.array(ids)
    t, tokens, steps = n_prompt, 0, 0
    while t < len(ids) - 1 and t - n_prompt + 1 < max_tokens:
        beams = beams_at[t - n_prompt]
        room = min(length - 1, len(ids) - 2 - t)
        match = beams[:, 1 : 1 + room] == path[t + 1 : t + 1 + room][None]
        accepted = int(np.cumprod(match, axis=1).sum(axis=1).max()) if room > 0 else 0
        tokens += accepted + 1
        steps += 1
        t += accepted + 1
    return {"tokens": tokens, "steps": steps, "ids": ids[n_prompt:]}


def simulate_grid(
    model,
    tokenizer,
    drafter,
    prompts: list[str],
    widths: list[int],
    lengths: list[int],
    max_tokens: int,
    paths_file: Path | None = None,
    progress=None,
    target_id: str = "",
    search_widths: tuple[int, ...] = (0,),
) -> list[dict]:
    """Like :func:`evaluate`, replaying steps along greedy paths decoded once by the real loop
    at :data:`PATH_SHAPE` (cached in ``paths_file``, keyed by prompt, when given). The row of
    that shape also carries the real loop's own count (``real_tokens_per_step``) when the paths
    were decoded with this drafter in this call. ``target_id`` names the target in the cache
    keys (paths of another model are not reused)."""
    import mlx.core as mx

    from redrafter_mlx.draft import BeamDrafter

    embed = model.model.embed_tokens
    paths = load_paths(
        model,
        tokenizer,
        prompts,
        max_tokens + max(lengths),
        paths_file,
        BeamDrafter(drafter, embed=embed),
        count_until=max_tokens,
        target_id=target_id,
    )
    shapes = shape_grid(widths, lengths, search_widths=search_widths)
    searches: dict[tuple[int, int], list[BeamShape]] = {}  # one search per (W, S), all L
    for shape in shapes:
        searches.setdefault((shape.width, shape.searched), []).append(shape)
    runs: dict[BeamShape, list[dict]] = {}
    for ids, hidden, n_prompt, _ in paths:
        contexts, pendings = hidden[n_prompt - 1 : -1], mx.array(ids[n_prompt:])
        for (w, searched), group in searches.items():
            beams = beams_everywhere(
                drafter, embed, contexts, pendings, w, max(lengths) - 1, searched
            )
            for shape in group:
                replayed = beams[shape.length - 2][0]
                run = simulate(replayed, ids, n_prompt, max_tokens, shape.length)
                runs.setdefault(shape, []).append(run)
        if progress:
            progress(len(shapes))
    rows = []
    real = [p[3] for p in paths]
    for shape in shapes:
        row = summarize(shape, runs[shape])
        if shape == BeamShape(*PATH_SHAPE) and all(real):
            tokens, steps = sum(r["tokens"] for r in real), sum(r["steps"] for r in real)
            row["real_tokens_per_step"] = round(tokens / steps, 3) if steps else None
            row["real_tokens"], row["real_steps"] = tokens, steps
        rows.append(row)
    return rows


class PathsCacheError(ValueError):
    """A ``--paths-cache`` file that is not one."""


def _read_paths(path: Path) -> dict:
    """The stored paths ``{key: ids}`` of ``path`` ({} when it does not exist yet)."""
    if not path.exists():
        return {}
    hint = "delete it or name another"
    try:
        stored = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PathsCacheError(f"{path}: not a paths cache ({e}); {hint}") from None
    if not isinstance(stored, dict):
        raise PathsCacheError(f"{path}: not a paths cache (no JSON object); {hint}")
    return stored


def load_paths(
    model,
    tokenizer,
    prompts: list[str],
    max_tokens: int,
    paths_file: Path | None,
    drafter=None,
    count_until: int | None = None,
    target_id: str = "",
):
    """Greedy paths per prompt ``[(ids, hidden (N, H), n_prompt, real)]``, from/into
    ``paths_file`` (``real`` is None for stored paths), keyed by ``target_id``, prompt and
    length; the file is rewritten atomically after each new path."""
    import mlx.core as mx

    from redrafter_mlx.load import eos_ids

    eos = eos_ids(tokenizer)
    stored = _read_paths(Path(paths_file)) if paths_file else {}
    out = []
    for p in prompts:
        prompt_ids = user_prompt_ids(tokenizer, p)
        key = hashlib.sha1(json.dumps([target_id, p, max_tokens]).encode()).hexdigest()
        if key in stored:
            ids, real = stored[key], None
            hidden = path_hidden(model, ids)
        else:
            ids, hidden, real = greedy_path(
                model, prompt_ids, max_tokens, eos, drafter, count_until
            )
            stored[key] = ids
            if paths_file:
                atomic.write_text(paths_file, json.dumps(stored))
        mx.eval(hidden)
        out.append((ids, hidden, len(prompt_ids), real))
    return out
