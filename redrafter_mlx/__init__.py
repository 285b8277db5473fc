"""ReDrafter speculative decoding for MLX."""

__version__ = "0.1.0"
