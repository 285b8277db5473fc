"""The autotune search: the fastest beam shape (W, L) for this chip, model and drafter.

Legend: W beam width, L beam length, T packed tree nodes.

Search: successive halving over the W x L grid on short held-out prompts (never MT-Bench),
measuring real tokens/s with the benchmark's own timer (:func:`measure.measure`). Every round
runs all surviving shapes once on the next prompt, in a shuffled order (so drift hits all
alike), then keeps the best ~30% until three finalists remain, which get extra rounds.

A single run is 20-30% noisy here, too noisy to rank shapes that differ by 5%. But a run's
tokens/s is ``tokens per step / seconds per step``, and only the second factor is noisy
(greedy acceptance is exact); seconds per step is a smooth function of the shape. So each
round fits one small cost model over *all* runs (``seconds/step ~ 1, T, T^2, L-1, W(L-1)``,
relative least squares) and ranks a shape by its own tokens/step over the modelled cost,
corrected by its own mean residual shrunk towards zero (``n / (n + SHRINK)``). Noise then
averages over every run instead of the one or two each shape gets.

Context bands: a verified tree costs more per cached token than a one-token step, so the best
shape (or plain decoding) depends on the context length. :func:`context_bands` times a step of
the search's best few shapes and a one-token step with the cache holding each of several
lengths, and keeps per length band the shape with the most tokens/s (its tokens/step from the
search's runs over its step's cost there), or plain decoding where none beats it.

With ``temp`` > 0 the runs sample (reseeded per prompt, the same stream for every shape):
tokens/step is then random too, and the same averaging over all runs absorbs it. Sampling
accepts fewer drafts than greedy decoding, so its best shape is often shorter.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.serving.session import Session
from redrafter_mlx.io import runtime as rt
from redrafter_mlx.tuning.device import chip_info
from redrafter_mlx.tuning.measure import AUTOREGRESSIVE, REDRAFTER, Method, measure, time_steps
from redrafter_mlx.tuning.profiles import ContextBands, runtime_identity

DEFAULT_WIDTHS = tuple(range(1, 9))


DEFAULT_LENGTHS = tuple(range(2, 7))


KEEP = 0.3  # fraction of shapes kept per round


FINALISTS = 3


FINAL_ROUNDS = 4  # rounds the finalists get (including the one that made them finalists)


SHRINK = 12.0  # runs of its own before a shape's residual counts half


CONTEXTS = (512, 2048, 8192)  # context lengths the bands are measured at (cut to the model's)


# Short generic held-out prompts (not MT-Bench, not training data).
HELDOUT_PROMPTS = (
    "Explain how a refrigerator keeps food cold.",
    "Write a short poem about autumn leaves.",
    "What are three tips for learning a new language?",
    "Describe the water cycle in simple terms.",
    "Give me a recipe for a quick vegetable soup.",
    "Why is the sky blue? Answer in a few sentences.",
)


@dataclass
class Observation:
    """One run of one shape: tokens/step (exact, greedy), seconds/step (noisy), tree size T."""

    shape: BeamShape
    prompt: int
    tokens_per_step: float
    seconds_per_step: float
    tree_size: float

    @property
    def tps(self) -> float:
        return self.tokens_per_step / max(self.seconds_per_step, 1e-12)


Measure = Callable[[BeamShape, int], Observation]


def _features(shape: BeamShape, tree: float) -> list[float]:
    searched, n = shape.searched, shape.length  # drafting: L - 1 depths of S beams
    # lookup beams cost host time (proposing, packing) beyond the tree they add
    return [1.0, tree, tree * tree / 16.0, n - 1.0, searched * (n - 1.0), float(shape.lookup)]


def fit_cost(observations: Sequence[Observation]) -> Callable[[BeamShape, float], float]:
    """Seconds/step model from all runs (relative least squares) -> ``log seconds``."""
    x = np.array([_features(o.shape, o.tree_size) for o in observations])
    y = np.array([o.seconds_per_step for o in observations])
    beta = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)[0]

    def log_cost(shape: BeamShape, tree: float) -> float:
        return math.log(max(float(np.dot(_features(shape, tree), beta)), 1e-9))

    return log_cost


def scores(
    observations: Sequence[Observation], shapes: Sequence[BeamShape], *, shrink: float = SHRINK
) -> dict[BeamShape, float]:
    """Estimated log tokens/s of each shape: own tokens/step over the modelled cost, plus the
    shape's own mean residual shrunk by ``n / (n + shrink)``."""
    log_cost = fit_cost(observations)
    out = {}
    for shape in shapes:
        own = [o for o in observations if o.shape == shape]
        tree = statistics.fmean(o.tree_size for o in own)
        resid = statistics.fmean(
            math.log(o.seconds_per_step) - log_cost(shape, o.tree_size) for o in own
        )
        accepted = statistics.fmean(o.tokens_per_step for o in own)
        out[shape] = (
            math.log(accepted) - log_cost(shape, tree) - len(own) / (len(own) + shrink) * resid
        )
    return out


@dataclass
class SearchResult:
    best: BeamShape
    # tokens/s per shape: halving keeps each shape's estimate from the last round that ranked
    # it (eliminated shapes keep their last one); the full grid, its measured median
    estimates: dict[BeamShape, float]
    observations: list[Observation] = field(default_factory=list)
    # halving: the rounds each shape ran in; a shape that lasted longer ranks above one out
    # earlier, whose estimate is an older round's (it may be higher than the winner's last)
    rounds: dict[BeamShape, int] = field(default_factory=dict)


def successive_halving(
    shapes: Sequence[BeamShape],
    measure: Measure,
    *,
    num_prompts: int,
    seed: int = 0,
    keep: float = KEEP,
    finalists: int = FINALISTS,
    final_rounds: int = FINAL_ROUNDS,
    shrink: float = SHRINK,
    on_run: Callable[[BeamShape], None] | None = None,
) -> SearchResult:
    """Rounds over prompts ``0, 1, ...`` (mod ``num_prompts``); see the module docstring."""
    rng = np.random.default_rng(seed)
    alive, observations, ranked, rounds = list(shapes), [], {}, {}
    extra, rnd = None, 0
    while True:
        for i in rng.permutation(len(alive)):
            observations.append(measure(alive[i], rnd % num_prompts))
            if on_run:
                on_run(alive[i])
        rnd += 1
        est = scores(observations, alive, shrink=shrink)
        ranked |= {s: math.exp(v) for s, v in est.items()}
        rounds |= dict.fromkeys(alive, rnd)
        alive.sort(key=lambda s: -est[s])
        if len(alive) <= finalists:
            extra = final_rounds - 1 if extra is None else extra - 1
            if extra <= 0:
                return SearchResult(alive[0], ranked, observations, rounds)
        else:
            alive = alive[: max(finalists, math.ceil(len(alive) * keep))]


def halving_runs(
    shapes: int, *, keep: float = KEEP, finalists: int = FINALISTS, final_rounds: int = FINAL_ROUNDS
) -> int:
    """Runs :func:`successive_halving` makes over ``shapes`` shapes (its rounds do not depend
    on what they measure): the total a progress line's ETA needs."""
    alive, runs, extra = shapes, 0, None
    while True:
        runs += alive
        if alive <= finalists:
            extra = final_rounds - 1 if extra is None else extra - 1
            if extra <= 0:
                return runs
        else:
            alive = max(finalists, math.ceil(alive * keep))


def plain_gain(
    runtime,
    best: BeamShape,
    prompts: Sequence[list[int]],
    *,
    max_tokens: int,
    temp: float = 0.0,
    seed: int = 0,
    on_run: Callable[[str], None] | None = None,
) -> float:
    """Tokens/s of ``best`` over plain decoding (one token per step, our own loop): both on
    every prompt, interleaved (the order alternating), reseeded alike; the ratio of the
    medians over prompts. The search itself times only shapes."""
    methods = [Method(REDRAFTER, best), Method(AUTOREGRESSIVE)]
    tps: dict[str, list[float]] = {m.kind: [] for m in methods}
    for k, prompt in enumerate(prompts):
        for method in methods[k % 2 :] + methods[: k % 2]:
            run = measure(runtime, method, prompt, max_tokens=max_tokens, temp=temp, seed=seed + k)
            tps[method.kind].append(run.generation_tps)
            if on_run:
                on_run(method.kind)
    plain = statistics.median(tps[AUTOREGRESSIVE])
    return statistics.median(tps[REDRAFTER]) / plain if plain > 0 else float("nan")


def full_grid(
    shapes: Sequence[BeamShape],
    measure: Measure,
    *,
    num_prompts: int,
    repetitions: int = 1,
    seed: int = 0,
    on_run: Callable[[BeamShape], None] | None = None,
) -> SearchResult:
    """Every shape on every prompt ``repetitions`` times (shuffled order); best = the highest
    median over prompts of per-prompt median tokens/s (the bench's figure)."""
    rng = np.random.default_rng(seed)
    observations = []
    for _ in range(repetitions):
        for prompt in range(num_prompts):
            for i in rng.permutation(len(shapes)):
                observations.append(measure(shapes[i], prompt))
                if on_run:
                    on_run(shapes[i])
    med = {s: grid_tps(observations, s) for s in shapes}
    best = max(shapes, key=lambda s: med[s])
    return SearchResult(best, med, observations)


def grid_tps(observations: Sequence[Observation], shape: BeamShape) -> float:
    """Median over prompts of the per-prompt median tokens/s of ``shape``."""
    per: dict[int, list[float]] = {}
    for o in observations:
        if o.shape == shape:
            per.setdefault(o.prompt, []).append(o.tps)
    return statistics.median(statistics.median(v) for v in per.values())


def make_measure(
    runtime, prompts: Sequence[list[int]], *, max_tokens: int, temp: float = 0.0, seed: int = 0
) -> Measure:
    """A ``Measure`` that generates with the benchmark's timer (``bench.measure``); with
    ``temp`` > 0 it samples, reseeded per prompt (every shape sees the same random stream)."""

    def run(shape: BeamShape, prompt: int) -> Observation:
        result = measure(
            runtime,
            Method(REDRAFTER, shape),
            prompts[prompt],
            max_tokens=max_tokens,
            temp=temp,
            seed=seed + prompt if temp else None,
        )
        steps = max(result.steps, 1)
        tree = statistics.fmean(result.tree_sizes) if result.tree_sizes else 1.0
        after_first = len(result.token_latencies)
        return Observation(
            shape,
            prompt,
            max(after_first, 1) / steps,
            max(sum(result.token_latencies), 1e-9) / steps,
            tree,
        )

    return run


def heldout_prompt_ids(runtime, count: int, texts: Sequence[str] = HELDOUT_PROMPTS):
    """The first ``count`` of ``texts`` (default: the built-in held-out prompts) as chat
    token ids ``[ids, ...]``."""
    return [rt.encode_chat(runtime, [{"role": "user", "content": p}]) for p in texts[:count]]


def table(result: SearchResult) -> list[dict]:
    """Per-shape rows: runs, tokens/step, tree size, median measured and estimated tokens/s;
    ranked as the search ranked them, so the first row is ``result.best``: by the rounds a
    shape lasted (halving), then by its estimate."""
    rows = []
    ranked = sorted(result.estimates.items(), key=lambda kv: (-result.rounds.get(kv[0], 0), -kv[1]))
    for shape, estimate in ranked:
        own = [o for o in result.observations if o.shape == shape]
        rows.append(
            {
                "beam_width": shape.width,
                "beam_length": shape.length,
                "min_prob": shape.min_prob,
                "search_width": shape.searched,
                "lookup": shape.lookup,
                "runs": len(own),
                "tokens_per_step": round(statistics.fmean(o.tokens_per_step for o in own), 3),
                "mean_tree_size": round(statistics.fmean(o.tree_size for o in own), 2),
                "measured_tps": round(statistics.median(o.tps for o in own), 3),
                "estimated_tps": round(estimate, 3),
            }
        )
    return rows


@dataclass
class BandCosts:
    """Step costs at one context length: seconds of a one-token step and of each shape's."""

    context: int
    one_token: float
    steps: dict[BeamShape, float]


def choose_bands(
    costs: Sequence[BandCosts], tokens_per_step: dict[BeamShape, float]
) -> ContextBands:
    """Per measured length the shape with the most tokens/s (None: a one-token step makes
    more); each choice holds from the geometric midpoint with the previous length on (the
    first from 0), and neighbours that chose alike merge."""
    costs = sorted(costs, key=lambda c: c.context)
    bands: list[tuple[int, BeamShape | None]] = []
    for i, cost in enumerate(costs):
        best = max(cost.steps, key=lambda s: tokens_per_step[s] / cost.steps[s])
        wins = tokens_per_step[best] / cost.steps[best] > 1.0 / cost.one_token
        start = 0 if i == 0 else round(math.sqrt(costs[i - 1].context * cost.context))
        if not bands or bands[-1][1] != (best if wins else None):
            bands.append((start, best if wins else None))
    return ContextBands(tuple(bands))


def context_costs(
    runtime,
    shapes: Sequence[BeamShape],
    contexts: Sequence[int],
    filler: list[int],
    *,
    temp: float = 0.0,
    reps: int = 4,
    on_context: Callable[[int], None] | None = None,
) -> list[BandCosts]:
    """:class:`BandCosts` of ``shapes`` at each of ``contexts`` (cut to fit the model), with
    the cache holding that many tokens of ``filler`` (repeated). Their K/V are zeros, not
    computed: a step costs the same whatever the cached values, and a long prompt's prefill
    would take minutes. Attention-only models (recurrent state cannot be faked): [] else.
    ``on_context`` hears each length done."""
    decoder = runtime.decoder
    room = (runtime.max_context or max(contexts)) - max(s.length for s in shapes) - 2
    session = Session(decoder, runtime.tokenizer, rt.decoding(runtime, shapes[0], temp=temp))
    if session.sequence.states is not None:
        return []
    out = []
    for context in sorted({min(c, room) for c in contexts}):
        _fill(session, filler, context)
        one, steps = [], {}
        for shape in shapes:
            session.set_decoding(rt.decoding(runtime, shape, temp=temp))
            one_token, steps[shape] = time_steps(session, reps)
            one.append(one_token)
        out.append(BandCosts(context, statistics.median(one), steps))
        if on_context:
            on_context(context)
    return out


def _fill(session: Session, filler: list[int], context: int) -> None:
    """Make ``session``'s sequence hold ``context`` tokens (``filler`` repeated): one token's
    K/V is computed (each layer's buffers allocated), the rest stay zeros, which the next
    forward's room covers."""
    sequence = session.sequence
    sequence.rewind(0)
    token = mx.array(filler[:1])
    mx.eval(session.decoder.forward(token, mx.zeros((1,), mx.int32), None, sequence))
    ids = (filler * (context // max(len(filler), 1) + 1))[:context]
    sequence.commit(ids)


def observed_tokens_per_step(result: SearchResult) -> dict[BeamShape, float]:
    """Each measured shape's mean tokens/step over its runs."""
    per: dict[BeamShape, list[float]] = {}
    for o in result.observations:
        per.setdefault(o.shape, []).append(o.tokens_per_step)
    return {shape: statistics.fmean(v) for shape, v in per.items()}


def profile_entry(
    runtime,
    result: SearchResult,
    *,
    method: str,
    seconds: float,
    max_tokens: int,
    temp: float = 0.0,
    prompts: str | None = None,
    bands: ContextBands | None = None,
    costs: Sequence[BandCosts] = (),
    gain: float | None = None,
) -> dict:

    _, fp = runtime_identity(runtime)
    return {
        "shape": [
            result.best.width,
            result.best.length,
            result.best.min_prob,
            result.best.searched,
            result.best.lookup,
        ],
        "method": method,
        "fingerprint": fp,
        "chip": chip_info(),
        "model": str(runtime.model_id),
        "drafter": runtime.drafter_id,
        "mlx": mx.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(seconds, 1),
        "max_tokens": max_tokens,
        "temp": temp,
        "prompts": prompts or "built-in",
        "tokens_per_second": round(result.estimates[result.best], 3),
        # the best shape's tokens/s over plain decoding's, measured after the search
        "gain_over_plain_decoding": None if gain is None else round(gain, 3),
        "table": table(result),
        "bands": (bands or ContextBands.single(result.best)).to_json(),
        "band_costs": [
            {
                "context": c.context,
                "one_token_seconds": round(c.one_token, 5),
                "step_seconds": {s.label: round(v, 5) for s, v in c.steps.items()},
            }
            for c in costs
        ],
    }
