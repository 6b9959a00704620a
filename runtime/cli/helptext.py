"""The look of every `strata` help page: the formatter, the wrapped description, the examples
epilog."""

from __future__ import annotations

import argparse
import textwrap

__all__ = ["Formatter", "describe", "examples"]


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in every flag's help; the examples of an epilog kept as written."""


def describe(text: str) -> str:
    """A command's description, wrapped to the width the help pages keep."""
    return textwrap.fill(text, 78)


def examples(*lines: str) -> str:
    """The `examples:` epilog of a help page, one indented command a line."""
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)
