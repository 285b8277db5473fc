"""ReDrafter speculative decoding for MLX.

``from redrafter_mlx import load, generate, stream_generate, batch_generate``: mlx-lm's call shapes
(:mod:`redrafter_mlx.api`), imported on first use so that the command line starts without MLX.
"""

__version__ = "0.1.0"

_API = (
    "load",
    "generate",
    "stream_generate",
    "batch_generate",
    "GenerationResponse",
    "BatchResponse",
    "Model",
)
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        from redrafter_mlx import api

        return getattr(api, name)
    raise AttributeError(f"module 'redrafter_mlx' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's own names and the lazily imported API's (``dir(redrafter_mlx)``, tab
    completion), without importing it."""
    return sorted({*globals(), *_API})
