"""The plan each device runs (:class:`redrafter_mlx.core.plan.Plan`): one place for what the
CPU backend does differently; every other device runs the generic plan.

``REDRAFTER_CPU_TUNING=0`` runs the generic plan on the CPU too: the code path Metal and CUDA
execute, testable on a machine without a GPU.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from redrafter_mlx.backend.fused import FusedForward, has_llama_layers
from redrafter_mlx.backend.switches import cpu_tuning_enabled
from redrafter_mlx.core.decode import Decoder
from redrafter_mlx.core.draft import BeamDrafter
from redrafter_mlx.core.llm import Forward
from redrafter_mlx.core.plan import Plan
from redrafter_mlx.core.shape import BeamShape

# Each choice was measured on a 2-core x86 CPU with OpenBLAS (benchmarks/README.md: "verify
# forward", "verify cost"): 2-3-row projections cost less transposed; RoPE angles per call
# cost ~40 us each; grouped matmuls beat SDPA's CPU fallback; evaluating every 2 layers
# overlaps graph building; a 16-row verify costs less than a 9..15-row one; W1 L2 with one
# prompt-lookup beam is the fastest shape autotune found here (on its held-out prompts, run
# 67). A drafter pass costs more than a host read here, so a floored search stops early;
# MLX's CPU float16 matmuls are slow, so the drafter stays float32. At long contexts that
# shape's 3-node tree costs 1.5-2x a one-token step while summaries got 1.5-1.9 tokens/step:
# it ran 0.74-1.28x plain decoding at 2K, 0.79-1.07x at 4K, 0.80-0.87x at 8K (runs 82-84, 88)
# and, on a quiet machine, 1.00-1.08x at 1K and 0.95-1.07x at 1.5K (1.20-1.30x at 0.5K; runs
# 94 and 105): level from 1K, so without a profile answers decode plainly from 1,536 tokens on,
# but for the blocks of steps a session measures the tree faster (at 2K it ran 1.38x at 1.80
# tokens/step, at 4K and 8K 0.82x and 0.77x at 1.62-1.66: run 117). Since the attention kernels
# and in-place compaction (runs 123-126) the tree alone ran 1.42x / 1.17x / 1.08x plain decoding
# at 2K / 4K / 8K, and with threads kept and AVX2's own kernel width the default 1.39x / 1.16x /
# 1.47x on an AVX2 machine (run 134); past plain_from the adaptive rule keeps whichever
# measures faster.
# A batch's products turn compute-bound past a few rows here: 2 members' trees emit as many
# tokens per second as their plain steps, while 4 members' 2-node trees (8 rows) emit 0.8x
# what their roots alone do (run 107), so a batch verifies at most 4 rows.
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
    plain_from=1536,
)
GENERIC_PLAN = Plan()


def plan_for(device: mx.Device | None = None) -> Plan:
    """The plan for ``device`` (default: where MLX runs now)."""
    device = mx.default_device() if device is None else device
    if device == mx.cpu and cpu_tuning_enabled():
        return CPU_PLAN
    return GENERIC_PLAN


def make_forward(model: nn.Module, plan: Plan = GENERIC_PLAN) -> Forward:
    """The target's verify forward as ``plan`` runs it, over a copy of ``model`` (``model``
    itself is left as it was): the fused Llama forward where the plan asks for it and every
    layer is a plain Llama/Qwen2 block, else the generic one."""
    if plan.llama_layers and has_llama_layers(model):
        return FusedForward(model, plan)
    return Forward(model)


def build_decoder(
    model: nn.Module,
    drafter: BeamDrafter | None = None,
    *,
    plan: Plan | None = None,
    max_context: int | None = None,
) -> Decoder:
    """The :class:`Decoder` of ``model`` (and ``drafter``) with ``plan`` (default: the plan
    for where MLX runs now), built once: its forward is prepared and compiled here."""
    plan = plan_for() if plan is None else plan
    return Decoder(make_forward(model, plan), drafter, plan, max_context)
