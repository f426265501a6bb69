"""Command-line options written once, on the settings dataclasses they fill, and kvroute's help layout.

A component declares each option on its settings field: ``option(DEFAULT, "--flag", "help")``. The
field keeps its default for code that builds the dataclass directly; :func:`add_options` turns the
fields into argparse options, and :func:`from_args` builds the dataclass back from what was parsed.
The rule, field by field:

- only a field declared with :func:`option` is an option; its ``dest`` is argparse's for the flag
  (``--kv-cache-memory-gb``: ``kv_cache_memory_gb``), whatever the field's name;
- the annotation gives the kind: ``bool`` a flag (store_true, off unless given), ``tuple[X, ...]`` or
  ``list[X]`` a repeatable option (append), ``X | None`` or ``X`` an option converted by ``X``
  (``str`` left as is);
- the parser's default is the field's, except for a required field, a repeatable option (``[]``) and a
  ``track_given`` one: those parse to None when not given, so a command can tell (the help of a
  ``track_given`` one still ends with the field's default);
- ``env=NAME``: a value not given (or empty) is read from the environment, a repeatable one as a
  comma-separated list (blanks dropped, duplicates once);
- :func:`from_args` leaves out what was not given (None, or an empty repeatable): the field's default
  applies, and a required one must come from an override;
- :func:`to_argv` writes parsed options back as a command line (what ``kvroute up`` hands on).

Ruff's RUF009 is told that :func:`option` returns a ``dataclasses.field`` (pyproject.toml). Standard
library only: the gateway imports this without torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import textwrap
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

REQUIRED: Any = dataclasses.MISSING  # option(REQUIRED, ...): a field the command fills at run time
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # the gateway's and a replica's request body limit
HOST_HELP = "address to listen on (0.0.0.0: every interface)"
LOG_LEVEL_HELP = "debug, info, warning or error"


def option(
    default: Any,
    flag: str,
    help: str,
    *,
    metavar: str | None = None,
    choices: Iterable[str] | None = None,
    env: str | None = None,
    group: str | None = None,
    track_given: bool = False,
) -> Any:
    """A dataclass field that is also the option ``flag`` (see the module's rule). ``group``: the
    argument group's title in the help; ``track_given``: parse to None unless given (the help still
    names the field's default, which is what not giving it means)."""
    meta = {"flag": flag, "help": help, "metavar": metavar, "env": env, "group": group}
    meta |= {"choices": tuple(choices) if choices else None, "track_given": track_given}
    if isinstance(default, list):
        return dataclasses.field(default_factory=default.copy, metadata={"kvroute": meta})
    return dataclasses.field(default=default, metadata={"kvroute": meta})


@dataclasses.dataclass(frozen=True)
class _Option:
    field: dataclasses.Field[Any]
    flag: str
    help: str
    metavar: str | None
    choices: tuple[str, ...] | None
    env: str | None
    group: str | None
    track_given: bool
    kind: type  # what each value is converted to
    container: type | None  # tuple or list for a repeatable option

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def default(self) -> Any:
        """The field's default (``REQUIRED`` when it has none)."""
        if self.field.default_factory is not dataclasses.MISSING:
            return self.field.default_factory()
        return self.field.default


def options(cls: type) -> list[_Option]:
    """The options declared on dataclass ``cls``, in field order."""
    hints = typing.get_type_hints(cls)
    found = []
    for field in dataclasses.fields(cls):
        if "kvroute" in field.metadata:
            kind, container = _kind(hints[field.name])
            found.append(_Option(field, kind=kind, container=container, **field.metadata["kvroute"]))
    return found


def _kind(hint: Any) -> tuple[type, type | None]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    container = typing.get_origin(hint)
    if container in (tuple, list):
        return typing.get_args(hint)[0], container
    return hint, None


def add_options(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    only: Mapping[str, str | None] | None = None,
    group: str | None = None,
    required: Iterable[str] = (),
) -> None:
    """Adds the options of dataclass ``cls`` to ``parser``. ``only``: just these fields, each with
    the help given instead of its own (None: its own); ``group``: the title of an argument group for
    all of them; ``required``: fields this command cannot run without (argparse says so)."""
    required = set(required)
    by_name = {opt.field.name: opt for opt in options(cls)}
    chosen = [by_name[name] for name in only] if only is not None else list(by_name.values())
    groups: dict[str, argparse._ArgumentGroup] = {}
    for opt in chosen:
        title = opt.group or group
        if title is not None and title not in groups:
            groups[title] = parser.add_argument_group(title)
        target = groups[title] if title is not None else parser
        help = (only or {}).get(opt.field.name) or opt.help
        kwargs: dict[str, Any] = {"dest": opt.dest, "metavar": opt.metavar, "choices": opt.choices}
        if opt.container is not None:
            kwargs |= {"action": "append", "default": []}
        elif opt.kind is bool:
            kwargs = {"dest": opt.dest, "action": "store_true"}
        elif opt.track_given or opt.default is REQUIRED:
            kwargs["default"] = None
        else:
            kwargs["default"] = opt.default
        if opt.track_given:
            help = f"{help} (default: {format_default(opt.default)})"
        if opt.kind is not str and opt.kind is not bool:
            kwargs["type"] = opt.kind
        if opt.field.name in required:
            kwargs["required"] = True
        target.add_argument(opt.flag, help=help, **{k: v for k, v in kwargs.items() if v is not None})


def from_args(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """An instance of ``cls`` from the options :func:`add_options` added, environment fallbacks
    included; ``overrides`` win over both."""
    values = {}
    for opt in options(cls):
        if opt.field.name in overrides:
            continue
        value = getattr(args, opt.dest)
        if opt.container is not None:
            items = list(value or [])
            if opt.env:
                items = items or os.environ.get(opt.env, "").split(",")
                items = list(dict.fromkeys(item.strip() for item in items if item.strip()))
            value = opt.container(items) if items else None
        elif opt.env:
            value = value or os.environ.get(opt.env) or None
        if value is not None:
            values[opt.field.name] = value
    return cls(**values, **overrides)


def to_argv(cls: type, args: argparse.Namespace, names: Iterable[str]) -> list[str]:
    """The parsed options ``names`` of ``cls`` as a command line again (those not given left out):
    what a command hands on to the child processes it starts."""
    by_name = {opt.field.name: opt for opt in options(cls)}
    argv = []
    for name in names:
        opt = by_name[name]
        value = getattr(args, opt.dest)
        if opt.kind is bool:
            argv += [opt.flag] if value else []
        elif opt.container is not None:
            argv += [part for item in value for part in (opt.flag, str(item))]
        elif value is not None:
            argv += [opt.flag, str(value)]
    return argv


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The help of every kvroute command (``kvroute bench`` uses it too).

    The rule: an option whose default is a value gets "(default: VALUE)" appended. One whose
    default is None, False or an empty list gets nothing appended, never "(default: None)": a
    flag (store_true: off unless given) and a repeatable option (append: none unless given) need
    no more, and any other such option says its default in words in its help ("default: the
    model's"), since it is only known at run time. Descriptions and epilogs (the examples) are
    printed as written. tests/unit/test_cli.py checks every command against this rule.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or not shows_default(action):
            return text
        shown = format_default(action.default).replace("%", "%%")  # help strings are %-formatted
        return f"{text} (default: {shown})"


def shows_default(action: argparse.Action) -> bool:
    """Whether :class:`HelpFormatter` appends this action's default (see its rule)."""
    default = action.default
    if default is None or default is False or default is argparse.SUPPRESS:
        return False
    if isinstance(default, (list, tuple)) and not default:
        return False
    return bool(action.option_strings) or action.nargs in ("?", "*")


def format_default(value: Any) -> str:
    """A default as a user would type it: lists space-separated, paths and numbers as text."""
    if isinstance(value, (list, tuple)):
        return " ".join(str(item) for item in value)
    return str(value)


def examples(*lines: str) -> str:
    """An epilog of example command lines (a ``# comment`` may follow each)."""
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


def add_command(
    sub: argparse._SubParsersAction, name: str, help: str, description: str, epilog: str, **kwargs: Any
) -> argparse.ArgumentParser:
    """A subcommand with kvroute's help layout: its description (wrapped here), options with their
    defaults, then its examples."""
    return sub.add_parser(
        name,
        help=help,
        description=textwrap.fill(description, width=78),
        epilog=epilog,
        formatter_class=HelpFormatter,
        **kwargs,
    )
