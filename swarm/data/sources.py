"""The built-in datasets: ``stdlib`` (the default corpus) and ``text-files``."""

from __future__ import annotations

import sysconfig
from pathlib import Path, PurePosixPath
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from protocols.errors import ConfigError
from swarm.data.builder import register_dataset
from swarm.data.corpus import ByteDataset
from swarm.data.files import read, scan

_SKIPPED_STDLIB_FOLDERS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__"})


class StdlibConfig(BaseModel):
    """The Python standard library's own ``.py`` source: on every machine, no download."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    #: The standard library does not change while a process runs, so a built corpus can be shared.
    cacheable: ClassVar[bool] = True

    validation_fraction: float = Field(
        0.02, ge=0.0, le=0.5, description="Share of files held out for validation, chosen by path hash."
    )
    max_bytes: int | None = Field(
        None, ge=1024, le=2**40, description="Cap on corpus bytes (train and validation); None for all."
    )


class TextFilesConfig(BaseModel):
    """Local text files: each path is a file or a folder scanned recursively for ``glob``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    #: Local files may be edited between builds, so every build reads them again.
    cacheable: ClassVar[bool] = False

    paths: tuple[str, ...] = Field(
        ..., min_length=1, max_length=1024, description="Files or folders; '~' is expanded."
    )
    glob: str = Field(
        "*.txt", min_length=1, max_length=256, description="File name pattern matched inside folders."
    )
    validation_fraction: float = Field(
        0.02, ge=0.0, le=0.5, description="Share of files held out for validation, chosen by path hash."
    )
    max_bytes: int | None = Field(
        None, ge=1024, le=2**40, description="Cap on corpus bytes (train and validation); None for all."
    )


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _skip_stdlib(folder: PurePosixPath) -> bool:
    # config-3.x-<platform>/ holds files generated for this machine's build, with its paths inside.
    return (
        folder.name in _SKIPPED_STDLIB_FOLDERS
        or folder.as_posix() == "idlelib/idle_test"
        or folder.name.startswith("config-")
    )


@register_dataset("stdlib", StdlibConfig)
def build_stdlib(config: StdlibConfig) -> ByteDataset:
    root = stdlib_root()
    if not root.is_dir():
        raise ConfigError(f"the Python standard library folder {str(root)!r} does not exist")
    files = [
        (relative, path)
        for relative, path in scan(root, "*.py", skip=_skip_stdlib)
        # Also generated per build (compiler flags, install prefix), so it differs between machines.
        if not relative.startswith("_sysconfigdata")
    ]
    return ByteDataset(
        "stdlib",
        ((relative, read(path)) for relative, path in files),
        validation_fraction=config.validation_fraction,
        max_bytes=config.max_bytes,
    )


def _skip_hidden(folder: PurePosixPath) -> bool:
    return folder.name.startswith(".")


@register_dataset("text-files", TextFilesConfig)
def build_text_files(config: TextFilesConfig) -> ByteDataset:
    """Relative paths are a file's own name, or its path inside the listed folder; hidden ones are skipped."""
    documents: dict[str, bytes] = {}
    origins: dict[str, str] = {}
    seen: set[Path] = set()
    for given in config.paths:
        path = Path(given).expanduser()
        if path.is_dir():
            found = [
                (rel, p)
                for rel, p in scan(path, config.glob, skip=_skip_hidden)
                if not p.name.startswith(".")
            ]
            if not found:
                raise ConfigError(f"text-files path {given!r} has no files matching {config.glob!r}")
        elif path.is_file():
            found = [(path.name, path)]
        else:
            raise ConfigError(f"text-files path {given!r} does not exist")
        for relative, file in found:
            resolved = file.resolve()
            if resolved in seen:
                continue
            seen.add(resolved)
            if relative in documents:
                raise ConfigError(
                    f"text-files paths {origins[relative]!r} and {given!r} both contain a file named "
                    f"{relative!r}; list a parent folder instead so the names differ"
                )
            documents[relative] = read(file)
            origins[relative] = given
    if not any(documents.values()):
        raise ConfigError(f"text-files paths {list(config.paths)!r} hold no bytes")
    return ByteDataset(
        "text-files",
        documents.items(),
        validation_fraction=config.validation_fraction,
        max_bytes=config.max_bytes,
    )
