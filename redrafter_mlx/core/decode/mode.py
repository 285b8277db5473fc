"""How a generation decodes: ReDrafter (drafter beams, plus lookup beams when the shape has
them), lookup beams alone (no drafter), or autoregressive. Worked out once, here, from what is
loaded and asked for; every command and the library take it from :meth:`Mode.choose`."""

from __future__ import annotations

from enum import Enum

from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.errors import ConfigError


class Mode(str, Enum):
    REDRAFTER = "redrafter"
    LOOKUP = "lookup"  # lookup beams alone: the ReDrafter loop without a drafter
    AUTOREGRESSIVE = "autoregressive"

    @classmethod
    def choose(
        cls,
        *,
        drafter: bool,
        shape: BeamShape,
        autoregressive: bool = False,
        plain_fallback: bool = False,
    ) -> Mode:
        """The mode for a run with (or without) a ``drafter`` at ``shape``. When nothing would
        speculate and plain decoding was not asked for: autoregressive with
        ``plain_fallback`` (the Python API, as mlx-lm without a draft model), else
        ConfigError."""
        if autoregressive:
            return cls.AUTOREGRESSIVE
        if drafter:
            return cls.REDRAFTER
        if shape.lookup:
            return cls.LOOKUP
        if plain_fallback:
            return cls.AUTOREGRESSIVE
        raise ConfigError(
            "no drafter for this model: pass --drafter DIR (make one with `redrafter-mlx "
            "train`), --lookup K for prompt-lookup beams alone, or --autoregressive"
        )

    @property
    def drafted(self) -> bool:
        """Whether steps draft beams with the drafter."""
        return self is Mode.REDRAFTER

    @property
    def speculative(self) -> bool:
        """Whether steps verify a tree of beams (else one token per step)."""
        return self is not Mode.AUTOREGRESSIVE

    def describe(self, shape: BeamShape | None = None, drafter: str = "ReDrafter") -> str:
        """``ReDrafter W=1 L=2 lookup 1`` (``drafter``: the drafter type's name, e.g.
        ``EAGLE-3 W=4 L=4``), ``lookup only L=2 lookup 1`` or ``autoregressive``."""
        if self is Mode.AUTOREGRESSIVE or shape is None:
            return {"redrafter": drafter, "lookup": "lookup only"}.get(self.value, self.value)
        if self is Mode.LOOKUP:
            return f"lookup only {shape.describe_lookup_only()}"
        return f"{drafter} {shape.describe()}"
