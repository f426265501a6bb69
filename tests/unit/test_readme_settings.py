"""README.md's "Settings" tables against the real parsers: every flag of ``kvroute up``, ``gateway``,
``replica`` and ``bridge`` has a row, every row names a real flag, and each default column says the
parser's default.

The tables are for people, so the reading is tolerant of wording and strict on values: "8 MiB" is
8388608, "0.5 s" is 0.5, "none", "—" and "off" are no default, a trailing "(remark)" and an
"env `NAME`, else" in front are read past, and an option whose default is only known at run time
(None in the parser) may say it in words ("the model's"), but not as a number.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest

from bridge.cli import BridgeSettings
from gateway.cli import GatewayServer
from gateway.settings import GatewaySettings
from kvroute.settings import options
from launcher.cli import build_parser
from launcher.stack import StackSettings
from replica.cli import ReplicaServer
from replica.engine.config import EngineConfig
from replica.publisher import PublisherConfig

README = Path(__file__).resolve().parents[2] / "README.md"
# Each table's command and the settings dataclasses its options come from.
COMMANDS: dict[str, tuple[type, ...]] = {
    "up": (StackSettings, EngineConfig),
    "gateway": (GatewayServer, GatewaySettings),
    "replica": (EngineConfig, ReplicaServer, PublisherConfig),
    "bridge": (BridgeSettings, PublisherConfig),
}
# (command, flag) -> why its table leaves it out. None is left out today.
NOT_IN_TABLE: dict[tuple[str, str], str] = {}
NONE = object()  # what "none", "—" or "off" say
NONE_WORDS = {"none", "—", "-", "off", ""}
UNITS = {"KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "s": 1}


def settings_section() -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index("\n## Settings\n")
    return text[start : text.index("\n## ", start + 1)]


def split_cells(row: str) -> list[str]:
    """A table row's cells; a | inside `code` stays in its cell."""
    cells, cell, in_code = [], "", False
    for char in row.strip().strip("|"):
        if char == "`":
            in_code = not in_code
        if char == "|" and not in_code:
            cells.append(cell.strip())
            cell = ""
        else:
            cell += char
    return [*cells, cell.strip()]


def table(command: str) -> list[tuple[list[str], str, str]]:
    """The rows of ``### `kvroute COMMAND```: (flags, default cell, the whole row)."""
    section = settings_section()
    heading = f"\n### `kvroute {command}`\n"
    assert heading in section, f"no table for kvroute {command}"
    body = section[section.index(heading) + len(heading) :].split("\n### ")[0]
    rows = [line for line in body.splitlines() if line.startswith("|")][2:]  # past header and rule
    found = []
    for row in rows:
        flag_cell, default_cell, *_ = split_cells(row)
        flags = [span.split()[0] for span in re.findall(r"`([^`]+)`", flag_cell) if span.startswith("--")]
        assert flags, f"kvroute {command}: a row without a flag: {row}"
        found.append((flags, default_cell, row))
    return found


def defaults_of(flags: list[str], cell: str) -> list[str]:
    """One default for each flag: "a, b" for two flags, or one for all."""
    if len(flags) == 1:
        return [cell]
    parts = [part.strip() for part in cell.split(",")]
    if len(parts) == len(flags):
        return parts
    assert len(parts) == 1, f"{flags}: {len(parts)} defaults in {cell!r}"
    return parts * len(flags)


def read_value(text: str) -> Any:
    text = text.replace("`", "").strip()
    text = re.sub(r"^env [A-Z_]+, else ", "", text)
    text = re.sub(r"\s*\([^()]*\)$", "", text).strip()
    if text.lower() in NONE_WORDS:
        return NONE
    number = re.fullmatch(r"(-?\d+(?:\.\d+)?)\s*(KiB|MiB|GiB|s)?", text)
    if number:
        value = float(number.group(1)) * UNITS.get(number.group(2) or "", 1)
        return int(value) if value.is_integer() and "." not in number.group(1) else value
    return text


def subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[command]


def parser_flags(command: str) -> dict[str, argparse.Action]:
    return {
        action.option_strings[-1]: action
        for action in subparser(command)._actions
        if action.option_strings and not isinstance(action, argparse._HelpAction)
    }


def expected_default(command: str, flag: str, action: argparse.Action) -> Any:
    """What not giving the flag means: the parser's default, or a track_given field's own."""
    for cls in COMMANDS[command]:
        for opt in options(cls):
            if opt.flag == flag and opt.track_given:
                return opt.default
    return action.default


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_has_a_row_and_every_row_a_flag(command: str) -> None:
    documented = [flag for flags, _, _ in table(command) for flag in flags]
    assert len(documented) == len(set(documented)), f"kvroute {command}: a flag in two rows"
    flags = set(parser_flags(command))
    missing = flags - set(documented) - {flag for cmd, flag in NOT_IN_TABLE if cmd == command}
    assert not missing, f"kvroute {command}: no README row for {sorted(missing)}"
    unknown = set(documented) - flags
    assert not unknown, f"kvroute {command}: README rows for flags it does not have: {sorted(unknown)}"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_the_default_column_says_the_parsers_default(command: str) -> None:
    actions = parser_flags(command)
    for flags, cell, _ in table(command):
        for flag, text in zip(flags, defaults_of(flags, cell), strict=True):
            if flag not in actions:
                continue  # the row test above names it
            expected = expected_default(command, flag, actions[flag])
            said = read_value(text)
            where = f"kvroute {command} {flag}: README says {text!r}, the parser {expected!r}"
            if expected is None or expected is False or expected == []:
                # none, or a run-time default in words ("the model's"), never a number
                assert said is NONE or isinstance(said, str), where
            elif isinstance(expected, (int, float)):
                assert isinstance(said, (int, float)) and said == expected, where
            else:
                assert said == str(expected), where


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_row_names_the_environment_variable_its_flag_falls_back_on(command: str) -> None:
    rows = {flag: row for flags, _, row in table(command) for flag in flags}
    for cls in COMMANDS[command]:
        for opt in options(cls):
            if opt.env and opt.flag in rows:
                assert opt.env in rows[opt.flag], f"kvroute {command} {opt.flag}: {opt.env} not named"


def test_the_other_commands_paragraph_names_real_flags() -> None:
    section = settings_section()
    paragraph = section[section.index("Other commands:") :]
    spans = re.findall(r"`(kvroute [a-z-]+[^`]*)`", paragraph)
    assert len(spans) >= 4, spans
    for span in spans:
        command = span.split()[1]
        flags = set(parser_flags(command))
        for flag in re.findall(r"--[a-z][a-z0-9-]*", span):
            assert flag in flags, f"README: kvroute {command} has no {flag}"


def test_the_reading_of_values() -> None:
    """The tolerance above, pinned down."""
    assert read_value("8 MiB") == 8 * 1024 * 1024 and read_value("0.5 s") == 0.5 and read_value("2 s") == 2
    assert read_value("100000") == 100000 and read_value("1.0") == 1.0
    assert read_value("env `KVROUTE_API_KEYS`, else none (open)") is NONE
    assert read_value("— (standalone)") is NONE and read_value("off") is NONE
    assert read_value("`http://HOST:PORT`") == "http://HOST:PORT" and read_value("kv") == "kv"
    assert defaults_of(["--host", "--port"], "127.0.0.1, 8000") == ["127.0.0.1", "8000"]
    assert split_cells("| `--arch a|b` | — | x |") == ["`--arch a|b`", "—", "x"]
