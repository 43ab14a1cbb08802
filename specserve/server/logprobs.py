"""Logprobs in the API: what each endpoint's body asks for, and the engine's figures in
OpenAI's shapes (engine/logprobs.py says which distribution they are)."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

from specserve.engine.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from specserve.loading.tokenizer import Tokenizer
from specserve.server.errors import ApiError
from specserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    ResponsesRequest,
)
from specserve.server.replies import CompletionLogprobs, TokenLogprobs, TopLogprob

RESPONSES_INCLUDE = "message.output_text.logprobs"


def asked(body: GenerationRequest) -> int | None:
    """How many top tokens per position the body asks for; None when it asks no logprobs."""
    if isinstance(body, CompletionRequest):
        return _completion(body)
    if isinstance(body, ChatCompletionRequest):
        return _chat(body)
    if body.logprobs is not None:
        raise ApiError(
            400,
            f'the Responses API takes include: ["{RESPONSES_INCLUDE}"] and top_logprobs, '
            "not logprobs",
            param="logprobs",
        )
    wanted = isinstance(body, ResponsesRequest) and RESPONSES_INCLUDE in (body.include or [])
    if not wanted and body.top_logprobs is None:
        return None
    return _top(body.top_logprobs or 0, "top_logprobs")


def _chat(body: ChatCompletionRequest) -> int | None:
    if body.logprobs is not None and not isinstance(body.logprobs, bool):
        raise ApiError(400, "logprobs must be true or false for chat", param="logprobs")
    if not body.logprobs:
        if body.top_logprobs is not None:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return None
    return _top(body.top_logprobs or 0, "top_logprobs")


def _completion(body: CompletionRequest) -> int | None:
    if body.top_logprobs is not None:
        raise ApiError(
            400, "completions take logprobs: N (the top N), not top_logprobs", param="top_logprobs"
        )
    if body.logprobs is None:
        return None
    if isinstance(body.logprobs, bool):
        raise ApiError(400, "logprobs must be an integer for completions", param="logprobs")
    if body.echo:
        raise ApiError(
            400, "logprobs with echo (the prompt's logprobs) are not supported", param="echo"
        )
    return _top(body.logprobs, "logprobs")


def _top(n: int, param: str) -> int:
    if not 0 <= n <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"{param} must be in [0, {MAX_TOP_LOGPROBS}], got {n}", param=param)
    return n


def to_openai(tok: Tokenizer, entries: Sequence[TokenLogprob]) -> list[TokenLogprobs]:
    """Engine figures -> chat / Responses items (the token's text decoded on its own; its
    `bytes` are exact where a token holds part of a character)."""
    ids = {e.token for e in entries} | {t for e in entries for t, _ in e.top}
    spelt = dict(zip(ids, tok.token_bytes(list(ids)), strict=True))

    def item(token: int, logprob: float) -> TopLogprob:
        raw = spelt[token]
        return TopLogprob(token=raw.decode(errors="replace"), logprob=logprob, bytes=list(raw))

    return [
        TokenLogprobs(
            **item(e.token, e.logprob).model_dump(), top_logprobs=[item(t, v) for t, v in e.top]
        )
        for e in entries
    ]


def legacy(items: Sequence[TokenLogprobs], offset: int = 0) -> CompletionLogprobs:
    """Chat-shaped items -> legacy completions' lists; `offset`: characters before the
    first token (earlier chunks' tokens when streaming)."""
    tokens = [i.token for i in items]
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[i.logprob for i in items],
        top_logprobs=[{t.token: t.logprob for t in i.top_logprobs} for i in items],
        text_offset=list(accumulate((len(t) for t in tokens[:-1]), initial=offset))
        if tokens
        else [],
    )
