"""A wrapper that counts the calls of one method of what it wraps: a test's evidence that a
kernel path really ran, not the fallback beside it."""

from __future__ import annotations

from typing import Any


class Spy:
    def __init__(self, inner: object, method: str, calls: list[int]) -> None:
        self._inner, self._method, self._calls = inner, method, calls

    def __getattr__(self, name: str) -> Any:  # noqa: ANN401
        attr = getattr(self._inner, name)
        if name != self._method:
            return attr

        def counted(*args: object) -> object:
            self._calls.append(1)
            return attr(*args)

        return counted
