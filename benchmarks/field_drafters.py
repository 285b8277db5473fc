"""Field drafters (EAGLE-3, DFlash) beside ReDrafter's RNN: what a step costs, and what a
best-first tree gains over a chain.

``cost``: on the embedded SmolLM2-135M as a stand-in target (float32, the device's plan), the
seconds of one speculative step of each drafter type at the tree sizes it verifies, against a
one-token step (interleaved medians, the sequence restored after each step). The RNN is the
shipped drafter; EAGLE-3 and DFlash have random weights in their published shapes (EAGLE-3:
one decoder layer, a 32000-token draft vocabulary; DFlash: 3 layers, block 8; a Qwen3.5-style
MTP head: one gated-attention layer): their cost, not their acceptance, is what this measures.

``oracle``: accepted drafts per step of a best-first tree (DDTree's Algorithm 1,
``core/drafters/dflash.py: best_first``) against a chain of the same node count, when the
per-position marginals are the embedded target's own distributions along its greedy continuation
(an oracle DFlash), blurred by Gumbel noise of scale ``sigma`` on the log-probs to a drafter's
accuracy.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        .venv/bin/python benchmarks/field_drafters.py cost --out benchmarks/results/field_cost.json
    .venv/bin/python benchmarks/field_drafters.py oracle --out benchmarks/results/field_oracle.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.qwen3_5 import TextModelArgs

from redrafter_mlx.backend.plan import build_decoder
from redrafter_mlx.core.decode.accept import greedy, log_softmax
from redrafter_mlx.core.decode.llm import embedding, head_linear, inner_model
from redrafter_mlx.core.decode.mode import Mode
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.decode.step import Decoding
from redrafter_mlx.core.drafters.dflash import DFlash, DFlashArgs, DFlashDrafter, best_first
from redrafter_mlx.core.drafters.eagle3 import Eagle3, Eagle3Args, Eagle3Drafter
from redrafter_mlx.core.drafters.mtp import MTPDrafter, MTPHead
from redrafter_mlx.io import runtime as rt
from redrafter_mlx.io.prompts import load_prompts
from redrafter_mlx.tuning.measure import environment

SHAPES = {  # (W, L): for DFlash W is the tree's node count
    "rnn": [(1, 2), (1, 4), (2, 4), (4, 4)],
    "eagle3": [(1, 2), (1, 4), (2, 4), (4, 4)],
    "dflash": [(1, 2), (3, 4), (7, 5), (15, 8)],
    "mtp": [(1, 2), (1, 4), (2, 4), (4, 4)],
}


def random_drafters(target) -> dict:
    hidden, heads, kv = 576, 9, 3
    eagle = Eagle3(
        Eagle3Args(
            hidden_size=hidden,
            intermediate_size=1536,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            vocab_size=49152,
            draft_vocab_size=32000,
            target_hidden_size=hidden,
            target_layer_ids=[2, 15, 27],
        )
    )
    eagle.embed_tokens = embedding(target)
    dflash = DFlash(
        DFlashArgs(
            hidden_size=hidden,
            intermediate_size=1536,
            num_hidden_layers=3,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            head_dim=64,
            vocab_size=49152,
            mask_token_id=0,
            target_layer_ids=[1, 14, 26],
            block_size=8,
        )
    )
    dflash.bind(embedding(target), lambda h: head_linear(target, h))
    mtp_args = TextModelArgs(
        hidden_size=hidden,
        intermediate_size=1536,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=64,
        vocab_size=49152,
    )
    mtp = MTPHead(mtp_args)
    inner = inner_model(target)
    mtp.bind(embedding(target), inner.norm, lambda h: head_linear(target, h))
    mx.eval(eagle.parameters(), dflash.parameters(), mtp.parameters())
    return {
        "eagle3": Eagle3Drafter(eagle),
        "dflash": DFlashDrafter(dflash),
        "mtp": MTPDrafter(mtp, len(inner.layers) - 1),
    }


def step_cost(decoder, prompt: list[int], shape: BeamShape, reps: int) -> dict:
    """Median seconds of a speculative step and of a one-token step after ``prompt``."""
    decoding = Decoding(Mode.REDRAFTER, shape, greedy)
    decoder.warm_up(decoding)
    sequence = decoder.new_sequence()
    state, _ = decoder.prefill(sequence, prompt, decoding)
    mark = sequence.mark()
    token = mx.array([sequence.last_id])
    times: dict[str, list[float]] = {"step": [], "one": []}
    size = 0
    for rep in range(reps + 1):
        tic = time.perf_counter()
        _, step = decoder.step(state)
        sequence.restore(mark)
        if rep:
            times["step"].append(time.perf_counter() - tic)
        size = step.tree_size
        tic = time.perf_counter()
        choice, _, _ = decoder.next_token(sequence, token, greedy)
        np.array(choice)  # host read: a step ends with its token on the host
        if rep:
            times["one"].append(time.perf_counter() - tic)
    step_s, one_s = (statistics.median(times[k]) for k in ("step", "one"))
    return {"tree_size": size, "step_s": step_s, "one_token_s": one_s, "ratio": step_s / one_s}


def cost(args) -> dict:
    runtime = rt.load_runtime(None, None, need_drafter=True)
    target, plan = runtime.model, runtime.decoder.plan
    drafters = {"rnn": runtime.drafter, **random_drafters(target)}
    prompt = runtime.tokenizer.encode(load_prompts(None, 1, 1)[0][0])[:128]
    rows = []
    for kind, drafter in drafters.items():
        if args.kinds and kind not in args.kinds:
            continue
        decoder = build_decoder(target, drafter, plan=plan, max_context=4096)
        for width, length in SHAPES[kind]:
            row = {"drafter": kind, "W": width, "L": length}
            row |= step_cost(decoder, prompt, BeamShape(width, length), args.repetitions)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return {"environment": environment(runtime), "prompt_tokens": len(prompt), "rows": rows}


def accepted_in_tree(beams: np.ndarray, truth: np.ndarray) -> int:
    """Drafts accepted from ``beams (W, 1 + d)`` when the target's tokens are ``truth (d,)``."""
    drafted = beams[:, 1:]
    agree = np.cumprod(drafted == truth[None, : drafted.shape[1]], axis=1)
    return int(agree.sum(axis=1).max())


def oracle(args) -> dict:
    runtime = rt.load_runtime(None, None, need_drafter=False)
    model, tokenizer = runtime.model, runtime.tokenizer
    rng = np.random.default_rng(0)
    results: dict = {}
    prompts = [turns[0] for turns in load_prompts(None, args.prompts, 1)]
    continuations = []
    for text in prompts:
        ids = tokenizer.encode(text)
        for _ in range(args.tokens):  # the target's greedy continuation
            ids.append(int(mx.argmax(model(mx.array([ids]))[0, -1])))
        logits = model(mx.array([ids]))[0].astype(mx.float32)
        continuations.append((np.array(ids), np.array(log_softmax(logits)), len(ids) - args.tokens))
    for sigma in args.sigmas:
        for nodes in args.nodes:
            chain, tree, top1 = [], [], []
            for ids, logp, start in continuations:
                for t in range(start, len(ids) - nodes - 1):
                    # marginals for depths 1..nodes after the pending token ids[t]
                    marg = logp[t : t + nodes] + sigma * rng.gumbel(size=logp[t : t + nodes].shape)
                    marg = marg - np.logaddexp.reduce(marg, axis=1, keepdims=True)
                    truth = ids[t + 1 : t + 1 + nodes]
                    top1.append(marg[0].argmax() == truth[0])
                    chain_beam = np.concatenate([[ids[t]], marg.argmax(1)])[None]
                    chain.append(accepted_in_tree(chain_beam, truth))
                    beams, _ = best_first(mx.array(marg), mx.array(int(ids[t])), nodes)
                    tree.append(accepted_in_tree(np.array(beams), truth))
            row = {
                "sigma": sigma,
                "nodes": nodes,
                "depth1_top1": float(np.mean(top1)),
                "chain_accepted": float(np.mean(chain)),
                "tree_accepted": float(np.mean(tree)),
                "positions": len(chain),
            }
            print(json.dumps(row), flush=True)
            results.setdefault("rows", []).append(row)
    return {"environment": environment(runtime), "tokens": args.tokens, **results}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["cost", "oracle"])
    p.add_argument("--repetitions", type=int, default=9)
    p.add_argument("--kinds", nargs="*", help="cost: only these (rnn eagle3 dflash mtp)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64, help="greedy continuation per prompt")
    p.add_argument("--sigmas", type=float, nargs="+", default=[0.0, 1.0, 2.0])
    p.add_argument("--nodes", type=int, nargs="+", default=[3, 7, 15])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    report = cost(args) if args.what == "cost" else oracle(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
