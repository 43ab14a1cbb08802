"""--share-outputs without Ray: what one server finished reaches another's suffix tree
through the board's log (cluster/board.py), and drafts from it there stay exact."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

from specserve.cluster.board import Board
from specserve.errors import SpecserveError
from specserve.loading.model import LoadedModel
from specserve.server.exchange import OutputExchange
from tests.server.conftest import LiveServer, start_server

PROMPT = "tell me a long story about the sea"


@pytest.fixture
def servers(tiny_model: LoadedModel) -> Iterator[list[LiveServer]]:
    made = [start_server(tiny_model, parallel=1, spec_types=("suffix",)) for _ in range(3)]
    for s in made[:2]:
        s.loop.exchange = OutputExchange()
    yield made
    for s in made:
        s.stop()


def complete(server: LiveServer) -> tuple[str, int]:
    """(text, tokens the speculator had accepted after it) of one greedy completion."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 96, "temperature": 0}
    r = httpx2.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    spec = server.loop.engine.speculator
    assert spec is not None
    return r.json()["choices"][0]["text"], spec.stats.tokens_accepted


def test_outputs_shared_through_the_board_draft_exactly(servers: list[LiveServer]) -> None:
    a, b, alone = servers
    assert a.loop.exchange is not None and b.loop.exchange is not None
    text, _ = complete(a)
    board = Board()
    cursor_a, theirs = board.exchange("a", a.loop.exchange.take(), 0)
    assert theirs == [] and cursor_a == 1 and a.loop.exchange.sent == 1
    _, theirs = board.exchange("b", b.loop.exchange.take(), 0)
    assert len(theirs) == 1 and theirs[0][0] is None  # the default tenant's output
    b.loop.exchange.give(theirs)
    shared_text, shared_accepted = complete(b)  # learned between its inbox and first step
    alone_text, alone_accepted = complete(alone)
    assert b.loop.exchange.learned == 1
    assert shared_text == text == alone_text  # drafts from the shared output are exact
    n = len(theirs[0][1])
    assert shared_accepted >= 0.8 * n  # it drafts the answer it was told of
    assert shared_accepted > alone_accepted


def test_salted_outputs_stay_with_their_tenant(servers: list[LiveServer]) -> None:
    """A salted request's output goes out with its tenant, and reaches only that tenant."""
    a, b, alone = servers
    assert a.loop.exchange is not None and b.loop.exchange is not None
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "cache_salt": "x"}
    assert httpx2.post(f"{a.url}/v1/completions", json=body, timeout=60).status_code == 200
    out = a.loop.exchange.take()
    assert len(out) == 1 and out[0][0] is not None and "x" in out[0][0]
    b.loop.exchange.give(out)
    complete(b)  # the engine thread applies the inbox before this request's first step
    complete(alone)
    spec, own = b.loop.engine.speculator, alone.loop.engine.speculator
    assert spec is not None and own is not None and b.loop.exchange.learned == 1
    # the default tenant's tree holds what a server that was told nothing holds
    assert spec.global_tokens == own.global_tokens > 0  # type: ignore[attr-defined]


def test_bench_spec_shared_config_learns_the_reference(tiny_folder: Path) -> None:
    """`bench spec --spec-types shared:CHAIN`: the chain is told the reference's output
    first; its run stays exact and drafts it; a chain that learns nothing is refused."""
    from specserve.bench.spec import Session
    from specserve.bench.spec_rounds import alone
    from specserve.cli import build_parser

    model = str(tiny_folder)
    argv = ["bench", "spec", "--models", model, "--dtype", "float64", "--weights", "dequant"]
    session = Session(build_parser().parse_args([*argv, "--max-tokens", "64"]))
    prompt = session.prompt(model, "prose")
    ref = alone(session.start(model, "none", prompt))
    told = alone(session.start(model, "shared:suffix", prompt, learned=ref.tokens))
    fresh = alone(session.start(model, "suffix", prompt))
    assert told.tokens == ref.tokens == fresh.tokens
    assert told.stats is not None and fresh.stats is not None
    assert told.stats["tokens_accepted"] >= 0.75 * len(ref.tokens)  # type: ignore[operator]
    assert told.stats["tokens_accepted"] > fresh.stats["tokens_accepted"]  # type: ignore[operator]
    with pytest.raises(SpecserveError, match="learns"):
        session.start(model, "shared:ngram-map-k", prompt, learned=ref.tokens)
