"""The CPU backend's plan (:class:`redrafter_mlx.core.decode.plan.Plan`), chosen by measurement on
2-core x86-64 machines with OpenBLAS (benchmarks/README.md and benchmarks/HISTORY.md)."""

from __future__ import annotations

from redrafter_mlx.core.decode.plan import Plan
from redrafter_mlx.core.decode.shape import BeamShape

# Why each field: 2-3-row projections cost less transposed; RoPE angles per call cost more
# than one shared table; grouped matmuls (and our kernels) beat SDPA's CPU fallback;
# evaluating every 2 layers overlaps graph building; padding a tree to the next listed size
# reuses compiled blocks. A drafter pass costs more than a host read here (early stop), and
# MLX's CPU float16 matmuls are slow (a float32 drafter). Past ``plain_from`` cached tokens a
# tree's attention may cost more than it saves: the adaptive rule (core/decode/adaptive.py) keeps
# whichever of the tree and plain steps measures faster. A batch's products turn
# compute-bound past a few rows, so a batch verifies at most ``batch_rows`` rows. The field's
# drafter types take the RNN's shape (their steps cost as its do, tree size for tree size), but
# DFlash (and DSpark, its block forward): a step of its 8-node best-first tree cost about what a
# 4-node one did, so it drafts 7 nodes (benchmarks/HISTORY.md, "Field drafters").
CPU_PLAN = Plan(
    llama_layers=True,
    transposed_rows=(2, 3),
    rope_tables=True,
    grouped_attention=True,
    cpu_kernels=True,
    async_layers=2,
    tree_sizes=(*range(1, 9), 16, 32),
    prefill_chunk=512,
    batch_rows=4,
    draft_early_stop=True,
    drafter_float32=True,
    default_shape=BeamShape(width=1, length=2, lookup=1),
    type_shapes=tuple((kind, BeamShape(width=7, length=5)) for kind in ("dflash", "dspark")),
    plain_from=1536,
)
