"""Speculation under a grammar (llguidance): constrained output with drafts equals
constrained output without, token for token, for every kind of grammar, every speculator
and the chain, greedy and sampled; drafts are cut at the first forbidden token, and a run
of forced tokens is verified as one draft instead of one step a token."""

from __future__ import annotations

import json

import pytest
import torch

from specserve.engine.engine import Engine
from specserve.engine.request import Request, SpecParams
from specserve.engine.runner import ModelRunner
from specserve.engine.sampling import SamplingParams
from specserve.grammar.constraint import GrammarConstraint
from specserve.speculative.registry import build_speculator
from tests.speculative.test_exactness import SPECS
from tests.tiny import CHAR_END, VOCAB, char_tokenizer, constraint

CTX = 400
TOKENS = 300  # each reply runs past 128 tokens, or ends where its grammar is whole

# a long reply in each kind of grammar; each leaves the model choices and forces runs
ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["name", "kind", "size", "tags"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "items": ITEM, "minItems": 4, "maxItems": 4}
LONG = "the quick brown fox jumps over the lazy dog and keeps running through the field "
GRAMMARS = {
    "json_schema": ("json_schema", SCHEMA),
    "regex": ("regex", r"(id=[0-9]{2,4}; (ok|fail|retry later)\. ){12}"),
    "choice": ("choice", [LONG * 2 + "north", LONG * 2 + "south", "no " + LONG * 2]),
    "lark": (
        "grammar",
        "start: line line line line line line line line line line+\n"
        'line: "x" /[a-z]{1,5}/ " = " NUM "; "\n'
        "NUM: /[0-9]{1,3}/",
    ),
    "gbnf": ("grammar", 'root ::= ("key_" [a-z]{1,6} ": " [0-9]{1,4} ", "){10,}'),
}


class Watched(GrammarConstraint):
    """A constraint that counts the drafts it cut and the forced runs it offered."""

    cut = 0
    forced_runs = 0

    def valid_prefix(self, draft):  # noqa: ANN001, ANN201
        n = super().valid_prefix(draft)
        Watched.cut += n < len(draft)
        return n

    def forced(self):  # noqa: ANN201
        run = super().forced()
        Watched.forced_runs += len(run) > 1
        return run


def watched(kind: str, source: object) -> Watched:
    c = constraint(kind, source)
    c.__class__ = Watched
    return c  # type: ignore[return-value]


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for n in (40, 55, 47):
        body = torch.randint(32, 127, (n,), generator=g).tolist()
        out.append(body + body[5:25])
    return out


def _generate(model, spec, n_max: int, kind: str, params: SamplingParams, slots: int = 3):  # noqa: ANN001, ANN201
    engine = Engine(ModelRunner(model, num_slots=slots, max_len=CTX), spec)
    reqs = [Request(p, params, SpecParams(n_max=n_max)) for p in _prompts()]
    for r in reqs:
        r.constraint, r.stop_ids = watched(*GRAMMARS[kind]), frozenset({CHAR_END})
    steps = 0
    for r in reqs:
        engine.add_request(r)
    while engine.has_work():
        engine.step()
        steps += 1
    return [r.output for r in reqs], steps


GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS)


@pytest.fixture(scope="module")
def plain(target) -> dict[str, list[list[int]]]:  # noqa: ANN001
    return {kind: _generate(target, None, 0, kind, GREEDY)[0] for kind in GRAMMARS}


def _text(ids: list[int]) -> str:
    return bytes(t for t in ids if t != CHAR_END).decode()


def test_plain_output_follows_each_grammar(plain) -> None:  # noqa: ANN001
    replies = {kind: [_text(o) for o in outs] for kind, outs in plain.items()}
    for reply in replies["json_schema"]:
        items = json.loads(reply)
        assert len(items) == 4 and all(i["kind"] in ("alpha", "beta", "gamma") for i in items)
    assert all(r in GRAMMARS["choice"][1] for r in replies["choice"])
    assert all(r.startswith("id=") for r in replies["regex"])
    # long replies: each grammar's output reaches 128 tokens
    assert all(len(o) >= 128 for outs in plain.values() for o in outs)


@pytest.mark.parametrize("kind", GRAMMARS)
@pytest.mark.parametrize("types", SPECS)
def test_constrained_speculation_equals_plain(
    types: str, kind: str, target, close_draft, plain
) -> None:  # noqa: ANN001, E501
    spec = build_speculator(types.split(","), ModelRunner(close_draft, 3, CTX), draft_cost=0.3)
    assert spec is not None
    assert _generate(target, spec, 16, kind, GREEDY)[0] == plain[kind]


@pytest.mark.parametrize("kind", GRAMMARS)
def test_constrained_speculation_equals_plain_sampled(kind: str, target) -> None:  # noqa: ANN001
    params = SamplingParams(temperature=0.8, top_k=40, seed=9, max_tokens=TOKENS)
    want, _ = _generate(target, None, 0, kind, params)
    spec = build_speculator(["ngram-map-k", "suffix"])
    got, _ = _generate(target, spec, 16, kind, params, slots=1)
    assert got == want


def test_drafts_are_cut_and_forced_runs_take_one_step(target) -> None:  # noqa: ANN001
    """The choice grammar forces all but the first token of its reply: with forced runs
    drafted, a 170-token reply takes a handful of steps, not one a token."""
    Watched.cut = Watched.forced_runs = 0
    plain_out, plain_steps = _generate(target, None, 0, "choice", GREEDY, slots=1)
    out, steps = _generate(target, None, 16, "choice", GREEDY, slots=1)
    assert out == plain_out
    assert Watched.forced_runs > 0
    assert steps * 4 < plain_steps
    spec = build_speculator(["ngram-simple", "suffix"])
    _generate(target, spec, 16, "json_schema", GREEDY)
    assert Watched.cut > 0, "no draft was cut by the grammar"


def test_a_forbidden_argmax_is_masked(target) -> None:  # noqa: ANN001
    """The grammar overrides the model: where its argmax is forbidden, the reply still
    follows the grammar."""
    engine = Engine(ModelRunner(target, num_slots=3, max_len=CTX))
    free = engine.generate(
        [Request(p, SamplingParams(temperature=0, max_tokens=3)) for p in _prompts()]
    )
    assert all(not _text(r.output).startswith("id=") for r in free)
    outs, _ = _generate(target, None, 0, "regex", GREEDY)
    assert all(_text(o).startswith("id=") and _text(o)[3].isdigit() for o in outs)


def test_vocab_covers_the_model_rows() -> None:
    assert len(char_tokenizer().token_bytes(range(VOCAB))) == VOCAB
