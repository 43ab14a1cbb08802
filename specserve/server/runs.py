"""An engine request's events -> the run a response is built from: text `Delta`s, then one
`Finish` (server/streams.py turns a run into a body or a stream).

The text comes from one `TextStream`, token by token, so a stop string ends the text, the
token count and the logprobs where decoding without drafts would. A step's accepted draft
tokens and the target's own token go out as separate deltas, each saying how many tokens
it carries and how many were drafted (by which speculator type), so a client can show
which text came from drafts.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from specserve.loading.tokenizer import Tokenizer
from specserve.server import logprobs
from specserve.server.events import EngineFailure, Event
from specserve.server.loop import Handle
from specserve.server.replies import ChunkSpeculation, joined
from specserve.server.streams import Delta, Finish
from specserve.server.text import TextStream


def _parts(event: Event) -> list[tuple[list[int], str]]:
    """The event's tokens by origin: its accepted drafts (they come first), then the rest."""
    d = event.drafted
    parts = [(event.tokens[:d], event.drafted_by), (event.tokens[d:], "")]
    return [p for p in parts if p[0]]


def _counted(origin: ChunkSpeculation | None, n: int, by: str) -> ChunkSpeculation | None:
    """origin plus n tokens (drafted by `by`; "" for the target's own)."""
    part = ChunkSpeculation(tokens=n, drafted=n if by else 0, type=by or None)
    return joined(origin, part)


async def text_run(
    handle: Handle, text: TextStream, tok: Tokenizer | None
) -> AsyncIterator[Delta | Finish]:
    """Text deltas (with their tokens' logprobs when `tok` is given) as the engine produces
    them, then one Finish. Tokens whose text is held back (a possible stop string, an
    unfinished character) are counted in the next delta that has text."""
    prompt_n = len(handle.request.prompt)
    held: ChunkSpeculation | None = None
    async for event in handle.events():
        at = 0  # tokens of this event taken so far
        for ids, by in _parts(event):
            delta, used = text.push_each(ids)
            held = _counted(held, used, by)
            items = None if tok is None else logprobs.to_openai(tok, event.logprobs[at : at + used])
            at += used
            if delta or items:
                yield Delta(delta, items, origin=held)
                held = None
            if text.stopped:
                break
        if text.stopped:
            handle.cancel()  # a stop string ended it: free the slot now
        tail = text.flush() if event.finished and not text.stopped else ""
        if tail or (held and (text.stopped or event.finished)):
            yield Delta(tail, None if tok is None else [], origin=held)
            held = None
        if text.stopped or event.finished:
            reason = "stop" if text.stopped else event.finish_reason or "stop"
            timings = event.timings or handle.request.timings.as_dict()
            yield Finish(reason, prompt_n, text.n_tokens, timings)
            return


async def prefixed(first: str, run: AsyncIterator[Delta | Finish]) -> AsyncIterator[Delta | Finish]:
    if first:
        yield Delta(first)
    async for item in run:
        yield item


async def errors_as_events(
    run: AsyncIterator[Delta | Finish],
) -> AsyncIterator[Delta | Finish | Exception]:
    """Once a stream has started, an engine failure can only be reported inside it."""
    try:
        async for item in run:
            yield item
    except EngineFailure as e:
        yield e
