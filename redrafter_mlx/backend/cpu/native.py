"""Native libraries built into the cache: whole or not at all, checked before every use.

A library is built in a temporary file or folder named after the building process and renamed
into place; a digest of its bytes (``<library>.sha256``) is written beside it, and a library
whose bytes do not match it (a truncated copy, an interrupted sync) is rebuilt instead of
being loaded: a truncated shared object kills the process that maps it (SIGBUS). Compilers
die with the process that started them, and builds left by a dead process are removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shlex
import shutil
import subprocess
from pathlib import Path

BUILD_PREFIX = ".build-"  # then the building process's id, "-", and a name of its own


def compiler(variable: str, default: str) -> list[str]:
    """The compiler command: ``$CC``/``$CXX`` (``variable``) or ``default`` on PATH."""
    return shlex.split(os.environ.get(variable) or "") or [shutil.which(default) or default]


def compiler_identity(command: list[str]) -> str:
    """What names the compiler in a build's cache key: its resolved path (Debian's carry the
    version, ``x86_64-linux-gnu-gcc-12``), its size and its flags from the environment."""
    found = shutil.which(command[0])
    if not found:
        return " ".join(command)
    resolved = Path(found).resolve()
    return f"{resolved} {resolved.stat().st_size} {' '.join(command[1:])}"


def digest_path(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def seal(library: Path) -> None:
    """Write ``library``'s digest beside it (call before it is renamed into place)."""
    digest_path(library).write_text(_digest(library) + "\n")


def intact(library: Path) -> bool:
    """Whether ``library`` exists and its bytes match the digest written when it was built."""
    try:
        return digest_path(library).read_text().strip() == _digest(library)
    except OSError:
        return False


def discard(library: Path) -> None:
    """Remove a damaged ``library`` and its digest (another process may be doing the same)."""
    for path in (library, digest_path(library)):
        with contextlib.suppress(OSError):
            path.unlink()


def build_name(stem: str = "") -> str:
    """A temporary build name owned by this process (see :func:`remove_stale`)."""
    return f"{BUILD_PREFIX}{os.getpid()}-{stem}"


def remove_stale(folder: Path) -> None:
    """Remove builds in ``folder`` left by processes that are no longer running."""
    with contextlib.suppress(OSError):
        for entry in folder.iterdir():
            if entry.name.startswith(BUILD_PREFIX) and not _alive(_owner(entry.name)):
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        entry.unlink()


def _owner(name: str) -> int | None:
    pid = name[len(BUILD_PREFIX) :].split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


def _alive(pid: int | None) -> bool:
    if pid is None:  # not ours to judge
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def compile_command(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run a compiler command that does not outlive the thread that starts it: util-linux's
    ``setpriv --pdeathsig`` where there is one (a ``preexec_fn`` is unsafe with threads)."""
    setpriv = shutil.which("setpriv")
    wrapped = [setpriv, "--pdeathsig", "KILL", "--", *cmd] if setpriv else cmd
    return subprocess.run(wrapped, capture_output=True, text=True, timeout=timeout)
