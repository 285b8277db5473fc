"""The end-of-sequence rule: a run of tokens ends at its first EOS token.

Generation (:mod:`redrafter_mlx.core.stream`) drops the EOS token from what it returns; the
evaluators (:mod:`redrafter_mlx.training.evaluate`) keep it in the ids they compare. Both find
the end here.
"""

from __future__ import annotations

from collections.abc import Container, Sequence


def first_stop(tokens: Sequence[int], eos: Container[int]) -> int | None:
    """Index of the first EOS token of ``tokens (n,)``; None when there is none."""
    return next((i for i, token in enumerate(tokens) if token in eos), None)


def through_stop(tokens: list[int], eos: Container[int]) -> list[int]:
    """``tokens`` up to and with the first EOS token (all of them when there is none)."""
    stop = first_stop(tokens, eos)
    return tokens if stop is None else tokens[: stop + 1]
