"""Where the project keeps what it builds once per machine (conversions, kernels, profiles).

No MLX import here: the console entry point reads it before MLX is loaded.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of the cache: ``$REDRAFTER_CACHE`` or ``~/.cache/redrafter-mlx``."""
    root = os.environ.get("REDRAFTER_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "redrafter-mlx"
