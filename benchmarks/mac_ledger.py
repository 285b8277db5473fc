"""A per-step ledger for a Mac: what each kind of decode step asks of the host and of the
device, measured here on the generic plan (``REDRAFTER_CPU_TUNING=0``: the code Metal runs),
and from it a *predicted* tokens/s per Apple chip family.

Rows (each on the embedded SmolLM2-135M target, float as loaded and 4-/8-bit copies made with
mlx-lm's ``nn.quantize``): our plain step; ReDrafter tree steps at W1 L2, W2 L4 and W4 L5
with the shipped drafter; an EAGLE-3 and a DFlash step (stand-in drafters with random weights
in their published shapes, as ``field_drafters.py`` builds them: they accept ~nothing, so
they show cost, not tokens/step); a batch step of 4 members (ReDrafter W2 L4, and plain);
and alongside, mlx-lm's own ``generate_step``, ``speculative_generate_step`` (a 4-layer
random stand-in draft model of the target's shape, ``num_draft_tokens=2``, its default) and
``BatchGenerator`` step of 4.

Per step (``ledger_trace.py`` says exactly how each is counted):

- ``exposed_ms``: host time (this Python thread's CPU time, so that neither the computation
  nor other processes inflate it) while no dispatched work was outstanding, plus the CPU time
  inside blocking ``mx.eval`` calls (building the tape and handing it over): graph building,
  tree packing and dispatch that the device waits for whatever its speed;
- ``overlapped_ms``: host time while an ``async_eval``'s work was outstanding (a pipelined
  loop building the next step): hidden on a device slower than it, waited for on a faster one;
- ``kernels``: the Metal estimate of kernels dispatched (graph primitives less views, with each
  ``mx.fast`` op's CPU fallback counted as one kernel), and ``primitives`` as built here;
- ``weight_mb`` / ``kv_mb``: bytes read, from parameter sizes (the target's layers and LM
  head per forward, each drafter pass's own weights and the LM head it scores with) and cache
  lengths (K/V of every cached token per forward; embedding rows gathered are left out);
- ``syncs``: host reads (``mx.eval``, ``.item()``, ``.tolist()``, ``np.array`` of an array not
  yet evaluated), and ``tokens_per_step`` (measured: the stand-in drafters' is ~1).

The prediction, per chip: ``step = exposed + max(overlapped, device)``, ``device = bytes /
bandwidth + kernels * dispatch``; tokens/s = tokens_per_step / step. It assumes the host work
costs on the Mac what it costs here, the peak bandwidth Apple publishes, and a per-dispatch cost
that is an assumption (:data:`DISPATCH_US`): a prediction, never a measurement.

    REDRAFTER_CPU_TUNING=0 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        .venv/bin/python benchmarks/mac_ledger.py --quick --out benchmarks/results/mac_ledger.json

``--table-from REPORT`` re-predicts a saved report (another ``--dispatch-us``, say) without
measuring.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ledger_trace import Tracer  # noqa: E402

# Unified memory bandwidth, GB/s, the base configuration of each family (the full chip where
# Apple says "up to"). Sources: Apple Newsroom, M1 Pro/Max (2021-10-18: M1 Pro 200, M1 Max
# 400, "up to 3x M1"; M1's 68.25 = LPDDR4X-4266 on a 128-bit bus, AnandTech's M1 review: Apple
# gives no figure), M2 (2022-06-06: 100), M2 Pro/Max (2023-01-17: 200, 400), M3 family
# (2023-10-30: M3 100, M3 Pro 150, M3 Max up to 400; tech specs pages), M4 (2024-05-07: 120),
# M4 Pro/Max (2024-10-30: 273, up to 546).
CHIPS = {
    "M1": (68.25, "anandtech.com/show/16252 (LPDDR4X-4266, 128-bit)"),
    "M1 Pro": (200.0, "apple.com/newsroom/2021/10/introducing-m1-pro-and-m1-max"),
    "M1 Max": (400.0, "apple.com/newsroom/2021/10/introducing-m1-pro-and-m1-max"),
    "M2": (100.0, "apple.com/newsroom/2022/06/apple-unveils-m2"),
    "M2 Pro": (200.0, "apple.com/newsroom/2023/01/apple-unveils-m2-pro-and-m2-max"),
    "M2 Max": (400.0, "apple.com/newsroom/2023/01/apple-unveils-m2-pro-and-m2-max"),
    "M3": (100.0, "apple.com/newsroom/2023/10/apple-unveils-m3-m3-pro-and-m3-max"),
    "M3 Pro": (150.0, "apple.com/newsroom/2023/10/apple-unveils-m3-m3-pro-and-m3-max"),
    "M3 Max": (400.0, "apple.com/newsroom/2023/10/apple-unveils-m3-m3-pro-and-m3-max"),
    "M4": (120.0, "apple.com/newsroom/2024/05/apple-introduces-m4-chip"),
    "M4 Pro": (273.0, "apple.com/newsroom/2024/10/apple-introduces-m4-pro-and-m4-max"),
    "M4 Max": (546.0, "apple.com/newsroom/2024/10/apple-introduces-m4-pro-and-m4-max"),
}
# Device-side cost of one dispatched kernel on Apple GPUs, microseconds. AN ASSUMPTION: no
# public figure from Apple or MLX was found; a few microseconds per small kernel launched in
# one command buffer is the order folk measurements report. --dispatch-us changes it.
DISPATCH_US = 5.0

PRECISIONS = ("float", "q8", "q4")


@dataclass
class Sizes:
    """Bytes a step reads, per unit: ``target`` (layers, final norm, LM head) per forward,
    ``head`` (the LM head alone), ``kv_token`` (K and V of one cached token, every layer)."""

    target: int
    head: int
    kv_token: int


def param_bytes(module: nn.Module | list, skip: set[int] = frozenset()) -> int:
    """Bytes of the parameters of ``module`` (or a list of modules) not in ``skip`` (ids),
    each array counted once."""
    modules = module if isinstance(module, list) else [module]
    seen, total = set(skip), 0
    for _, value in tree_flatten([m.parameters() for m in modules]):
        if id(value) not in seen:
            seen.add(id(value))
            total += value.nbytes
    return total


def sizes(model: nn.Module) -> Sizes:
    from redrafter_mlx.core.decode.llm import compute_dtype, embedding, inner_model

    inner, args = inner_model(model), model.args
    head_module = getattr(model, "lm_head", None) or embedding(model)
    head = param_bytes(head_module)
    layers = param_bytes(inner.layers) + param_bytes(inner.norm)
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    kv_token = 2 * args.num_key_value_heads * head_dim * compute_dtype(model).size
    return Sizes(layers + head, head, kv_token * args.num_hidden_layers)


def ids(module: nn.Module) -> set[int]:
    return {id(v) for _, v in tree_flatten(module.parameters())}


# -- steppers: each prepares a loop in its steady state and runs one step per call


class Ours:
    """One of our sequences stepped by the decoder (plain or speculative)."""

    def __init__(self, decoder, prompt: list[int], decoding):
        decoder.warm_up(decoding)
        self.decoder, self.context = decoder, [len(prompt)]
        self.state, _ = decoder.prefill(decoder.new_sequence(), prompt, decoding)

    def step(self) -> int:
        self.state, step = self.decoder.step(self.state)
        self.context[0] += len(step.tokens)
        return len(step.tokens)


class OursBatch:
    """Members stepped together by ``batch.batch_step``."""

    def __init__(self, decoder, prompts: list[list[int]], decoding):
        from redrafter_mlx.core.serving import batch

        decoder.warm_up(decoding)
        self.batch, self.decoder = batch, decoder
        self.members = [
            batch.Member(decoder.prefill(decoder.new_sequence(), p, decoding)[0]) for p in prompts
        ]
        self.context = [len(p) for p in prompts]

    def step(self) -> int:
        steps = self.batch.batch_step(self.decoder, self.members)
        for i, s in enumerate(steps):
            self.context[i] += len(s.tokens)
        return sum(len(s.tokens) for s in steps)


class LmPlain:
    """mlx-lm's ``generate_step``: one token per ``next``."""

    def __init__(self, model, prompt: list[int]):
        from mlx_lm.generate import generate_step

        self.gen = generate_step(mx.array(prompt), model, max_tokens=1 << 20)
        self.context = [len(prompt)]
        next(self.gen)  # the prefill
        self.context[0] += 1

    def step(self) -> int:
        next(self.gen)
        self.context[0] += 1
        return 1


class LmSpeculative:
    """mlx-lm's ``speculative_generate_step``: a step is one draft-and-verify round (its
    accepted drafts, then the target's own token, ``from_draft`` False)."""

    def __init__(self, model, draft, prompt: list[int], num_draft: int):
        from mlx_lm.generate import speculative_generate_step

        self.gen = speculative_generate_step(
            mx.array(prompt), model, draft, num_draft_tokens=num_draft, max_tokens=1 << 20
        )
        self.context = [len(prompt)]
        self.step()

    def step(self) -> int:
        n = 0
        while True:
            _, _, from_draft = next(self.gen)
            n += 1
            if not from_draft:
                self.context[0] += n
                return n


class LmBatch:
    """mlx-lm's ``BatchGenerator``: a step is one ``next_generated`` of every member."""

    def __init__(self, model, prompts: list[list[int]]):
        from mlx_lm.generate import BatchGenerator

        self.gen = BatchGenerator(model, max_tokens=1 << 20, completion_batch_size=len(prompts))
        self.gen.insert(prompts)
        self.context = [len(p) for p in prompts]
        while len(self.gen.next_generated()) < len(prompts):  # the prompts' prefill
            pass

    def step(self) -> int:
        n = len(self.gen.next_generated())
        self.context = [c + 1 for c in self.context]
        return n


# -- bytes per step of each row


def stand_in_draft(model: nn.Module, layers: int, bits: int | None = None) -> nn.Module:
    """A random draft model of the target's architecture with ``layers`` layers (cost only),
    quantized to ``bits`` as the target is."""
    config = {**vars(model.args), "num_hidden_layers": layers}
    config.pop("layer_types", None)  # derived from the layer count
    mx.random.seed(3)
    draft = type(model)(type(model.args).from_dict(config))
    if bits:
        nn.quantize(draft, group_size=64, bits=bits)
    mx.eval(draft.parameters())
    return draft


def step_bytes(row: dict, context: list[int], unit: Sizes, parts: dict) -> tuple[int, int]:
    """``(weights, kv)`` bytes one step of ``row`` reads at these cached lengths."""
    kv = unit.kv_token * sum(context)
    weights = unit.target
    drafter = parts.get(row["drafter"])
    if drafter is not None:
        own, head, kv_token, per_depth = drafter
        passes = row["L"] - 1 if per_depth else 1
        weights += passes * (own + head)
        kv += passes * kv_token * max(context)  # a drafter's own cache (EAGLE-3, DFlash)
    return weights, kv


def head_rows_bytes(drafter: nn.Module) -> int:
    """Bytes of the LM-head rows a ReDrafter drafter scores each depth with (``head ==
    "target"``): its own copy of the target's rows for the draft vocabulary, dequantized into
    the drafter's dtype by ``bind_target``, so a quantized target's head does not shrink them."""
    args = drafter.args
    if args.head != "target":
        return 0
    rows = args.draft_vocab_size or args.vocab_size
    return rows * args.hidden_size * drafter.lm_head[-1].weight.dtype.size


def drafter_parts(target, drafters: dict, lm_draft, num_draft: int) -> dict:
    """Per drafter: (own weight bytes, LM-head bytes each pass scores with, its K/V bytes per
    cached token, whether it passes once per drafted depth)."""
    from redrafter_mlx.core.decode.llm import compute_dtype

    shared, unit = ids(target), sizes(target)
    parts = {}
    rnn = drafters.get("rnn")
    if rnn is not None:
        parts["rnn"] = (param_bytes(rnn.drafter, shared), head_rows_bytes(rnn.drafter), 0, True)
    itemsize = compute_dtype(target).size
    if "eagle3" in drafters:
        a = drafters["eagle3"].module.args
        head_dim = a.head_dim or a.hidden_size // a.num_attention_heads
        kv = 2 * a.num_key_value_heads * head_dim * itemsize * a.num_hidden_layers
        module = drafters["eagle3"].module
        parts["eagle3"] = (param_bytes(module, shared), 0, kv, True)
    if "dflash" in drafters:
        module = drafters["dflash"].module
        a = module.args
        kv = 2 * a.num_key_value_heads * a.head_dim * itemsize * a.num_hidden_layers
        parts["dflash"] = (param_bytes(module, shared), unit.head, kv, False)
    draft = sizes(lm_draft)
    parts["lm_draft"] = (draft.target, 0, draft.kv_token, True)
    return parts


# -- the rows


@dataclass(frozen=True)
class Row:
    """One ledger row: ``loop`` is whose loop steps (ours, ours_batch, lm_plain, lm_spec,
    lm_batch), ``drafter`` the key of its drafter (None: plain), at ``W`` x ``L``."""

    name: str
    loop: str
    drafter: str | None = None
    W: int = 1
    L: int = 1


NUM_DRAFT = 2  # mlx-lm's default num_draft_tokens
ROWS = (
    Row("plain", "ours"),
    Row("tree W1 L2", "ours", "rnn", 1, 2),
    Row("tree W2 L4", "ours", "rnn", 2, 4),
    Row("tree W4 L5", "ours", "rnn", 4, 5),
    Row("EAGLE-3 W2 L4 (stand-in)", "ours", "eagle3", 2, 4),
    Row("DFlash W2 L4 (stand-in)", "ours", "dflash", 2, 4),
    Row("DFlash W7 L8 (stand-in)", "ours", "dflash", 7, 8),
    Row("batch of 4, W2 L4", "ours_batch", "rnn", 2, 4),
    Row("batch of 4, plain", "ours_batch"),
    Row("mlx-lm generate_step", "lm_plain"),
    Row("mlx-lm speculative_generate_step", "lm_spec", "lm_draft", 1, NUM_DRAFT + 1),
    Row("mlx-lm BatchGenerator, 4", "lm_batch"),
)
BATCH = 4


def stepper(row: Row, target, drafters: dict, prompts: list[list[int]]):
    """A loop of ``row``'s kind after its prompt(s), in its steady state."""
    from redrafter_mlx.backend.plan import GENERIC_PLAN, build_decoder
    from redrafter_mlx.core.decode.accept import greedy
    from redrafter_mlx.core.decode.mode import Mode
    from redrafter_mlx.core.decode.shape import BeamShape
    from redrafter_mlx.core.decode.step import Decoding

    if row.loop == "lm_plain":
        return LmPlain(target, prompts[0])
    if row.loop == "lm_spec":
        return LmSpeculative(target, drafters["lm_draft"], prompts[0], NUM_DRAFT)
    if row.loop == "lm_batch":
        return LmBatch(target, prompts[:BATCH])
    drafter = drafters.get(row.drafter)
    decoder = build_decoder(target, drafter, plan=GENERIC_PLAN, max_context=4096)
    if row.drafter is None:
        decoding = Decoding(Mode.AUTOREGRESSIVE, BeamShape(1, 2), greedy)
    else:
        decoding = Decoding(Mode.REDRAFTER, BeamShape(row.W, row.L), greedy)
    if row.loop == "ours_batch":
        return OursBatch(decoder, prompts[:BATCH], decoding)
    return Ours(decoder, prompts[0], decoding)


def measure(row: Row, target, drafters: dict, prompts, *, warm: int, reps: int, counted: int):
    """``row``'s per-step medians: a timed pass of ``reps`` steps, then a counting pass of
    ``counted`` steps (kernels: it evaluates at every dispatch, so it is not timed)."""
    loop = stepper(row, target, drafters, prompts)
    tokens, contexts = [], []
    with Tracer() as timing:
        for _ in range(warm):  # traced too: a pipelined step reads what the one before sent
            timing.begin()
            loop.step()
            timing.end()
        del timing.steps[:]
        for _ in range(reps):
            contexts.append(list(loop.context))
            timing.begin()
            tokens.append(loop.step())
            timing.end()
    loop.step()  # the first counted step must not read a graph the timed pass dispatched
    mx.synchronize()
    with Tracer(count_kernels=True) as counting:
        for _ in range(counted):
            counting.begin()
            loop.step()
            counting.end()
    mx.synchronize()
    return timing.steps, counting.steps, tokens, contexts


def summary(row: Row, timed, counted, tokens, contexts, unit: Sizes, parts: dict) -> dict:
    """One row of the ledger (medians of the timed steps, means of the counted ones)."""

    def ms(field: str) -> float:
        return round(1e3 * statistics.median(getattr(s, field) for s in timed), 3)

    # the device waits for dispatch inside a blocking eval too (it has nothing queued yet)
    exposed = round(1e3 * statistics.median(s.exposed_s + s.dispatch_s for s in timed), 3)

    def mean(values) -> float:
        return round(statistics.fmean(values), 2)

    read = [step_bytes(vars(row), c, unit, parts) for c in contexts]
    return {
        "row": row.name,
        "loop": row.loop,
        "drafter": row.drafter,
        "W": row.W,
        "L": row.L,
        "wall_ms_here": ms("wall_s"),
        "exposed_ms": exposed,
        "dispatch_in_eval_ms": ms("dispatch_s"),
        "overlapped_ms": ms("overlapped_s"),
        "blocked_ms": ms("blocked_s"),
        "syncs": mean(s.syncs for s in timed),
        "kernels": mean(s.kernels for s in counted),
        "primitives": mean(s.primitives for s in counted),
        "fast_calls": mean(s.fast_calls for s in counted),
        "weight_mb": round(statistics.fmean(w for w, _ in read) / 1e6, 2),
        "kv_mb": round(statistics.fmean(k for _, k in read) / 1e6, 2),
        "context": round(statistics.fmean(sum(c) for c in contexts)),
        "tokens_per_step": mean(tokens),
        "steps_timed": len(timed),
        "steps_counted": len(counted),
    }


def predict(entry: dict, dispatch_us: float) -> dict:
    """Predicted tokens/s on each chip (a prediction, never a measurement)."""
    out = {}
    for chip, (bandwidth, _) in CHIPS.items():
        bytes_read = (entry["weight_mb"] + entry["kv_mb"]) * 1e6
        device_ms = 1e3 * bytes_read / (bandwidth * 1e9) + entry["kernels"] * dispatch_us / 1e3
        step_ms = entry["exposed_ms"] + max(entry["overlapped_ms"], device_ms)
        out[chip] = round(1e3 * entry["tokens_per_step"] / step_ms, 1)
    return out


def ledger(target, drafters: dict, prompts, rows=ROWS, *, warm=2, reps=6, counted=1, log=None):
    """Every row of ``rows`` on ``target`` (its drafters by key: rnn, eagle3, dflash,
    lm_draft), each with its predicted tokens/s per chip."""
    unit = sizes(target)
    parts = drafter_parts(target, drafters, drafters["lm_draft"], NUM_DRAFT)
    entries = []
    for row in rows:
        if row.drafter is not None and row.drafter not in drafters:
            continue
        timed, count, tokens, contexts = measure(
            row, target, drafters, prompts, warm=warm, reps=reps, counted=counted
        )
        entry = summary(row, timed, count, tokens, contexts, unit, parts)
        entries.append(entry)
        if log:
            log(json.dumps(entry))
    return entries


# -- the command


def load(precision: str):
    """The embedded target (``q8``/``q4``: quantized in place by mlx-lm's ``nn.quantize``,
    group 64), its shipped drafter, and prompts' token ids."""
    from field_drafters import random_drafters

    from redrafter_mlx.backend.plan import GENERIC_PLAN
    from redrafter_mlx.core.decode.llm import embedding
    from redrafter_mlx.core.drafters.beam_search import BeamDrafter
    from redrafter_mlx.io import runtime as rt
    from redrafter_mlx.io.prompts import load_prompts

    runtime = rt.load_runtime(None, None, need_drafter=True, plan=GENERIC_PLAN)
    target, bits = runtime.model, None if precision == "float" else int(precision[1:])
    rnn = runtime.drafter
    if bits:
        nn.quantize(target, group_size=64, bits=bits)
        mx.eval(target.parameters())
        # bound again, as loading a quantized folder binds it: the quantized embedding, and
        # head rows from the quantized head
        rnn.drafter.bind_target(target)
        rnn = BeamDrafter(rnn.drafter, embedding(target))
    stand_ins = random_drafters(target)
    drafters = {
        "rnn": rnn,
        "eagle3": stand_ins["eagle3"],
        "dflash": stand_ins["dflash"],
        "lm_draft": stand_in_draft(target, 4, bits),
    }
    texts = [turns[0] for turns in load_prompts(None, BATCH, 1)]
    prompts = [runtime.tokenizer.encode(t)[:128] for t in texts]
    return target, drafters, prompts


def table(report: dict) -> str:
    """The README's tables: the ledger per precision, then predicted tokens/s."""
    lines = [
        "| precision | step | exposed host ms | overlapped host ms | wall ms here "
        "| kernels (Metal est.) "
        "| primitives here | weights MB | K/V MB | syncs | tokens/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def label(precision: str) -> str:  # "float" as its dtype
        return (
            report.get("dtype", {}).get(precision, precision) if precision == "float" else precision
        )

    for precision, entries in report["ledger"].items():
        for e in entries:
            lines.append(
                f"| {label(precision)} | {e['row']} "
                f"| {e['exposed_ms']:.2f} | {e['overlapped_ms']:.2f} "
                f"| {e['wall_ms_here']:.1f} | {e['kernels']:.0f} | {e['primitives']:.0f} "
                f"| {e['weight_mb']:.1f} | {e['kv_mb']:.2f} | {e['syncs']:.1f} "
                f"| {e['tokens_per_step']:.2f} |"
            )
    chips = list(CHIPS)
    lines += [
        "",
        f"PREDICTED tokens/s (not measured; dispatch cost {report['dispatch_us']} us/kernel "
        "assumed):",
        "",
        "| precision | step | " + " | ".join(chips) + " |",
        "|---|---|" + "---|" * len(chips),
    ]
    for precision, entries in report["ledger"].items():
        for e in entries:
            values = " | ".join(f"{e['predicted_tokens_per_s'][c]:.0f}" for c in chips)
            lines.append(f"| {label(precision)} | {e['row']} | {values} |")
    return "\n".join(lines)


def as_float16(entry: dict) -> dict:
    """A float32 row as a Mac would run it: MLX on the CPU loads the embedded model in
    float32, on a GPU in float16 (``io.embedded.default_dtype``): the same steps reading half
    the bytes. Derived, not measured: host time, kernels and syncs are the float32 row's."""
    return {
        **entry,
        "weight_mb": round(entry["weight_mb"] / 2, 2),
        "kv_mb": round(entry["kv_mb"] / 2, 2),
        "derived_from": "float32 row, bytes halved",
    }


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def run(args, rows: list[Row]) -> dict:
    """Measure every precision's ledger -> the report (predictions not yet added)."""
    from redrafter_mlx.core.decode.llm import compute_dtype

    warm, reps, counted = (2, 2, 1) if args.quick else (3, 10, 2)
    report = {
        "command": " ".join(sys.argv),
        "device_here": str(mx.default_device()),
        "mlx": mx.__version__,
        "steps": {"warm": warm, "timed": reps, "counted": counted},
        "dtype": {},
        "ledger": {},
    }
    for precision in args.precisions:
        target, drafters, prompts = load(precision)
        report["dtype"][precision] = str(compute_dtype(target)).split(".")[-1]
        report["ledger"][precision] = ledger(
            target,
            drafters,
            prompts,
            rows,
            warm=warm,
            reps=reps,
            counted=counted,
            log=lambda line, p=precision: print(p, line, flush=True),
        )
    return report


def predicted(report: dict, dispatch_us: float) -> dict:
    """``report`` with the float16 rows derived (where float was float32) and every row's
    prediction at ``dispatch_us``."""
    if (
        report.get("dtype", {}).get("float") == "float32"
        and "f16 (derived)" not in report["ledger"]
    ):
        report["ledger"]["f16 (derived)"] = [as_float16(e) for e in report["ledger"]["float"]]
    report["dispatch_us"] = dispatch_us
    report["dispatch_us_source"] = "assumption (no public figure found)"
    report["bandwidth_gb_s"] = {c: {"gb_s": bw, "source": src} for c, (bw, src) in CHIPS.items()}
    for entries in report["ledger"].values():
        for e in entries:
            e["predicted_tokens_per_s"] = predict(e, dispatch_us)
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="2 warm-up, 2 timed and 1 counted step per row (default: 3, 10, 2)",
    )
    p.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    p.add_argument("--rows", nargs="*", help="only the rows whose name contains one of these")
    p.add_argument("--dispatch-us", type=float, default=DISPATCH_US)
    p.add_argument("--out", type=Path, required=True, help="JSON report")
    p.add_argument("--markdown", type=Path, help="also write the README tables here")
    p.add_argument("--table-from", type=Path, help="re-predict a report's rows: no measuring")
    args = p.parse_args()
    if args.table_from:
        report = json.loads(args.table_from.read_text())
    else:
        if os.environ.get("REDRAFTER_CPU_TUNING") != "0":
            p.error("the ledger measures the generic plan: run it with REDRAFTER_CPU_TUNING=0")
        rows = [r for r in ROWS if not args.rows or any(k in r.name for k in args.rows)]
        report = run(args, rows)
    report = predicted(report, args.dispatch_us)
    write_atomic(args.out, json.dumps(report, indent=2) + "\n")
    if args.markdown:
        write_atomic(args.markdown, table(report) + "\n")
    print(table(report))


if __name__ == "__main__":
    main()
