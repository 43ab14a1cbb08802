"""argparse types the benchmark commands share."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

N = TypeVar("N", int, float)


def positive(text: str) -> int:
    """An argparse type: an integer >= 1 (0 tokens, clients or repeats leaves nothing to
    time)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positives(text: str) -> list[int]:
    """An argparse type: comma-separated integers, each >= 1."""
    return [positive(part) for part in text.split(",")]


def numbers(spec: str, kind: Callable[[str], N]) -> list[N]:
    """A flag's comma-separated numbers, or [] where one is not a number (the caller says
    what it wanted)."""
    try:
        return [kind(x) for x in spec.split(",")]
    except ValueError:
        return []
