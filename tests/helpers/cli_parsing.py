"""``kvroute``'s own argument parser, made strict for checking deploy files' command lines."""

from __future__ import annotations

import argparse

from launcher.cli import build_parser


def strict_parser() -> argparse.ArgumentParser:
    """``kvroute``'s parser with abbreviations off, so a misspelt ``--thread`` is not ``--threads``."""
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                subparser.allow_abbrev = False
    return parser
