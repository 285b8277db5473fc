"""Mean tokens per step of a drafter in the greedy ReDrafter decode loop, per beam shape.

:func:`evaluate` decodes every prompt greedily with the real loop at every shape; tokens/step is
the number of tokens the speculative steps emitted divided by the number of steps (the prefill's
first token is not counted), pooled over prompts (total tokens / total steps), and per prompt
category when the prompts have one. A shape with K > 0 lookup beams also verifies up to K
prompt-lookup beams per step (:mod:`redrafter_mlx.core.decode.lookup`). Each row counts the accepted
drafted tokens by source: the drafter's beams, the lookup beams, or both (a beam of each held
them). No timing.

:func:`simulate_grid` is the cheap variant for sweeps: each prompt is decoded once by the real
loop (at :data:`PATH_SHAPE`) to get its greedy path; every shape is then replayed along that path
from the drafter's beams at each position (:func:`beams_everywhere`, one batched beam search)
and, with K > 0, the lookup beams an n-gram index of the prompt and the path so far proposes
there (:func:`lookup_everywhere`), with no further target passes. A step accepts the longest
agreeing prefix over both kinds of beams, by the loop's own rule. Greedy decoding is exact, so
the counts equal the real loop's up to floating-point near-ties.

Library code: progress goes to a callback, failures raise :mod:`redrafter_mlx.core.errors`.
Legend: T path positions, W beam width, L beam length, S search width, K lookup beams, H hidden.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from redrafter_mlx.backend.plan import build_decoder
from redrafter_mlx.core import atomic
from redrafter_mlx.core.decode import llm
from redrafter_mlx.core.decode.accept import accepted_lengths, greedy
from redrafter_mlx.core.decode.decoder import Decoder
from redrafter_mlx.core.decode.lookup import NgramIndex
from redrafter_mlx.core.decode.mode import Mode
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.decode.source import taps_of
from redrafter_mlx.core.decode.speculative import accepted_source
from redrafter_mlx.core.decode.step import Decoding, Step
from redrafter_mlx.core.decode.stops import through_stop
from redrafter_mlx.core.decode.stream import SOURCES
from redrafter_mlx.core.drafters.beam_search import BeamDrafter, check_width, expand, narrow, start
from redrafter_mlx.core.drafters.redrafter import Drafter, tap_features
from redrafter_mlx.core.errors import ConfigError
from redrafter_mlx.core.serving.session import Session
from redrafter_mlx.io.load import eos_ids
from redrafter_mlx.io.templates import apply_chat_template

PATH_SHAPE = (2, 5)  # beam shape of the real loop that decodes greedy paths for simulate_grid
NO_TOKEN = -2  # pads lookup beams: equals no token and no past-the-path choice (-1)

Progress = Callable[[int], None]  # called with the number of (prompt, shape) runs just done


@dataclass(frozen=True)
class Evaluation:
    """What an evaluation decodes: ``prompts`` (text) with the target ``model`` and its
    ``tokenizer``, ``drafter``'s beams at each of ``shapes``, ``max_tokens`` new tokens each;
    ``categories`` (one per prompt, None for a prompt without one) adds per-category rows."""

    def built_decoder(self) -> Decoder:
        """The given decoder, or one built for ``model`` and ``drafter`` now."""
        if self.decoder is not None:
            return self.decoder
        return build_decoder(self.model, BeamDrafter(self.drafter, llm.embedding(self.model)))

    model: Any
    tokenizer: Any
    drafter: Drafter
    prompts: list[str]
    shapes: list[BeamShape]
    max_tokens: int
    categories: list[str | None] | None = None
    decoder: Decoder | None = None  # of model and drafter, when the caller has one built

    def __post_init__(self):
        if self.categories is not None and len(self.categories) != len(self.prompts):
            raise ValueError(f"{len(self.categories)} categories for {len(self.prompts)} prompts")


def user_prompt_ids(tokenizer, text: str) -> list[int]:
    """One user turn with the model's chat template (Vicuna's for Vicuna) and a generation
    prompt: the prompts every evaluation decodes from."""
    return apply_chat_template(tokenizer, [{"role": "user", "content": text}])


def check_shapes(drafter: Drafter, shapes: list[BeamShape]) -> None:
    """ConfigError naming the first shape whose search is wider than the draft vocabulary."""
    for shape in shapes:
        try:
            check_width(drafter, shape.searched)
        except ConfigError as e:
            raise ConfigError(f"{shape.describe()}: {e}") from None


# ----------------------------------------------------------------------------- decode loop


def evaluate(job: Evaluation, progress: Progress | None = None) -> list[dict]:
    """Tokens/step per shape of ``job`` with the real decode loop: one row per shape
    (:func:`summarize`)."""
    eos = eos_ids(job.tokenizer)
    encoded = [user_prompt_ids(job.tokenizer, p) for p in job.prompts]
    decoder = job.built_decoder()
    rows = []
    for shape in job.shapes:
        session = Session(decoder, job.tokenizer, Decoding(Mode.REDRAFTER, shape), warm=False)
        runs = []
        for ids in encoded:
            runs.append(decode_one(session, ids, job.max_tokens, eos))
            if progress:
                progress(1)
        rows.append(summarize(shape, runs, job.categories))
    return rows


def decode_one(session: Session, prompt_ids: list[int], max_tokens: int, eos: set[int]) -> dict:
    """Greedy ReDrafter decode of one prompt -> ``{"tokens", "steps", "ids", "accepted_from"}``
    (first token from the prefill excluded from tokens and steps, included in ids)."""
    session.reset()  # each prompt on its own, as a fresh answer
    steps = session.steps(prompt_ids)
    return _counts(list(_emitted(steps, eos, max_tokens)), max_tokens)


def _emitted(steps: Iterator[Step], eos: set[int], max_tokens: int) -> Iterator[Step]:
    """Each step with its tokens cut after the first EOS token (kept): the prefill's first
    token, then one step per decode step, until an EOS or a decode step that brings the total
    to ``max_tokens``."""
    total = 0
    for k, step in enumerate(steps):
        emitted = through_stop(step.tokens, eos)
        total += len(emitted)
        yield dataclasses.replace(step, tokens=emitted)
        if emitted[-1] in eos or (k and total >= max_tokens):
            return


def _counts(chunks: list[Step], max_tokens: int) -> dict:
    """``{"tokens", "steps", "ids", "accepted_from"}`` of the decode that emitted ``chunks``
    (:func:`_emitted`) had it stopped after the first decode step that reached ``max_tokens``
    tokens. The last step may overshoot max_tokens by up to L - 1 tokens, by how much depends
    on the shape: ``ids`` holds the first max_tokens only, to compare outputs.
    ``accepted_from`` counts each counted step's accepted drafts (its tokens but the target's
    own next one) by source, so tokens = steps + the sum of its counts."""
    ids, steps = list(chunks[0].tokens), 0
    accepted = dict.fromkeys(SOURCES, 0)
    for chunk in chunks[1:]:
        if steps and len(ids) >= max_tokens:
            break
        ids += chunk.tokens
        steps += 1
        if len(chunk.tokens) > 1:
            accepted[chunk.accepted_from] += len(chunk.tokens) - 1
    return {
        "tokens": len(ids) - len(chunks[0].tokens),
        "steps": steps,
        "ids": ids[:max_tokens],
        "accepted_from": accepted,
    }


def summarize(shape: BeamShape, runs: list[dict], categories: list | None = None) -> dict:
    """One row of results: ``runs`` (``{"tokens", "steps", "ids", "accepted_from"}`` per
    prompt) at ``shape``, pooled, per prompt and per category (``categories``: one per run,
    None for a prompt without one; ``{}`` without categories), with the accepted drafts by
    source and a digest of the outputs (equal across shapes: greedy)."""
    tokens, steps = sum(r["tokens"] for r in runs), sum(r["steps"] for r in runs)
    digest = hashlib.sha1(json.dumps([r["ids"] for r in runs]).encode()).hexdigest()[:12]
    pooled: dict[str, list[int]] = {}
    for category, r in zip(categories or [None] * len(runs), runs, strict=True):
        if category is not None:
            counts = pooled.setdefault(category, [0, 0])
            counts[0], counts[1] = counts[0] + r["tokens"], counts[1] + r["steps"]
    return {
        "width": shape.width,
        "length": shape.length,
        "search_width": shape.searched,
        "lookup": shape.lookup,
        "tokens": tokens,
        "steps": steps,
        "tokens_per_step": _per_step(tokens, steps),
        "accepted_from": {s: sum(r["accepted_from"][s] for r in runs) for s in SOURCES},
        "per_prompt": [_per_step(r["tokens"], r["steps"]) for r in runs],
        "per_category": {c: _per_step(*counts) for c, counts in pooled.items()},
        "output_digest": digest,
    }


def _per_step(tokens: int, steps: int) -> float | None:
    return round(tokens / steps, 3) if steps else None


# ----------------------------------------------------------------------------- simulation


def simulate_grid(
    job: Evaluation,
    paths_file: Path | str | None = None,
    progress: Progress | None = None,
    target_id: str = "",
) -> list[dict]:
    """Like :func:`evaluate`, replaying steps along greedy paths decoded once by the real loop
    at :data:`PATH_SHAPE` (cached in ``paths_file``, keyed by prompt, when given). The row of
    that shape also carries the real loop's own count (``real_tokens_per_step``) when the paths
    were decoded with this drafter in this call. ``target_id`` names the target in the cache
    keys (paths of another model are not reused)."""
    longest = max(shape.length for shape in job.shapes)
    paths = load_paths(
        job.built_decoder(),
        job.tokenizer,
        job.prompts,
        job.max_tokens + longest,
        paths_file,
        count_until=job.max_tokens,
        target_id=target_id,
    )
    runs: dict[BeamShape, list[dict]] = {shape: [] for shape in job.shapes}
    for ids, hidden, n_prompt, _ in paths:
        for shape, run in replay_path(job, ids, hidden, n_prompt).items():
            runs[shape].append(run)
        if progress:
            progress(len(job.shapes))
    rows = [summarize(shape, runs[shape], job.categories) for shape in job.shapes]
    real = [p[3] for p in paths]
    for shape, row in zip(job.shapes, rows, strict=True):
        if shape == BeamShape(*PATH_SHAPE) and all(real):
            tokens, steps = sum(r["tokens"] for r in real), sum(r["steps"] for r in real)
            row["real_tokens_per_step"] = _per_step(tokens, steps)
            row["real_tokens"], row["real_steps"] = tokens, steps
    return rows


def replay_path(job: Evaluation, ids: list[int], hidden: mx.array, n_prompt: int) -> dict:
    """Every shape of ``job`` replayed along one greedy path ``ids (N,)`` with target hidden
    ``hidden (N, H)`` (:func:`greedy_path`) -> ``{shape: {"tokens", "steps", "ids",
    "accepted_from"}}``. One batched search per (W, S) serves every L and K: beam search keeps
    the same beams at every depth whatever the final length; one walk of an n-gram index
    proposes the lookup beams of every (K, L)."""
    embed = llm.embedding(job.model)
    contexts, pendings = hidden[n_prompt - 1 : -1], mx.array(ids[n_prompt:])
    depth = max(shape.length for shape in job.shapes) - 1
    searches: dict[tuple[int, int], list[BeamShape]] = {}
    for shape in job.shapes:
        searches.setdefault((shape.width, shape.searched), []).append(shape)
    lookups = {(s.lookup, s.length) for s in job.shapes if s.lookup}
    looked_up = lookup_everywhere(ids, n_prompt, sorted(lookups))
    out = {}
    for (width, searched), group in searches.items():
        found = beams_everywhere(job.drafter, embed, contexts, pendings, width, depth, searched)
        for shape in group:
            beams = found[shape.length - 2][0]
            extra = looked_up.get((shape.lookup, shape.length))
            out[shape] = simulate(beams, ids, n_prompt, job.max_tokens, shape.length, extra)
    return out


def lookup_everywhere(
    ids: list[int], n_prompt: int, shapes: list[tuple[int, int]]
) -> dict[tuple[int, int], np.ndarray]:
    """The prompt-lookup beams a step would verify at every position of a path -> for each
    ``(K, L)`` of ``shapes``, ``(T, K, L)`` int32 (row r: pending ``ids[n_prompt + r]``),
    rows with fewer than K beams padded with :data:`NO_TOKEN`.

    As in the decode loop, the index at position j holds ``ids[:j]`` (the cached tokens: the
    prompt, then every path token before the pending one); one index grows along the path.
    """
    rows = len(ids) - n_prompt
    out = {(k, n): np.full((rows, k, n), NO_TOKEN, np.int32) for k, n in shapes}
    if not shapes:
        return out
    index = NgramIndex(ids[:n_prompt])
    for r, pending in enumerate(ids[n_prompt:]):
        for (k, n), beams in out.items():
            found = index.propose(pending, k, n)
            beams[r, : len(found)] = found
        index.extend([pending])
    return out


def beams_everywhere(
    drafter: Drafter, embed, contexts, pendings, width: int, depth: int, search_width: int = 0
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The drafter's beam search from every position of a path at once.

    ``contexts (T, H)``, ``pendings (T,)`` -> for d = 1..depth, ``(beams (T, W, d + 1), drafted
    tokens' log-probs (T, W, d))`` (numpy):
    :func:`redrafter_mlx.core.drafters.beam_search.beam_search`'s search
    (:func:`~redrafter_mlx.core.drafters.beam_search.start`, then
    :func:`~redrafter_mlx.core.drafters.beam_search.expand` with ``max(W, search_width)`` beams,
    then :func:`~redrafter_mlx.core.drafters.beam_search.narrow` to W) batched over the T
    positions. A length-L search is the depth L - 1 entry.
    """
    kept = max(width, search_width)
    search = start(drafter, contexts, pendings, kept)
    out = []
    for _ in range(depth):
        search = expand(drafter, embed, contexts, *search, width=kept)
        verified = narrow(search[0], search[2], width)
        mx.eval(*search, *verified)
        out.append(tuple(np.array(a) for a in verified))
    return out


def simulate(
    beams_at, ids: list[int], n_prompt: int, max_tokens: int, length: int, lookup_at=None
) -> dict:
    """Greedy ReDrafter steps replayed along a known greedy path (see :func:`greedy_path`).

    ``beams_at (T, W, L)`` are the beams drafted from ``(hidden[j - 1], ids[j])`` for
    ``j = n_prompt + r`` (row r), ``lookup_at (T, K, L)`` (optional) the lookup beams of the
    same positions (:func:`lookup_everywhere`). Each step drafts at the pending position t,
    accepts the longest prefix of any of its beams matching the path and emits it plus the
    target's next token; ``accepted_from`` counts the accepted drafts by the source of the
    beams that hold them (the decode loop's attribution). Greedy decoding is exact, so this
    equals the real loop's count up to floating-point near-ties (tree vs chain attention,
    batched vs single-row drafting), without any target pass.
    """
    width = beams_at.shape[1]
    if lookup_at is not None:
        beams_at = np.concatenate([beams_at, lookup_at], axis=1)
    accepted = _accepted_along(beams_at, ids, n_prompt, length)
    best, most = accepted.argmax(axis=-1), accepted.max(axis=-1)
    t, tokens, steps = n_prompt, 0, 0
    sources = dict.fromkeys(SOURCES, 0)
    while t < len(ids) - 1 and t - n_prompt + 1 < max_tokens:
        r = t - n_prompt
        num_accepted = int(most[r])
        if num_accepted:
            sources[accepted_source(beams_at[r], width, int(best[r]), num_accepted)] += num_accepted
        tokens, steps, t = tokens + num_accepted + 1, steps + 1, t + num_accepted + 1
    return {"tokens": tokens, "steps": steps, "ids": ids[n_prompt:], "accepted_from": sources}


def _accepted_along(beams_at, ids: list[int], n_prompt: int, length: int) -> np.ndarray:
    """Drafted tokens each beam of a step at each row of ``beams_at (T, W, L)`` accepts ->
    ``(T, W)``: the target's choices are the path's next tokens. The path's last token can only
    be a step's own next token (it has no successor to check): past it the choices are -1, no
    token."""
    rows = len(beams_at)
    after = [int(i) for i in ids[n_prompt + 1 : -1]]
    path = np.array(after + [-1] * (rows + length - len(after)), dtype=np.int32)
    choices = np.lib.stride_tricks.sliding_window_view(path, length - 1)[:rows]  # (T, L - 1)
    drafted = mx.array(np.ascontiguousarray(beams_at[:, :, 1:]))
    accepted = accepted_lengths(drafted, mx.array(np.ascontiguousarray(choices))[:, None])
    return np.array(accepted)


def greedy_path(
    decoder: Decoder,
    prompt_ids: list[int],
    max_tokens: int,
    eos: set[int],
    count_until: int | None = None,
):
    """The target's greedy continuation of ``prompt_ids`` (``max_tokens`` new tokens or up to
    and with end of sequence) -> ``(ids (N,) prompt + continuation, hidden (N, H), real)`` where
    ``hidden[j]`` is the teacher-forced final-norm hidden state after ``ids[: j + 1]``.

    With the decoder's drafter the path is decoded by the real speculative loop at
    :data:`PATH_SHAPE` (same tokens, fewer passes) and ``real`` holds that loop's own
    ``{"tokens", "steps"}`` counted like :func:`decode_one` up to ``count_until`` new tokens;
    otherwise ``real`` is None.
    """
    drafted = decoder.drafter is not None
    shape = BeamShape(*PATH_SHAPE)
    mode = Mode.choose(drafter=drafted, shape=shape, autoregressive=not drafted)
    decoding = Decoding(mode, shape, greedy)
    session = Session(decoder, None, decoding, warm=False)
    steps = session.steps(prompt_ids)
    chunks = list(_emitted(steps, eos, max_tokens))
    ids = [*prompt_ids, *(t for chunk in chunks for t in chunk.tokens)]
    ids = ids[: len(prompt_ids) + max_tokens]
    real = None
    if drafted:
        counted = _counts(chunks, count_until or max_tokens)
        real = {"tokens": counted["tokens"], "steps": counted["steps"]}
    return ids, path_hidden(decoder.forward, ids, decoder.drafter), real


def path_hidden(forward: llm.Forward, ids: list[int], drafter=None) -> mx.array:
    """The target's final-norm hidden (n, H) over a whole path of n token ids, one uncompiled
    forward (path lengths vary: nothing to compile); for a layered ``drafter`` (one with
    ``taps``) the context it drafts from instead: that hidden fused with the tapped layers of
    the same forward, as decoding fuses them (``core/drafters/beam_search.py:
    BeamDrafter.draft``)."""
    n, sequence = len(ids), llm.new_sequence(forward.model)
    mask = llm.chain_mask(0, n)
    taps = dict.fromkeys(taps_of(drafter))
    hidden = forward(mx.array(ids), mx.arange(n), mask, sequence, compiled=False, taps=taps)
    if not taps:
        return hidden
    return drafter.drafter.fuse(hidden, tap_features([taps[i] for i in drafter.taps]))


# ----------------------------------------------------------------------------- paths cache


class PathsCacheError(ConfigError):
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
    decoder: Decoder,
    tokenizer,
    prompts: list[str],
    max_tokens: int,
    paths_file: Path | str | None,
    count_until: int | None = None,
    target_id: str = "",
) -> list[tuple[list[int], mx.array, int, dict | None]]:
    """Greedy paths per prompt ``[(ids, hidden (N, H), n_prompt, real)]``, from/into
    ``paths_file`` (``real`` is None for stored paths), keyed by ``target_id``, prompt and
    length; the file is rewritten atomically after each new path."""
    eos = eos_ids(tokenizer)
    stored = _read_paths(Path(paths_file)) if paths_file else {}
    out = []
    for p in prompts:
        prompt_ids = user_prompt_ids(tokenizer, p)
        key = hashlib.sha1(json.dumps([target_id, p, max_tokens]).encode()).hexdigest()
        if key in stored:
            ids, real = stored[key], None
            hidden = path_hidden(decoder.forward, ids, decoder.drafter)
        else:
            ids, hidden, real = greedy_path(decoder, prompt_ids, max_tokens, eos, count_until)
            stored[key] = ids
            if paths_file:
                atomic.write_text(paths_file, json.dumps(stored))
        mx.eval(hidden)
        out.append((ids, hidden, len(prompt_ids), real))
    return out
