"""Type checks of a drafter config's fields (a value returned only when it checks out), in one
place for every drafter type.

A hand-edited or foreign ``config.json`` (a size as a string, zero heads, a JSON ``true`` where
a count belongs) would otherwise reach MLX and end in a traceback (``ZeroDivisionError``,
``TypeError``). Each check returns the value or raises :class:`DrafterError` naming the field,
its value and what it needs, in one line. No coercion: ``"576"`` is not silently 576.
"""

from __future__ import annotations

from collections.abc import Mapping

from redrafter_mlx.core.errors import DrafterError


def integer(name: str, value: object, *, least: int = 1) -> int:
    """``value`` when it is an integer >= ``least`` (a JSON true is not one)."""
    if type(value) is not int or value < least:
        raise DrafterError(f"{name} {value!r}: need an integer >= {least}")
    return value


def number(name: str, value: object) -> float:
    """``value`` as a float when it is a JSON number."""
    if type(value) not in (int, float):
        raise DrafterError(f"{name} {value!r}: need a number")
    return float(value)


def flag(name: str, value: object) -> bool:
    """``value`` when it is true or false."""
    if not isinstance(value, bool):
        raise DrafterError(f"{name} {value!r}: need true or false")
    return value


def indices(name: str, value: object) -> list[int]:
    """``value`` as a list when it is a non-empty list of layer indices >= 0."""
    if (
        not isinstance(value, list | tuple)
        or not value
        or any(type(i) is not int or i < 0 for i in value)
    ):
        raise DrafterError(f"{name} {value!r}: need a list of layer indices >= 0")
    return list(value)


def sizes(config: Mapping, *names: str) -> list[int]:
    """``config[name]`` for each name, each an integer >= 1 (KeyError for a missing one)."""
    return [integer(name, config[name]) for name in names]


def given(config: Mapping, name: str, default: object) -> object:
    """``config[name]``, or ``default`` when it is absent or null (a null means "unset" in
    Hugging Face configs)."""
    value = config.get(name)
    return default if value is None else value


def section(config: Mapping, name: str) -> dict:
    """``config[name]`` when it is an object, ``{}`` when it is absent or null."""
    value = given(config, name, {})
    if not isinstance(value, dict):
        raise DrafterError(f"{name} {value!r}: need a JSON object")
    return value


def heads(num_heads: int, num_kv_heads: int) -> None:
    """Refuse K/V heads that do not divide the query heads (grouped attention needs it)."""
    if num_heads % num_kv_heads:
        raise DrafterError(
            f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads "
            f"{num_kv_heads}"
        )
