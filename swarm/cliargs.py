"""Command-line flags derived from typed config models, so a CLI never re-declares its options by hand.

Each field becomes ``--field-name`` with the field's description as help and its type and bounds checked
by the model. In ``json_schema_extra`` a field may set ``cli_flag`` (its flag, where the field name
cannot be the flag's) and ``cli_aliases`` (flag -> value), which is how ``--gpu``/``--cpu`` map onto
``device``.
"""

from __future__ import annotations

import argparse
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticUndefined

from protocols.errors import ConfigError


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _unwrap_optional(annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def add_config_arguments(
    parser: argparse.ArgumentParser, model: type[BaseModel], *, positional: tuple[str, ...] = ()
) -> None:
    """Add one flag per field of ``model``; fields named in ``positional`` become positional arguments."""
    for name, info in model.model_fields.items():
        annotation = _unwrap_optional(info.annotation)
        help_text = info.description or ""
        if info.default not in (None, PydanticUndefined) and annotation is not bool:
            help_text += f" (default: {info.default})"
        kwargs: dict[str, Any] = {"help": help_text, "default": argparse.SUPPRESS}
        if typing.get_origin(annotation) is Literal:
            kwargs["choices"] = list(typing.get_args(annotation))
        elif annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif annotation in (int, float, str, Path):
            kwargs["type"] = str if annotation is Path else annotation
        if name in positional:
            kwargs.pop("default")
            parser.add_argument(name, **kwargs)
            continue
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        flag = extra.get("cli_flag") or _flag(name)
        aliases = extra.get("cli_aliases")
        if aliases:
            group = parser.add_mutually_exclusive_group()
            group.add_argument(flag, dest=name, **kwargs)
            for alias, value in aliases.items():
                group.add_argument(
                    alias, dest=name, action="store_const", const=value, default=argparse.SUPPRESS,
                    help=f"same as {flag} {value}",
                )  # fmt: skip
        else:
            parser.add_argument(flag, dest=name, required=info.is_required(), **kwargs)


def config_from_args(model: type[BaseModel], args: argparse.Namespace) -> Any:
    """Build ``model`` from parsed flags; a bad value raises ConfigError naming the flag."""
    values = {name: getattr(args, name) for name in model.model_fields if hasattr(args, name)}
    try:
        return model.model_validate(values)
    except ValidationError as e:
        item = e.errors()[0]
        flag = "arguments"
        if item["loc"]:
            info = model.model_fields.get(str(item["loc"][0]))
            extra = info.json_schema_extra if info and isinstance(info.json_schema_extra, dict) else {}
            flag = extra.get("cli_flag") or _flag(str(item["loc"][0]))
        raise ConfigError(f"{flag}: {item['msg'].removeprefix('Value error, ')}") from None
