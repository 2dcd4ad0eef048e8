"""Process settings defined once, as a frozen dataclass, and the command line made from its fields.

Each field is a `setting(...)`: its type, default and help, plus what its flag needs beyond
them. The flag of a field is its name with dashes (`config_poll_seconds` ->
`--config-poll-seconds`) unless it names another. A `bool` field is a switch (default False),
a `tuple[str, ...]` field a repeatable flag, an optional one (`T | None`) takes a T.

Pure: building a parser and reading a parsed namespace do no I/O. A default read from the
environment comes from the `environ` mapping the caller passes to `add_flags`; parsing (which
reads the process's argv and exits on a usage error) is the caller's.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

Settings = TypeVar("Settings")


@dataclass(frozen=True)
class FlagGroup:
    """A titled section of `--help` (argparse's argument group)."""

    title: str
    description: str | None = None


def setting(
    default: Any = dataclasses.MISSING,
    help: str | None = None,
    *,
    flag: str | None = None,
    short: str | None = None,
    metavar: str | None = None,
    choices: Sequence[str] | None = None,
    at_least: int | None = None,
    env: str | None = None,
    group: FlagGroup | None = None,
    exclusive: str | None = None,
) -> Any:
    """A settings field: its default, its flag's help, and what the flag needs beyond its type.

    short: a one-letter alias (`-n`); env: a variable whose value, when set, is the default;
    group: the `--help` section; exclusive: flags sharing this key exclude each other.
    """
    metadata = {
        "help": help,
        "flag": flag,
        "short": short,
        "metavar": metavar,
        "choices": choices,
        "at_least": at_least,
        "env": env,
        "group": group,
        "exclusive": exclusive,
    }
    return dataclasses.field(default=default, metadata=metadata)


def flag_of(item: dataclasses.Field[Any]) -> str:
    flag: str | None = item.metadata["flag"]
    return flag if flag is not None else "--" + item.name.replace("_", "-")


def add_flags(
    parser: argparse.ArgumentParser, settings: type[Any], environ: Mapping[str, str] | None = None
) -> None:
    """One flag per field, in field order: its type (the non-None one of an optional), default, help."""
    hints = typing.get_type_hints(settings)
    groups: dict[FlagGroup | None, argparse._ActionsContainer] = {None: parser}
    exclusive: dict[tuple[FlagGroup | None, str], argparse._ActionsContainer] = {}
    for item in dataclasses.fields(settings):
        flag = flag_of(item)
        meta = item.metadata
        group = meta["group"]
        if group not in groups:
            groups[group] = parser.add_argument_group(group.title, group.description)
        container = groups[group]
        if meta["exclusive"] is not None:
            key = (group, meta["exclusive"])
            if key not in exclusive:
                exclusive[key] = container.add_mutually_exclusive_group()
            container = exclusive[key]
        names = [flag] if meta["short"] is None else [flag, meta["short"]]
        container.add_argument(*names, dest=item.name, help=meta["help"], **_kind(item, hints, flag, environ))


def _kind(
    item: dataclasses.Field[Any], hints: Mapping[str, Any], flag: str, environ: Mapping[str, str] | None
) -> dict[str, Any]:
    """What argparse needs for this field's type: a switch, a repeatable flag, or one value."""
    meta = item.metadata
    kind = hints[item.name]
    default: Any = None if item.default is dataclasses.MISSING else item.default
    if kind is bool:
        if default is not False:
            raise TypeError(f"{item.name}: a switch defaults to False")
        return {"action": "store_true"}
    metavar = meta["metavar"] or (None if meta["choices"] else flag[2:].replace("-", "_").upper())
    if typing.get_origin(kind) is tuple:
        # a fresh list: argparse appends to the default it is given
        return {"action": "append", "default": list(default or ()), "metavar": metavar}
    if isinstance(kind, types.UnionType):
        (kind,) = (arg for arg in typing.get_args(kind) if arg is not type(None))
    if meta["env"] is not None and environ is not None:
        default = environ.get(meta["env"], default)
    # argparse's own metavar, from the flag rather than the field name
    return {
        "type": kind,
        "required": item.default is dataclasses.MISSING,
        "default": default,
        "choices": meta["choices"],
        "metavar": metavar,
    }


def settings_from(namespace: argparse.Namespace, settings: type[Settings]) -> Settings:
    """The settings a namespace parsed by `add_flags`'s flags gives (repeated flags as tuples).

    Raises what the settings' own checks raise (ValueError for a value they refuse).
    """
    values = {
        key: tuple(value) if isinstance(value, list) else value for key, value in vars(namespace).items()
    }
    return settings(**values)


def check_at_least(settings: Any) -> None:
    """ValueError naming the flag of the first field below its `at_least`."""
    for item in dataclasses.fields(settings):
        least, value = item.metadata["at_least"], getattr(settings, item.name)
        if least is not None and value < least:
            raise ValueError(f"{flag_of(item)} must be at least {least}, got {value}")


def to_flags(settings: Any) -> list[str]:
    """The flags that give `settings` back: one for each field not at its default (a switch alone)."""
    args: list[str] = []
    for item in dataclasses.fields(settings):
        value = getattr(settings, item.name)
        if item.default is not dataclasses.MISSING and value == item.default:
            continue
        if isinstance(value, bool):
            args.append(flag_of(item))
        elif isinstance(value, tuple):
            for each in value:
                args += [flag_of(item), str(each)]
        else:
            args += [flag_of(item), str(value)]
    return args
