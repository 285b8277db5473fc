"""The plan each device runs (:class:`redrafter_mlx.core.plan.Plan`): one place for what the
CPU backend does differently; every other device runs the generic plan.

``REDRAFTER_CPU_TUNING=0`` runs the generic plan on the CPU too: the code path Metal and CUDA
execute, testable on a machine without a GPU.
"""

from __future__ import annotations

import mlx.core as mx

from redrafter_mlx.backend.switches import cpu_tuning_enabled
from redrafter_mlx.core.plan import Plan
from redrafter_mlx.core.shape import BeamShape

# Each choice was measured on a 2-core x86 CPU with OpenBLAS (benchmarks/README.md: "verify
# forward", "verify cost"): 2-3-row projections cost less transposed; RoPE angles per call
# cost ~40 us each; grouped matmuls beat SDPA's CPU fallback; evaluating every 2 layers
# overlaps graph building; a 16-row verify costs less than a 9..15-row one; W1 L2 with one
# prompt-lookup beam is the fastest shape autotune found here (on its held-out prompts, run
# 67). A drafter pass costs more than a host read here, so a floored search stops early;
# MLX's CPU float16 matmuls are slow, so the drafter stays float32.
CPU_PLAN = Plan(
    llama_layers=True,
    transposed_rows=(2, 3),
    rope_tables=True,
    grouped_attention=True,
    async_layers=2,
    tree_sizes=(*range(1, 9), 16, 32),
    prefill_chunk=512,
    draft_early_stop=True,
    drafter_float32=True,
    default_shape=BeamShape(width=1, length=2, lookup=1),
)
GENERIC_PLAN = Plan()


def default_shape() -> BeamShape:
    """The beam shape where no autotune profile or flag gives one, for where MLX runs now."""
    return plan_for().default_shape


def plan_for(device: mx.Device | None = None) -> Plan:
    """The plan for ``device`` (default: where MLX runs now)."""
    device = mx.default_device() if device is None else device
    if device == mx.cpu and cpu_tuning_enabled():
        return CPU_PLAN
    return GENERIC_PLAN
