"""A loaded target and drafter (:class:`Runtime`) with the decoder built from them once, and
the :class:`Decoding` (mode, shape, sampler) a command asks of it.

Library code: failures raise :mod:`redrafter_mlx.core.errors` exceptions with one-line messages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.nn as nn

from redrafter_mlx.backend.plan import build_decoder, plan_for
from redrafter_mlx.core.atomic import os_error_text
from redrafter_mlx.core.decode.accept import make_sampler
from redrafter_mlx.core.decode.decoder import Decoder
from redrafter_mlx.core.decode.llm import compute_dtype
from redrafter_mlx.core.decode.mode import Mode
from redrafter_mlx.core.decode.plan import Plan
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.decode.source import Source
from redrafter_mlx.core.decode.step import Decoding
from redrafter_mlx.core.errors import ConfigError, LoadError, ReDrafterError
from redrafter_mlx.io import catalogue
from redrafter_mlx.io.drafters import DrafterChoice, find_drafter
from redrafter_mlx.io.embedded import default_model_path
from redrafter_mlx.io.field_drafters import KIND_NAMES, REDRAFTER, create_drafter
from redrafter_mlx.io.load import load_target
from redrafter_mlx.io.templates import apply_chat_template


@dataclass
class Runtime:
    """What a command loaded: the target (``model``, as the decoder runs it: a prepared copy
    of the loaded model, which mlx-lm's own generation runs as it is), its tokenizer and
    config, the drafter (or None), and the :class:`Decoder` built once from them with the
    device ``plan`` chosen at load time."""

    model: nn.Module
    tokenizer: object
    config: dict
    drafter: Source | None
    model_id: str
    drafter_id: str | None
    decoder: Decoder
    drafter_choice: DrafterChoice | None = None  # which drafter and why (io/drafters.py)

    @property
    def max_context(self) -> int | None:
        return self.config.get("max_position_embeddings")

    @property
    def plan(self) -> Plan:
        return self.decoder.plan

    @property
    def default_shape(self) -> BeamShape:
        """The beam shape when no profile or flag gives one: the plan's for the drafter's type."""
        return self.plan.shape_for(self.drafter)

    def mode(self, shape: BeamShape, *, autoregressive: bool = False) -> Mode:
        """The decoding mode of a run at ``shape`` (:meth:`Mode.choose`)."""
        return Mode.choose(
            drafter=self.drafter is not None, shape=shape, autoregressive=autoregressive
        )


def load_runtime(
    model: str | None,
    drafter: str | None,
    *,
    need_drafter: bool,
    prepare: Callable[[nn.Module], None] | None = None,
    plan: Plan | None = None,
) -> Runtime:
    """Load the target (embedded default when None) and its drafter (found by
    :func:`find_drafter` when None), evaluated and checked against each other. ``prepare``
    changes the target before its weights are read (a sharded load); ``plan``: the device's
    unless given."""
    for flag, value in (("--model", model), ("--drafter", drafter)):
        if value is not None and not value.strip():
            raise ConfigError(f"{flag}: an empty path (leave the flag out for the default)")
    plan = plan or plan_for()  # chosen once: every command takes it from the runtime
    try:
        model_path = model or str(default_model_path())
        target, tokenizer, config = load_target(model_path, prepare=prepare)
        choice = _choose_drafter(drafter, str(model_path), target, config, tokenizer)
        drafter_path = choice.path
        loaded = None
        if drafter_path is not None:
            dtype = None if plan.drafter_float32 else compute_dtype(target)
            loaded, choice = _load_any_drafter(drafter_path, target, dtype, choice)
    except ReDrafterError:
        raise
    except (ValueError, OSError) as e:  # e.g. an unreadable file: one line, no traceback
        raise LoadError(os_error_text(e) if isinstance(e, OSError) else str(e)) from None
    if need_drafter and loaded is None:
        why = "; ".join([choice.reason, *(f"skipped {x}" for x in choice.skipped)])
        raise ConfigError(
            f"no drafter for this model ({why}): pass --drafter DIR or USER/NAME, "
            "--lookup K for lookup beams only, or make one with `redrafter-mlx train`"
        )
    max_context = config.get("max_position_embeddings")
    decoder = build_decoder(target, loaded, plan=plan, max_context=max_context)
    return Runtime(
        decoder.model,  # the loaded model is dropped: the decoder's copy shares its weights
        tokenizer,
        config,
        loaded,
        str(model_path),
        None if drafter_path is None else str(drafter_path),
        decoder,
        choice,
    )


def _choose_drafter(given: str | None, model: str, target, config: dict, tokenizer):
    """:func:`find_drafter`'s choice; with ``--drafter auto``, the catalogue's drafter for the
    model (io/catalogue.py), discovery's when it has none; without ``--drafter`` and none
    found, discovery's reason names the catalogue's drafter, if it lists one (no download)."""

    def discover(given=None):
        return find_drafter(given, model=model, target=target, config=config, tokenizer=tokenizer)

    if given is not None and given.strip().lower() == catalogue.AUTO:
        return catalogue.auto_drafter(model, config, target, discover=discover)
    choice = discover(given)
    if given is None and choice.path is None and (known := catalogue.hint(model, config)):
        return dataclasses.replace(choice, reason=f"{choice.reason}; {known}")
    return choice


def _load_any_drafter(path, target, dtype, choice: DrafterChoice):
    """The drafter in ``path`` by the type its config names (io/field_drafters.py), and the
    choice's reason with that type said first for a type other than ReDrafter's."""
    drafter = create_drafter(path, target, dtype)
    if drafter.kind != REDRAFTER:
        reason = f"type {KIND_NAMES[drafter.kind]}; {choice.reason}"
        return drafter, dataclasses.replace(choice, reason=reason)
    return drafter, choice


def decoding(
    runtime: Runtime,
    shape: BeamShape,
    *,
    temp: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    mode: Mode | None = None,
) -> Decoding:
    """What a run at ``shape`` with this sampler decodes with (``mode``: the runtime's
    :meth:`Runtime.mode` unless given); ConfigError for a sampler or shape the model or
    drafter cannot run."""
    vocab = runtime.config.get("vocab_size")
    if top_k and vocab and top_k >= vocab:
        raise ConfigError(f"--top-k {top_k}: the vocabulary has {vocab} tokens (0 turns top-k off)")
    mode = runtime.mode(shape) if mode is None else mode
    result = Decoding(mode, shape, make_sampler(temp, top_p=top_p, top_k=top_k))
    try:
        runtime.decoder.check(result)
    except ValueError as e:
        raise ConfigError(f"{shape.describe()}: {e}") from None
    return result


def encode_chat(
    runtime: Runtime, messages: list[dict], tools: list[dict] | None = None
) -> list[int]:
    """Token ids of a conversation with the model's chat template and a generation prompt;
    ``tools`` (OpenAI's function format) listed by the template."""
    return apply_chat_template(
        runtime.tokenizer, messages, model_path=Path(runtime.model_id), tools=tools
    )
