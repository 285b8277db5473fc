"""Phase 1 of distillation: run the target once over the conversations and record what the
drafter learns from into the cache (``cache.py``).

Legend: N tokens of a record, H target hidden size, k stored top-k log-probs.

``--source data`` teacher-forces each conversation (chat template applied, truncated to
``max_seq_len``); ``--source self`` lets the target answer the user turns itself, greedily
(``selfdistill.py``), so the drafter learns from the very text it will see when decoding.
Held-out records are extracted first (a small budget), then training records; both splits
resume where an interrupted run stopped.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
from rich.progress import BarColumn, Progress, TextColumn

from redrafter_mlx.core.atomic import write_text
from redrafter_mlx.core.decode import llm
from redrafter_mlx.core.decode.accept import log_softmax
from redrafter_mlx.core.errors import TrainError
from redrafter_mlx.io.load import eos_ids
from redrafter_mlx.io.templates import apply_chat_template
from redrafter_mlx.training import progress
from redrafter_mlx.training.cache import Cache
from redrafter_mlx.training.data import (
    encode_conversation,
    every_user_turn,
    first_user_turns,
    read_corpus,
    split_conversations,
)
from redrafter_mlx.training.options import ExtractOptions
from redrafter_mlx.training.ranks import ONE, Ranks
from redrafter_mlx.training.selfdistill import greedy_batch
from redrafter_mlx.training.sharded import Span, extract_sharded
from redrafter_mlx.training.taps import features as tap_arrays
from redrafter_mlx.training.taps import tapped

SHARD_TOKENS = 16384
GEN_WINDOW = 4  # --source self: batches sorted by prompt length together
TEACHER_UNIT = 32  # --source data on several ranks: conversations a rank takes at a time

Record = dict[str, np.ndarray]
Records = Iterator[tuple[int, Record, bool]]  # (next conversation, record, resumable boundary)


def prepare_cache(
    model,
    tokenizer,
    model_path,
    data: Path,
    cache_dir: Path,
    opts: ExtractOptions,
    *,
    ranks: Ranks = ONE,
) -> Cache:
    """Read + split the conversations, extract held-out then training shards up to budgets
    (on several ``ranks``: each its share, into one cache folder they all see)."""
    if not ranks.lead:
        opts = replace(opts, quiet=True)  # rank 0 shows progress and notes
    try:
        convs, skipped = read_corpus(data)
    except ValueError as e:
        raise TrainError(str(e)) from None
    if len(convs) < 2:
        unusable = f" ({skipped} records were not usable conversations)" if skipped else ""
        raise TrainError(f"{data}: fewer than 2 usable conversations{unusable}")
    heldout_n = min(opts.heldout, max(1, len(convs) // 10))
    heldout, training = split_conversations(convs, opts.seed, heldout_n)
    identity = _identity(model, model_path, data, heldout_n, opts)
    if opts.source == "self" and opts.self_prompts == "all":
        training = every_user_turn(training, heldout)
    cache = Cache.open(cache_dir, identity)
    cache.skipped_records = skipped
    prompts = cache_dir / "heldout_prompts.jsonl"
    # for `eval-drafter --prompts`: held-out text, never trained on
    if ranks.lead and not prompts.exists():
        lines = [json.dumps({"turns": [t]}) for t in first_user_turns(heldout)]
        write_text(prompts, "\n".join(lines) + "\n")
    extract(model, tokenizer, heldout, cache, "heldout", opts.heldout_tokens, opts, ranks)
    if not cache.tokens("heldout"):  # say so now, not after the (long) training extraction
        raise TrainError(
            f"{cache.root}: the {heldout_n} held-out conversations gave no tokens within "
            "--max-seq-len (prompts too long for it, or no answers): raise --max-seq-len or "
            "--heldout"
        )
    extract(model, tokenizer, training, cache, "train", opts.max_tokens, opts, ranks)
    _note_short(cache, opts)
    return cache


def _identity(model, model_path, data: Path, heldout: int, opts: ExtractOptions) -> dict:
    """The settings that shape a cache's records (a cache made with others is refused)."""
    identity = {
        "model": str(model_path),
        "data": str(data),
        "seed": opts.seed,
        "heldout": heldout,
        "max_seq_len": opts.max_seq_len,
        "topk": opts.topk,
        "fingerprint": fingerprint(model),
    }
    if opts.context_layers:  # records keep these layers' features (absent: none kept)
        identity.update(context_layers=list(opts.context_layers))
    if opts.source == "self":
        identity.update(source="self", gen_tokens=opts.gen_tokens)
        if opts.self_prompts == "all":
            identity.update(self_prompts="all")
    return identity


def _note_short(cache: Cache, opts: ExtractOptions) -> None:
    """Say why the training split holds fewer tokens than asked for, if it does."""
    got = cache.tokens("train")
    if got >= opts.max_tokens or opts.quiet:
        return
    full = cache.nbytes() >= opts.cache_max_gb * 2**30
    why = "--cache-max-gb is reached" if full else "that is all the data holds"
    if not full and _past(opts.stop_at):
        why = "extraction's share of --minutes is spent; training fills the rest of the time"
    print(
        f"note: {got:,} training tokens, fewer than --max-tokens {opts.max_tokens:,} ({why})",
        file=sys.stderr,
    )


def fingerprint(model) -> str:
    """A short hash of the target's embedding (tells caches of different targets apart)."""
    row = llm.lm_head(model, mx.ones((1, llm.target_dims(model)[0])))
    return hashlib.sha1(np.array(row.astype(mx.float32)).round(3).tobytes()).hexdigest()[:12]


def extract(
    model,
    tokenizer,
    convs: list,
    cache: Cache,
    split: str,
    budget: int,
    opts: ExtractOptions,
    ranks: Ranks = ONE,
) -> None:
    """Record conversations ``convs[next:]`` into shards until ``split`` has ``budget`` tokens:
    teacher-forced (``--source data``) or answered by the target itself (``--source self``);
    on several ``ranks`` unit by unit (``sharded.py``)."""
    limit = opts.cache_max_gb * 2**30
    if ranks.lead_says(cache.tokens(split) >= budget or cache.nbytes() >= limit):
        return  # (a complete cache copied to each machine is fine: nothing is written)
    ranks.check_shared(cache.root, "--cache-dir")  # several ranks write into it
    with cache.writing(ranks):
        if ranks.size == 1:
            _extract_locked(model, tokenizer, convs, cache, split, budget, limit, opts)
        else:
            _extract_ranks(model, tokenizer, convs, cache, split, budget, limit, opts, ranks)


def _extract_locked(model, tokenizer, convs, cache, split, budget, limit, opts) -> None:
    """``extract`` holding the cache's lock: buffer records, close a shard every
    ``SHARD_TOKENS`` tokens (on a resumable boundary), stop at the budget or size limit."""
    have = cache.tokens(split)
    if have >= budget:  # the manifest re-read under the lock: another run filled the split
        return
    buf: list[Record] = []
    start, done_tokens = time.perf_counter(), 0
    verb = "generate" if opts.source == "self" else "extract"
    records = self_records if opts.source == "self" else teacher_records
    lines = progress.PlainLines(opts.quiet)
    with _bar(f"{verb} {split}", opts) as bar:
        task = bar.add_task("", total=budget, completed=have, rate="", eta="")
        i = first = cache.manifest["next"][split]
        if split == "train":
            first = max(first, opts.skip_prompts)
        for i, arrays, boundary in records(model, tokenizer, convs, first, opts):
            arrays["doc"] = np.full(len(arrays["tokens"]), len(buf), np.int32)
            buf.append(arrays)
            have += len(arrays["tokens"])
            done_tokens += len(arrays["tokens"])
            seconds = time.perf_counter() - start
            held = progress.data_bound(  # the budget, or what the data holds if less
                budget, have=have, done=done_tokens, read=i - first, unread=len(convs) - i
            )
            planned, eta = progress.fitted(
                held, have=min(have, held), done=done_tokens, seconds=seconds,
                time_left=opts.stop_at - time.time() if opts.stop_at else None,
            )  # fmt: skip
            rate = f"{done_tokens / seconds:.0f} tok/s"
            bar.update(task, completed=min(have, planned), total=planned, rate=rate, eta=eta)
            if lines.due():
                fits = " (what --minutes leaves time for)" if planned < held else ""
                fits = " (what the data holds, estimated)" if held < budget else fits
                progress.say(
                    f"{verb} {split}: {min(have, planned):,}/{planned:,} tokens{fits}, {rate}, "
                    f"{eta}"
                )
            if not boundary:
                continue
            if sum(b["tokens"].shape[0] for b in buf) >= SHARD_TOKENS or have >= budget:
                cache.add_shard(split, _concat(buf), i)
                buf = []
            if have >= budget or cache.nbytes() >= limit or _past(opts.stop_at):
                break
        if buf:
            cache.add_shard(split, _concat(buf), i)


def _extract_ranks(model, tokenizer, convs, cache, split, budget, limit, opts, ranks) -> None:
    """``extract`` on several ranks, a unit of conversations each at a time: a generation
    window (``--source self``) or ``TEACHER_UNIT`` conversations."""
    if cache.tokens(split) >= budget:  # the manifest re-read under the lock
        return
    records = self_records if opts.source == "self" else teacher_records
    unit = GEN_WINDOW * opts.gen_batch if opts.source == "self" else TEACHER_UNIT
    first = cache.manifest["next"][split]
    if split == "train":
        first = max(first, opts.skip_prompts)

    def produce(a: int, b: int) -> list:
        return list(records(model, tokenizer, convs[:b], a, opts))

    verb = "generate" if opts.source == "self" else "extract"
    lines = progress.PlainLines(opts.quiet)
    with _bar(f"{verb} {split}", opts) as bar:
        task = bar.add_task("", total=budget, completed=cache.tokens(split), rate="", eta="")

        def show(have: int, rate: str) -> None:
            bar.update(task, completed=min(have, budget), rate=rate)
            if lines.due():
                progress.say(f"{verb} {split}: {min(have, budget):,}/{budget:,} tokens, {rate}")

        span = Span(first, len(convs), unit)
        extract_sharded(
            produce, cache, split, span, budget=budget, limit=limit, ranks=ranks, show=show
        )


def _past(stop_at: float) -> bool:
    """Whether the time ``--minutes`` gave extraction (``stop_at``, 0: none) is up."""
    return bool(stop_at) and time.time() >= stop_at


def _bar(title: str, opts: ExtractOptions) -> Progress:
    """An extraction bar on stderr; its ETA is the mean pace's (:func:`progress.eta`): self-
    generated answers vary in length, which makes a short window's estimate swing."""
    columns = (
        TextColumn(title),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} tokens {task.fields[rate]} {task.fields[eta]}"),
    )
    return Progress(*columns, disable=opts.quiet, console=progress.console())


def teacher_force(model, ids: list[int], topk: int, layers: tuple[int, ...] = ()) -> Record:
    """Run the target over ``ids (N,)``: hidden (N, H) f16, argmax (N,), top-k ids/log-probs
    ``(N, k)`` when ``topk``, the tapped ``layers``' features ``taps (N, n H)`` f16 when any."""
    with tapped(model, layers) as got:
        hidden = llm.inner_model(model)(mx.array(ids)[None])[0]
    logits = llm.lm_head(model, hidden).astype(mx.float32)
    out = {"hidden": hidden.astype(mx.float16), "argmax": mx.argmax(logits, axis=-1)}
    if layers:
        out["taps"] = tap_arrays(got, layers)[0]
    if topk:
        logp = log_softmax(logits)
        top = mx.argpartition(-logp, kth=topk - 1, axis=-1)[:, :topk]
        out["topk_ids"] = top.astype(mx.int32)
        out["topk_logp"] = mx.take_along_axis(logp, top, axis=-1).astype(mx.float16)
    mx.eval(out)
    return {k: np.array(v) for k, v in out.items()}


def teacher_records(model, tokenizer, convs: list, first: int, opts: ExtractOptions) -> Records:
    """Yield ``(next conversation index, record, True)``, one teacher-forced conversation at a
    time (every record is a resumable boundary)."""
    for i in range(first, len(convs)):
        ids, mask = encode_conversation(tokenizer, convs[i])
        ids, mask = ids[: opts.max_seq_len], mask[: opts.max_seq_len]
        if sum(mask[1:]) < 4:  # too few trainable predictions to be worth a record
            continue
        arrays = teacher_force(model, ids, opts.topk, opts.context_layers)
        arrays.update(tokens=np.array(ids, np.int32), mask=np.array(mask, bool))
        yield i + 1, arrays, True


def self_records(model, tokenizer, convs: list, first: int, opts: ExtractOptions) -> Records:
    """Yield ``(next conversation index, record, boundary)``: the target's greedy answers to the
    first user turns of ``convs[first:]`` (prompts up to ``max_seq_len`` minus ``gen_tokens``
    tokens). Windows of ``GEN_WINDOW`` batches are sorted by prompt length, so a batch pads
    little; only a window's last record is a boundary (shards and budgets close on whole
    windows, so a resumed run starts at the next window)."""
    eos = eos_ids(tokenizer)
    window = GEN_WINDOW * opts.gen_batch
    for w in range(first, len(convs), window):
        prompts = _window_prompts(tokenizer, convs[w : w + window], opts)
        records = []
        for k in range(0, len(prompts), opts.gen_batch):
            batch = prompts[k : k + opts.gen_batch]
            records += greedy_batch(model, batch, opts.gen_tokens, eos, opts.context_layers)
        records = [r for r in records if r["mask"].sum() >= 4]
        for k, r in enumerate(records):
            last = k == len(records) - 1
            yield (min(w + window, len(convs)) if last else w), r, last


def _window_prompts(tokenizer, convs: list, opts: ExtractOptions) -> list[list[int]]:
    """The templated first user turns of ``convs`` that leave room for an answer, shortest
    first."""
    prompts = []
    for conv in convs:
        user = first_user_turns([conv])
        if not user:
            continue
        ids = apply_chat_template(tokenizer, [{"role": "user", "content": user[0]}])
        if len(ids) + opts.gen_tokens <= opts.max_seq_len:
            prompts.append(ids)
    return sorted(prompts, key=len)


def _concat(buf: list[Record]) -> Record:
    return {k: np.concatenate([b[k] for b in buf]) for k in buf[0]}
