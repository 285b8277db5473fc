"""Replay greedy decoding along held-out paths to compare whole trees with pruned ones.

No target pass: the held-out shard of a self-distillation cache (``train --source self``) holds
the target's own greedy answers with every hidden state, so each step's drafts can be scored
against the known continuation. A step's cost is the measured verify cost of its (padded) tree
plus a per-depth drafting cost, both relative to a one-token target forward, so the result
is a modelled speedup over autoregressive decoding, used to choose floors without touching
MT-Bench; ``redrafter-mlx bench`` measures the real thing.

  python benchmarks/prune_replay.py --cache runs/cache-self2 --positions 4000 \\
      --out benchmarks/results/prune_replay_v2.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from redrafter_mlx.backend.plan import CPU_PLAN
from redrafter_mlx.core.decode.tree import pack_beams, prune, verified_size
from redrafter_mlx.core.drafters.redrafter import load_drafter
from redrafter_mlx.io.embedded import default_drafter_path, default_model_path
from redrafter_mlx.io.load import load_target
from redrafter_mlx.training.evaluate import beams_everywhere

HERE = Path(__file__).resolve().parent
CPU_TREE_SIZES = CPU_PLAN.tree_sizes  # the verify sizes the CPU backend pads trees to


def drafted(found, t: int, length: int, floor: float, early: bool):
    """The search a step at position ``t`` runs: ``(beams (W, L), logprobs (W, L - 1), depths)``.
    With early stopping it ends after the first depth whose best beam scores below ``floor``
    and pads the rest with token -1 / log-prob -inf, like ``BeamDrafter``."""
    depths = length - 1
    if floor and early:
        for d in range(1, length - 1):
            if found[d - 1][1][t].sum(axis=1).max() < np.log(floor):
                depths = d
                break
    beams, logprobs = found[depths - 1][0][t], found[depths - 1][1][t]
    pad = length - 1 - depths
    beams = np.pad(beams, ((0, 0), (0, pad)), constant_values=-1)
    logprobs = np.pad(logprobs, ((0, 0), (0, pad)), constant_values=-np.inf)
    return beams, logprobs, depths


def one_step(beams, logprobs, path, floor: float) -> tuple[int, int]:
    """-> (accepted drafted tokens, verified rows) for one step along the known ``path``."""
    tree = pack_beams(beams)
    if floor:
        tree = prune(tree, logprobs, floor, CPU_TREE_SIZES)
    kept = tree.unpack >= 0
    accepted = 0
    for w in range(beams.shape[0]):
        match = (beams[w, 1:] == path[1:]) & kept[w, 1:]
        accepted = max(accepted, int(np.cumprod(match).sum()))
    return accepted, verified_size(tree.size, CPU_TREE_SIZES)


def replay(docs, ids, per_doc, length, floor, early, cost, draft_cost) -> dict:
    tokens = steps = 0
    seconds = 0.0
    for rows, found in zip(docs, per_doc, strict=True):
        seq = ids[rows]
        t = 0
        while t < len(rows) - 1:
            path = np.full(length, -2)  # past the end of the answer: matches nothing
            path[: min(length, len(rows) - t)] = seq[t : t + length]
            beams, logprobs, depths = drafted(found, t, length, floor, early)
            accepted, rows_verified = one_step(beams, logprobs, path, floor)
            tokens += accepted + 1
            steps += 1
            seconds += cost(rows_verified) + draft_cost * depths
            t += accepted + 1
    return {"tokens_per_step": tokens / steps, "modelled_speedup_vs_ar": tokens / seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--drafter", default=None)
    p.add_argument("--cache", required=True, help="self-distillation cache with a held-out shard")
    p.add_argument("--positions", type=int, default=4000, help="held-out answer tokens to use")
    p.add_argument("--widths", default="1,2")
    p.add_argument("--lengths", default="2,3,4,5,6")
    p.add_argument("--floors", default="0,0.2,0.3,0.4")
    p.add_argument("--verify-cost", default=str(HERE / "results" / "verify_cost_sizes.json"))
    p.add_argument("--draft-cost", type=float, default=0.045, help="per depth, x one forward")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    ratios = json.loads(Path(args.verify_cost).read_text())["ratio"]
    table = {1: 1.0, **{int(k): v for k, v in ratios.items()}}
    cost = lambda t: table.get(t) or np.interp(t, sorted(table), [table[k] for k in sorted(table)])

    model, _, _ = load_target(args.model or str(default_model_path()))
    drafter = load_drafter(args.drafter or default_drafter_path(), model)
    cache = Path(args.cache)
    manifest = json.loads((cache / "manifest.json").read_text())
    shard = next(s["file"] for s in manifest["shards"] if s["split"] == "heldout")
    data = np.load(cache / shard)
    ids, hidden, mask, doc = data["tokens"], data["hidden"], data["mask"], data["doc"]
    docs, total = [], 0
    for d in np.unique(doc):
        rows = np.nonzero((doc == d) & mask)[0]
        if len(rows) >= 8 and total < args.positions:
            docs.append(rows)
            total += len(rows)
    widths = [int(x) for x in args.widths.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]
    floors = [float(x) for x in args.floors.split(",")]
    results = []
    for width in widths:
        per_doc = [
            beams_everywhere(
                drafter,
                model.model.embed_tokens,
                mx.array(hidden[rows - 1].astype(np.float32)),
                mx.array(ids[rows]),
                width,
                max(lengths) - 1,
            )
            for rows in docs
        ]
        for length in lengths:
            for floor in floors:
                for early in [False, True] if floor else [False]:
                    row = {"width": width, "length": length, "min_prob": floor, "early": early}
                    row |= replay(docs, ids, per_doc, length, floor, early, cost, args.draft_cost)
                    results.append(row)
                    print(json.dumps(row), flush=True)
    report = {
        "drafter": str(args.drafter or default_drafter_path()),
        "held_out_tokens": total,
        "documents": len(docs),
        "draft_cost_per_depth": args.draft_cost,
        "verify_cost": args.verify_cost,
        "results": results,
    }
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
