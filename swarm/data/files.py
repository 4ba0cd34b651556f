"""Finding corpus files on disk in an order that is the same on every machine."""

from __future__ import annotations

import os
from collections.abc import Callable
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath

from protocols.errors import ConfigError


def scan(root: Path, pattern: str, *, skip: Callable[[PurePosixPath], bool]) -> list[tuple[str, Path]]:
    """``(relative POSIX path, path)`` of every file under ``root`` whose name matches ``pattern``.

    Sorted by relative path. Folders for which ``skip(relative path)`` is true are not entered, nor are
    symlinked folders (they could loop or leave the tree); the name match is case-sensitive everywhere.
    """
    found: list[tuple[str, Path]] = []
    for folder, subfolders, names in os.walk(root, followlinks=False):
        relative_folder = PurePosixPath(Path(folder).relative_to(root).as_posix())
        subfolders[:] = [name for name in subfolders if not skip(relative_folder / name)]
        for name in names:
            path = Path(folder, name)
            if fnmatchcase(name, pattern) and path.is_file():
                found.append(((relative_folder / name).as_posix(), path))
    return sorted(found)


def read(path: Path) -> bytes:
    """The bytes of ``path``; an unreadable file is a ConfigError naming it."""
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read corpus file {str(path)!r}: {exc.strerror or exc}") from None
