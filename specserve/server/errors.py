"""The error a handler raises to answer with OpenAI's error body and a status."""

from __future__ import annotations

from collections.abc import Mapping


class ApiError(Exception):
    """An error the client gets as OpenAI's error body with this status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.param = param
        self.code = code
        self.headers: dict[str, str] = dict(headers or {})
