"""Where the project keeps what it builds once per machine (conversions, kernels, profiles).

No MLX import here: the console entry point reads it before MLX is loaded.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of the cache: ``$REDRAFTER_CACHE`` or ``~/.cache/redrafter-mlx``."""
    root = os.environ.get("REDRAFTER_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "redrafter-mlx"


# Errors that say the cache cannot be written where it is (read-only, no permission, full, a
# file in the way), as opposed to a file that is only missing
UNWRITABLE = frozenset(
    {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR}
)


def cache_hint(path: str | Path | None, error: int | None) -> str:
    """A clause to end an error line with when ``path`` (where a file operation failed with
    ``errno`` ``error``) is the cache, inside it or above it (a read-only home) and could not
    be written: where to move the cache. Empty otherwise."""
    if not path or error not in UNWRITABLE:
        return ""
    root, where = cache_dir().absolute(), Path(path).expanduser().absolute()
    if where != root and root not in where.parents and where not in root.parents:
        return ""
    named = "REDRAFTER_CACHE" in os.environ
    return (
        f" (the cache, {root}: {'point' if named else 'set'} REDRAFTER_CACHE to a folder "
        f"that can be written{', with room' if error in (errno.ENOSPC, errno.EDQUOT) else ''})"
    )
