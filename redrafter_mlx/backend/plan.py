"""The plan each device runs (:class:`redrafter_mlx.core.decode.plan.Plan`): the CPU backend runs
:data:`~redrafter_mlx.backend.cpu.plan.CPU_PLAN` (the ``cpu`` package, behind its one switch);
every other device, Metal and CUDA, runs the generic plan.

``REDRAFTER_CPU_TUNING=0`` runs the generic plan on the CPU too: the code path Metal and CUDA
execute, testable on a machine without a GPU.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from redrafter_mlx.backend import cpu
from redrafter_mlx.backend.cpu import blas
from redrafter_mlx.backend.cpu.fused import FusedForward, has_llama_layers
from redrafter_mlx.backend.cpu.plan import CPU_PLAN
from redrafter_mlx.core.decode.decoder import Decoder
from redrafter_mlx.core.decode.llm import Forward
from redrafter_mlx.core.decode.plan import Plan
from redrafter_mlx.core.decode.source import Source

GENERIC_PLAN = Plan()


def plan_for(device: mx.Device | None = None) -> Plan:
    """The plan for ``device`` (default: where MLX runs now)."""
    device = mx.default_device() if device is None else device
    if device == mx.cpu and cpu.enabled():
        return CPU_PLAN
    return GENERIC_PLAN


def make_forward(model: nn.Module, plan: Plan = GENERIC_PLAN) -> Forward:
    """The target's verify forward as ``plan`` runs it, over a copy of ``model`` (``model``
    itself is left as it was): the fused Llama forward where the plan asks for it and every
    layer is a plain Llama/Qwen2 block, else the generic one."""
    if plan.llama_layers and has_llama_layers(model):
        return FusedForward(model, plan)
    return Forward(model, dispatch_every=plan.async_layers)


def build_decoder(
    model: nn.Module,
    drafter: Source | None = None,
    *,
    plan: Plan | None = None,
    max_context: int | None = None,
) -> Decoder:
    """The :class:`Decoder` of ``model`` (and ``drafter``) with ``plan`` (default: the plan
    for where MLX runs now), built once: its forward is prepared and compiled here."""
    plan = plan_for() if plan is None else plan
    if plan.cpu_kernels:  # native code is built with a decoder, never at import
        blas.prepare()
    return Decoder(make_forward(model, plan), drafter, plan, max_context)
