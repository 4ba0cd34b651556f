"""Named registries of architectures and datasets, with typed, validated configs.

A registry maps a name to a pydantic config class and a factory. Lookups validate a plain config dict
against the config class and turn pydantic's errors into a :class:`ConfigError` that names the field, so
a run file or a network message can only ever select code that is already installed on the peer.
Entries beyond the built-in ones come from a Python entry point group, loaded on first need.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ValidationError

from protocols.errors import ConfigError

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

_MAX_INPUT_REPR = 80


@dataclass(frozen=True)
class Entry(Generic[F]):
    """One registered name: the config class it accepts and the factory that builds it."""

    name: str
    config_cls: type[BaseModel]
    factory: F


class Registry(Generic[F]):
    """Name -> (config class, factory), filled by decorators and by the entry point group ``group``."""

    def __init__(self, kind: str, group: str) -> None:
        self.kind = kind
        self.group = group
        self._entries: dict[str, Entry[F]] = {}
        self._broken: dict[str, str] = {}
        self._entry_points_loaded = False
        self._lock = threading.RLock()

    def register(self, name: str, config_cls: type[BaseModel]) -> Callable[[F], F]:
        """Decorator that registers ``factory`` under ``name``; re-registering the same factory is a no-op."""
        if not isinstance(name, str) or not name or name != name.strip() or any(c.isspace() for c in name):
            raise ConfigError(f"{self.kind} name must be a non-empty string without spaces, got {name!r}")
        if not (isinstance(config_cls, type) and issubclass(config_cls, BaseModel)):
            raise ConfigError(f"{self.kind} '{name}': config_cls must be a pydantic model class")

        def decorator(factory: F) -> F:
            with self._lock:
                existing = self._entries.get(name)
                if existing is not None and _qualname(existing.factory) != _qualname(factory):
                    raise ConfigError(
                        f"{self.kind} '{name}' is already registered by {_qualname(existing.factory)}; "
                        f"pick another name for {_qualname(factory)}"
                    )
                self._entries[name] = Entry(name, config_cls, factory)
            return factory

        return decorator

    def names(self) -> list[str]:
        """Every name that can be built here, built-in and from entry points, sorted."""
        self._load_entry_points()
        with self._lock:
            return sorted(self._entries)

    def get(self, name: str) -> Entry[F]:
        """The entry for ``name``; a ConfigError lists the available names when there is none."""
        with self._lock:
            entry = self._entries.get(name)
        if entry is not None:
            return entry
        self._load_entry_points()
        with self._lock:
            entry = self._entries.get(name)
            if entry is not None:
                return entry
            if name in self._broken:
                raise ConfigError(f"{self.kind} '{name}' could not be loaded: {self._broken[name]}")
            available = ", ".join(sorted(self._entries)) or "none"
        raise ConfigError(
            f"unknown {self.kind} {name!r}; available: {available}; a {self.kind} from another package is "
            f"found once that package is installed here (it registers under the Python entry point group "
            f"{self.group!r})"
        )

    def validate(self, name: str, config: Mapping[str, Any] | BaseModel | None) -> BaseModel:
        """The typed config of ``name`` built from ``config``, or a ConfigError naming the bad field."""
        entry = self.get(name)
        if config is None:
            config = {}
        elif isinstance(config, entry.config_cls):
            config = config.model_dump()
        elif not isinstance(config, Mapping):
            raise ConfigError(
                f"config for {self.kind} '{name}' must be a table of fields, got {type(config).__name__}"
            )
        try:
            return entry.config_cls.model_validate(dict(config))
        except ValidationError as exc:
            raise ConfigError(
                describe_validation_error(f"{self.kind} '{name}'", entry.config_cls, exc)
            ) from None

    def _load_entry_points(self) -> None:
        with self._lock:
            if self._entry_points_loaded:
                return
            self._entry_points_loaded = True
            for ep in entry_points(group=self.group):
                self._load_entry_point(ep)

    def _load_entry_point(self, ep: Any) -> None:
        before = set(self._entries)
        try:
            obj = ep.load()
            # A factory decorated with register() registered itself on import; anything else is a hook
            # that registers when called.
            if ep.name not in self._entries and not any(e.factory is obj for e in self._entries.values()):
                obj()
        except Exception as exc:  # a broken plugin must not hide the working ones
            self._broken[ep.name] = f"entry point {ep.value!r} in group {self.group!r} failed: {exc!r}"
            logger.warning("Skipping %s: %s", self.kind, self._broken[ep.name])
            return
        if set(self._entries) == before and ep.name not in self._entries:
            self._broken[ep.name] = f"entry point {ep.value!r} in group {self.group!r} registered nothing"
            logger.warning("Skipping %s: %s", self.kind, self._broken[ep.name])


def describe_validation_error(what: str, config_cls: type[BaseModel], exc: ValidationError) -> str:
    """One message for all of pydantic's complaints, each naming its field."""
    problems = []
    for err in exc.errors():
        field = ".".join(str(part) for part in err["loc"])
        if err["type"] == "extra_forbidden":
            known = ", ".join(config_cls.model_fields)
            problems.append(f"unknown field '{field}' (known fields: {known})")
        elif err["type"] == "missing":
            problems.append(f"missing required field '{field}'")
        elif field:
            problems.append(f"field '{field}': {_strip(err['msg'])} (got {_short_repr(err.get('input'))})")
        else:
            # Model-level checks span several fields and name them in their own message.
            problems.append(_strip(err["msg"]))
    return f"invalid config for {what}: " + "; ".join(problems)


def _strip(msg: str) -> str:
    return msg.removeprefix("Value error, ")


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_INPUT_REPR else text[: _MAX_INPUT_REPR - 3] + "..."


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"
