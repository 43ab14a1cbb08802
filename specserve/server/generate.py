"""The three generation endpoints: request body -> engine Request -> OpenAI response or SSE.

Every endpoint does the same four things: check the body, build the prompt ids, submit
(`_start`: settings checked, queue full -> 503, engine refusal -> 400; one engine request
per choice, server/choices.py), then either collect the text or stream it. The text
always comes from one `TextStream`, so streaming and non-streaming give the same text; it
gets the tokens one at a time, so a stop string ends the text, the token count and the
logprobs where decoding without drafts would.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from typing import Any, TypeVar

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from specserve.engine.request import Request as EngineRequest
from specserve.engine.request import SpecParams
from specserve.errors import SpecserveError
from specserve.grammar.constraint import GrammarConstraint, build_constraint
from specserve.grammar.formats import CALL_START, Grammar, GrammarError
from specserve.loading.tokenizer import Tokenizer
from specserve.server import choices, logprobs, runs, streams, structured, tools
from specserve.server.checks import check_caps, check_prediction, sampling, unsupported
from specserve.server.errors import ApiError
from specserve.server.events import EngineFailure, QueueFull
from specserve.server.loop import EngineLoop, Handle
from specserve.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ContentPart,
    GenerationRequest,
    ResponsesRequest,
    SpeculativeSettings,
)
from specserve.server.streams import Delta, Finish
from specserve.server.text import TextStream

T = TypeVar("T")

# what a chat template raises for messages it refuses (its raise_exception, a role order it
# cannot render, a field of the wrong type): the client's mistake, not the server's
_TEMPLATE_ERRORS = (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError)


# a text longer than this many characters per context token is measured from its head first
_PROBE_CHARS_PER_TOKEN = 8


class EngineStream(StreamingResponse):
    """An SSE response that cancels its requests however it ends (client gone included)."""

    def __init__(self, handles: list[Handle], chunks: AsyncIterator[str]) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(chunks, media_type="text/event-stream", headers=headers)
        self.handles = handles

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            choices.cancel(self.handles)  # no-op for those that finished


class OpenAIEndpoints:
    """Turns OpenAI requests into engine requests and engine events into OpenAI responses."""

    def __init__(
        self,
        loop: EngineLoop,
        tokenizer: Tokenizer,
        model_id: str,
        spec_types: tuple[str, ...],
        spec_defaults: SpecParams,
    ) -> None:
        self.loop = loop
        self.tok = tokenizer
        self.model_id = model_id
        self.spec_types = spec_types
        self.spec_defaults = spec_defaults
        self.max_len = loop.engine.max_len
        self.vocab_size = loop.engine.vocab_size
        # template rendering and tokenization take seconds for a large prompt: off the event
        # loop, one at a time (a tokenizer is not made for concurrent calls)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="specserve-prompt")

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    # -- endpoints -------------------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._check(body)
        offered = tools.offered(body, self.tok.chat_template)
        grammar = self._chat_grammar(body, offered)
        turns = [tools.template_message(_turn(m)) for m in body.messages]
        prompt = await self._off_loop(self._chat_prompt, turns, offered)
        use_mct = body.max_completion_tokens is not None
        limit = body.max_completion_tokens if use_mct else body.max_tokens
        param = "max_completion_tokens" if use_mct else "max_tokens"
        tenant = _tenant(request, body)
        handles, outs = await self._start(body, prompt, limit, param, tenant, grammar)
        if offered:
            names = [t["function"]["name"] for t in offered]
            outs = [tools.with_calls(run, names) for run in outs]
        ids = streams.Ids("chatcmpl-" + uuid.uuid4().hex, self.model_id)
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            merged = choices.merged([runs.errors_as_events(run) for run in outs])
            return EngineStream(handles, streams.chat(ids, merged, len(outs), usage))
        got = await choices.collect(outs, handles, request)
        return JSONResponse(streams.chat_completion(ids, got))

    async def completion(self, body: CompletionRequest, request: Request) -> Response:
        self._check(body)
        prompt = await self._off_loop(self._completion_prompt, body.prompt)
        tenant, grammar = _tenant(request, body), structured.requested(body)
        handles, outs = await self._start(
            body, prompt, body.max_tokens, "max_tokens", tenant, grammar
        )
        if body.echo:  # the prompt's own text (decoded, for a prompt of token ids) first
            echo = body.prompt if isinstance(body.prompt, str) else self.tok.decode(prompt)
            outs = [runs.prefixed(echo, run) for run in outs]
        ids = streams.Ids("cmpl-" + uuid.uuid4().hex, self.model_id)
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            merged = choices.merged([runs.errors_as_events(run) for run in outs])
            return EngineStream(handles, streams.completion(ids, merged, len(outs), usage))
        got = await choices.collect(outs, handles, request)
        return JSONResponse(streams.completion_object(ids, got))

    async def response(self, body: ResponsesRequest, request: Request) -> Response:
        self._check(body)
        turns: list[dict[str, Any]] = []
        if body.instructions:
            turns.append({"role": "system", "content": body.instructions})
        if isinstance(body.input, str):
            turns.append({"role": "user", "content": body.input})
        else:
            turns += [{"role": m.role, "content": m.content} for m in body.input]
        prompt = await self._off_loop(self._chat_prompt, turns)
        limit, tenant = body.max_output_tokens, _tenant(request, body)
        grammar = structured.requested(body)
        handles, outs = await self._start(body, prompt, limit, "max_output_tokens", tenant, grammar)
        ids = streams.Ids("resp_" + uuid.uuid4().hex, self.model_id)
        if body.stream:  # one output: n > 1 is refused here
            events = streams.response_events(ids, runs.errors_as_events(outs[0]))
            return EngineStream(handles, events)
        ((got, fin),) = await choices.collect(outs, handles, request)
        return JSONResponse(streams.response_object(ids, got, fin))

    def _chat_grammar(
        self, body: ChatCompletionRequest, offered: list[Any] | None
    ) -> Grammar | None:
        asked = structured.requested(body)
        if not offered:
            return asked
        if asked is not None:
            raise ApiError(
                400,
                f'{asked.field} and tools together are not supported; send tool_choice "none"',
                param=asked.field,
            )
        return structured.tool_grammar(body, offered, self._tags_are_tokens)

    @cached_property
    def _tags_are_tokens(self) -> bool:
        """Whether the vocabulary spells the tool-call tag as one token of its own."""
        return len(self.tok.encode_text(CALL_START)) == 1

    def _constraint(self, grammar: Grammar) -> GrammarConstraint:
        """The request's matcher (the library's view of the vocabulary is built at the first
        constrained request, not at start-up)."""
        try:
            return build_constraint(self.tok, self.vocab_size, grammar)
        except GrammarError as e:
            raise ApiError(400, str(e), param=grammar.field) from e

    # -- checks and prompts ----------------------------------------------------------------
    def _check(self, body: GenerationRequest) -> None:
        if body.model and body.model != self.model_id:
            raise ApiError(
                404,
                f"The model `{body.model}` does not exist; this server serves `{self.model_id}`",
                param="model",
                code="model_not_found",
            )
        unsupported(body)
        check_caps(body)

    def _chat_prompt(
        self, turns: list[dict[str, Any]], offered: list[Any] | None = None
    ) -> list[int]:
        if not self.tok.has_chat_template:
            raise ApiError(400, "this model has no chat template; use /v1/completions")
        messages = [{**t, "content": _text_of(t["content"])} for t in turns]
        self._within_context("".join(m["content"] for m in messages), self.tok.encode_text)
        try:
            return self.tok.chat(messages, offered)
        except _TEMPLATE_ERRORS as e:
            raise ApiError(
                400, f"the chat template refused these messages: {e}", param="messages"
            ) from e

    def _completion_prompt(self, prompt: str | list[str] | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self._within_context(prompt, self.tok.encode)
        if all(isinstance(p, int) for p in prompt):
            ids = [int(p) for p in prompt]
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ApiError(
                    400,
                    f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}",
                    param="prompt",
                )
            return ids
        if len(prompt) != 1:
            raise ApiError(400, f"one prompt per request, got {len(prompt)}", param="prompt")
        return self._within_context(str(prompt[0]), self.tok.encode)

    def _within_context(
        self, text: str, encode: Callable[[str], list[int]], param: str = "prompt"
    ) -> list[int]:
        """encode(text), refusing a text whose head alone fills the context without encoding
        the rest: a megabyte prompt costs the tokenizer seconds and the process its GIL."""
        head = text[: self.max_len * _PROBE_CHARS_PER_TOKEN]
        if len(head) < len(text) and len(encode(head)) >= self.max_len:
            raise ApiError(
                400,
                f"the {param} has more than {self.max_len} tokens; the context holds "
                f"{self.max_len} (a shorter {param} or a server with a larger --ctx-size)",
                param=param,
            )
        return encode(text)

    def _max_tokens(self, prompt_len: int, asked: int | None, param: str) -> int:
        room = self.max_len - prompt_len
        if asked is None:
            return max(room, 1)
        if asked < 1:
            raise ApiError(400, f"{param} must be at least 1, got {asked}", param=param)
        # a prompt that alone overflows gets the engine's own message instead
        if room > 0 and asked > room:
            raise ApiError(
                400,
                f"the context holds {self.max_len} tokens: the prompt has {prompt_len}, so "
                f"{param} can be at most {room}, got {asked}",
                param=param,
            )
        return asked

    def _spec(self, asked: SpeculativeSettings | None) -> SpecParams:
        """The request's speculative settings over the server's (--draft-max etc.)."""
        d = self.spec_defaults
        if asked is None:
            return d
        unknown = [t for t in asked.types or [] if t not in self.spec_types]
        if unknown:
            enabled = ", ".join(self.spec_types) or "none (start the server with --spec-type)"
            raise ApiError(
                400,
                f"speculative types {unknown} are not enabled; enabled: {enabled}",
                param="speculative.types",
            )
        n_max = d.n_max if asked.n_max is None else asked.n_max
        if self.spec_types and n_max > d.n_max:
            raise ApiError(
                400,
                f"speculative.n_max can be at most --draft-max ({d.n_max}), got {n_max}",
                param="speculative.n_max",
            )
        try:
            spec = SpecParams(
                n_max=n_max,
                n_min=d.n_min if asked.n_min is None else asked.n_min,
                p_min=d.p_min if asked.p_min is None else asked.p_min,
                types=None if asked.types is None else tuple(asked.types),
                alternatives=d.alternatives if asked.alternatives is None else asked.alternatives,
            )
        except ValueError as e:
            raise ApiError(400, f"speculative: {e}", param="speculative") from e
        if asked.types == [] or not self.spec_types:
            return SpecParams(n_max=0)
        return spec

    # -- running ---------------------------------------------------------------------------
    async def _start(
        self,
        body: GenerationRequest,
        prompt: list[int],
        asked: int | None,
        param: str,
        tenant: str | None,
        grammar: Grammar | None = None,
    ) -> tuple[list[Handle], list[AsyncIterator[Delta | Finish]]]:
        """Check the settings, submit one request per choice, and wait until the engine has
        taken them."""
        top = logprobs.asked(body)
        params = sampling(body, self._max_tokens(len(prompt), asked, param), top)
        stop, spec = body.stop_strings, self._spec(body.speculative)
        reqs = [
            EngineRequest(prompt, choices.choice_params(params, i), spec, self.tok.eog_ids)
            for i in range(body.choices)
        ]
        for req in reqs:
            req.cache_prompt, req.cache_salt = body.cache_prompt, tenant
        if grammar is not None:  # each choice follows the grammar on its own
            for req in reqs:
                req.constraint = await self._off_loop(self._constraint, grammar)
        if body.prediction is not None:
            text = _text_of(body.prediction.content)
            encode = self.tok.encode_text
            expected = await self._off_loop(self._within_context, text, encode, "prediction")
            check_prediction(len(expected), self.max_len)
            for req in reqs:
                req.prediction = expected
        try:
            handles = self.loop.submit_samples(reqs)
        except QueueFull as e:
            raise ApiError(
                503, str(e), code="server_overloaded", headers={"Retry-After": "1"}
            ) from e
        except EngineFailure as e:
            raise ApiError(503, str(e)) from e
        try:
            for handle in handles:  # all are taken or refused together
                await handle.admitted()
        except SpecserveError as e:
            raise ApiError(400, str(e)) from e
        except EngineFailure as e:
            raise ApiError(503, str(e)) from e
        except asyncio.CancelledError:
            choices.cancel(handles)
            raise
        tok = self.tok if top is not None else None
        return handles, [runs.text_run(h, TextStream(self.tok.decode, stop), tok) for h in handles]


def _tenant(request: Request, body: GenerationRequest) -> str | None:
    """Whose prefixes and drafting knowledge this request may share: its API key's (with
    several keys; set by the transport middleware) and its cache_salt's."""
    key = getattr(request.state, "key_tenant", None)
    if key is None and body.cache_salt is None:
        return None
    return f"{key or ''}|{body.cache_salt or ''}"


def _turn(message: ChatMessage) -> dict[str, Any]:
    """A chat message as the template reads it (a tool call's turn with its calls and ids)."""
    turn: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        turn["tool_calls"] = message.tool_calls
    if message.tool_call_id is not None:
        turn["tool_call_id"] = message.tool_call_id
    return turn


def _text_of(content: str | list[ContentPart] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    kinds = {p.type for p in content} - {"text", "input_text", "output_text"}
    if kinds:
        raise ApiError(
            400,
            f"only text content is supported, got parts of type {sorted(kinds)}",
            param="messages",
        )
    return "".join(p.text or "" for p in content)
