"""Atomic writes: a failure never leaves a half-written file or folder at the destination."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from redrafter_mlx.core.errors import ConfigError
from redrafter_mlx.core.paths import cache_hint


def write_with(path: Path | str, writer: Callable[[Path], None]) -> None:
    """Call ``writer(tmp)`` on a temp file beside ``path`` (same suffix), then rename it."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=path.suffix)
    os.close(fd)
    os.chmod(tmp, _usual_mode(0o666))  # mkstemp makes it private (0600)
    try:
        writer(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text(path: Path | str, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically, flushed to disk before the rename."""

    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    write_with(path, write)


@contextlib.contextmanager
def staged_dir(out: Path | str) -> Iterator[Path]:
    """Yield a temp folder beside ``out``; on success it replaces ``out``, on failure it goes."""
    out = Path(out).expanduser().absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    os.chmod(tmp, _usual_mode(0o777))  # mkdtemp makes it private (0700)
    try:
        yield tmp
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        elif old.exists():
            old.unlink()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _usual_mode(base: int) -> int:
    """The mode a plain ``open`` / ``mkdir`` would give: ``base`` less the process umask."""
    mask = os.umask(0)
    os.umask(mask)
    return base & ~mask


def os_error_text(e: OSError, path: str | None = None) -> str:
    """One line for a failed file operation: ``path: reason`` (``path`` when the error names
    no file)."""
    where = e.filename or path
    hint = cache_hint(where, e.errno)  # a read-only home: say where else the cache can go
    return f"{where}: {e.strerror or e}{hint}" if where else str(e.strerror or e)


def check_writable(path: Path | str, what: str) -> None:
    """Fail now, not after a long run, when ``path`` (a folder to create or fill, or a file's
    folder) cannot be written: its nearest existing ancestor must be a folder that takes a
    file (probed with a temp file: permission bits say nothing to root or about /proc)."""
    folder = Path(path).expanduser().absolute()
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise ConfigError(f"{what} {path}: {folder} is a file")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        why = f"{e.strerror or e}{cache_hint(folder, e.errno)}"
        raise ConfigError(f"{what} {path}: {folder} is not writable ({why})") from None


def is_disk_full(error: BaseException, where: Path | None = None) -> bool:
    """Whether ``error`` is a write that ran out of room: ENOSPC or a full quota, or MLX's
    writer's ``RuntimeError("[write] Unable to write N bytes")``, which carries no errno (a
    full disk is what raises it in practice; with ``where``, only when under 1 MiB is left
    there)."""
    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    if not (isinstance(error, RuntimeError) and str(error).startswith("[write]")):
        return False
    try:
        return where is None or shutil.disk_usage(where).free < 1 << 20
    except OSError:
        return False


def free_space(path: Path | str) -> str:
    """The space left on the disk that holds ``path`` (or would: its nearest existing
    folder), in words: ``"12 MiB free"``; ``"free space unknown"`` when it cannot be read."""
    folder = Path(path).expanduser().absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return f"{shutil.disk_usage(folder).free / 2**20:,.0f} MiB free"
    except OSError:
        return "free space unknown"
