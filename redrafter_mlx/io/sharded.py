"""Load a target sharded over the ranks ``mlx.launch`` started, as mlx-lm's ``sharded_load``
does it: the model's own ``shard(group)`` (tensor parallel: each attention's heads and each
MLP's hidden units split, one all-sum per block) or its ``model.pipeline(group)`` (pipeline
parallel, ``PipelineMixin``: rank r runs a contiguous stage of layers, rank 0 the last), applied
to the lazily loaded model before its weights are read, so each rank reads only its share.

The drafter and everything else are whole on every rank. The verify forward is the generic
one (``core/decode/llm.py``'s ``Forward`` runs the model's own sharded layers and pipeline); the CPU
plan's fused Llama forward knows nothing of sharded layers and is not used.
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn

from redrafter_mlx.backend.plan import plan_for
from redrafter_mlx.core.errors import ConfigError, ReDrafterError
from redrafter_mlx.core.serving.distributed import LeadDecoder, Orders, meet
from redrafter_mlx.io import runtime as rt

SHARDINGS = ("tensor", "pipeline")


def supported(model: nn.Module) -> tuple[str, ...]:
    """The shardings mlx-lm implements for ``model``'s family (as ``sharded_load`` asks)."""
    found = []
    if hasattr(model, "shard"):
        found.append("tensor")
    if hasattr(getattr(model, "model", None), "pipeline"):
        found.append("pipeline")
    return tuple(found)


def shard(model: nn.Module, kind: str, group: mx.distributed.Group) -> None:
    """Split ``model`` (lazily loaded, weights not read yet) over ``group`` in place."""
    if kind not in supported(model):
        family = getattr(model, "model_type", type(model).__module__.rsplit(".", 1)[-1])
        offers = ", ".join(supported(model)) or "none"
        raise ConfigError(
            f"--shard {kind}: mlx-lm's {family} models cannot be split that way "
            f"(they support: {offers})"
        )
    if kind == "tensor":
        _check_divides(model, group.size())
        model.shard(group)
    else:
        if group.size() > len(model.model.layers):
            raise ConfigError(
                f"--shard pipeline: {group.size()} ranks for {len(model.model.layers)} layers"
            )
        model.model.pipeline(group)
        _keep_own_layers(model.model)


def _keep_own_layers(inner: nn.Module) -> None:
    """A pipeline stage's model holds its own layers only (``pipeline`` leaves the earlier
    stages' as None to keep checkpoint names; the weights are attached already): the verify
    forward gives each of them a cache, and mlx-lm's stage ties its send to the last one."""
    inner.layers = inner.pipeline_layers
    inner.start_idx, inner.end_idx = 0, len(inner.layers)


def _check_divides(model: nn.Module, ranks: int) -> None:
    """Tensor parallelism splits each layer's heads: their counts must divide by the ranks."""
    args = getattr(model, "args", None)
    for name in ("num_attention_heads", "num_key_value_heads"):
        count = getattr(args, name, None)
        if count and count % ranks:
            raise ConfigError(f"--shard tensor: {name} {count} does not split over {ranks} ranks")


def load_runtime(
    model: str | None, drafter: str | None, kind: str, *, need_drafter: bool
) -> tuple[rt.Runtime, Orders]:
    """Load on every rank: the target sharded (``kind``), the drafter whole. Every rank meets
    after loading (a rank that failed raises its error naming itself, the others
    :class:`PeerFailed`). Rank 0's decoder sends the orders the others :func:`follow`."""
    if kind not in SHARDINGS:
        raise ConfigError(f"--shard {kind}: choose one of {', '.join(SHARDINGS)}")
    group = mx.distributed.init()
    plan = replace(plan_for(), llama_layers=False)  # the generic forward: sharded layers
    runtime, error = None, None
    try:
        runtime = rt.load_runtime(
            model,
            drafter,
            need_drafter=need_drafter,
            prepare=lambda m: shard(m, kind, group),
            plan=plan,
        )
    except ReDrafterError as e:
        error = e
    meet(group, error)
    orders = Orders(group)
    if orders.lead and orders.size > 1:
        runtime.decoder = LeadDecoder.over(runtime.decoder, orders)
    return runtime, orders
