"""The prompt store: a conversation whose slot was reused comes back from host memory and
continues exactly as if it had never left (float64 tiny models, greedy; plain transformer
and hybrid), within a byte budget, per tenant."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specserve.batch import SlotInput
from specserve.cache.memory import Memory
from specserve.cache.store import PromptStore, default_budget
from specserve.engine.engine import Engine
from specserve.engine.request import Request
from specserve.engine.runner import ModelRunner
from specserve.engine.sampling import SamplingParams
from tests.engine.test_prompt_cache import CTX, _engine, _fresh, _model, _request, _tokens

BLOCK = 16  # small blocks, so short prompts span several


def _stored_engine(arch: str, slots: int = 1, spec: str = "", budget: int = 2**26) -> Engine:
    engine = _engine(arch, slots=slots, spec=spec)
    engine.prompts.use_store(PromptStore(budget, block=BLOCK), engine.speculator)
    return engine


def _store(engine: Engine) -> PromptStore:
    assert engine.prompts.store is not None
    return engine.prompts.store


def _logprob_request(prompt: list[int], spec: bool = False) -> Request:
    req = _request(prompt, spec=spec)
    req.params = SamplingParams(temperature=0, max_tokens=24, logprobs=5)
    return req


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_5"])
@pytest.mark.parametrize("spec", ["", "draft"], ids=["plain", "draft-model"])
def test_conversation_restored_from_the_store_continues_bit_identical(arch: str, spec: str) -> None:
    """Conversation A, then B takes A's only slot (A goes to the store), then A's next
    turn: it is restored (only its new message prefilled) and its log-probabilities equal,
    bit for bit, those of the same turn in an engine where A never left its slot."""
    stay = _engine(arch, spec=spec)
    moved = _stored_engine(arch, spec=spec)
    turn1 = _tokens(40, 21)
    (a_stay,) = stay.generate([_logprob_request(turn1, bool(spec))])
    (a_moved,) = moved.generate([_logprob_request(turn1, bool(spec))])
    assert a_moved.output == a_stay.output
    moved.generate([_request(_tokens(30, 22))])  # B takes the slot; A is saved
    assert len(_store(moved)) == 1
    follow = a_stay.context + _tokens(7, 23)
    (again_stay,) = stay.generate([_logprob_request(follow, bool(spec))])
    (again,) = moved.generate([_logprob_request(follow, bool(spec))])
    # the slot holds A's whole context but its last token, or all of it where the answer
    # ended inside a kept draft (its tokens are in memory already)
    held = again_stay.timings.cache_n
    assert held in (len(a_stay.context) - 1, len(a_stay.context))
    assert again.timings.cache_n == held  # from the store, not prefilled again
    assert _store(moved).hits == 1
    assert again.output == again_stay.output == _fresh(arch, follow)
    assert [(lp.token, lp.logprob, lp.top) for lp in again.logprobs] == [
        (lp.token, lp.logprob, lp.top) for lp in again_stay.logprobs
    ]
    if spec:  # the draft model's memory came back too: it drafts at once, as well
        assert again.timings.draft_n_accepted == again_stay.timings.draft_n_accepted


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_5"])
def test_restored_logits_equal_the_slot_that_never_left(arch: str) -> None:
    """Runner level: prefill, save to the store, overwrite the slot, restore into another
    slot, feed the next tokens: logits equal those of the slot that kept its state."""
    runner = ModelRunner(_model(arch), 3, CTX)
    store = PromptStore(2**26, block=BLOCK)
    prompt, more = _tokens(37, 24), _tokens(9, 25)
    runner.prefill(0, prompt)
    runner.prefill(1, prompt)
    assert store.save(runner.memory, 1, prompt, None)
    runner.free(1)
    runner.prefill(1, _tokens(20, 26))
    eid, n = store.match(prompt + more, None)
    assert eid is not None and n == len(prompt)
    store.restore(runner.memory, 2, eid, n)
    (kept,) = runner.forward([_input(0, more)])
    (back,) = runner.forward([_input(2, more)])
    assert torch.equal(kept, back)


def _input(slot: int, tokens: list[int]) -> SlotInput:
    return SlotInput(slot, tokens, len(tokens))


def test_a_recurrent_entry_matches_only_at_its_end() -> None:
    """A hybrid entry holds its recurrent state after all its tokens: a prompt that shares
    less than all of them gets nothing from it, never a state at another position."""
    runner = ModelRunner(_model("qwen3_5"), 2, CTX)
    store = PromptStore(2**26, block=BLOCK)
    prompt = _tokens(40, 27)
    runner.prefill(0, prompt)
    assert store.save(runner.memory, 0, prompt, None)
    assert store.match(prompt[:30] + _tokens(10, 28), None) == (None, 0)
    assert store.match(prompt, None) == (None, 0)  # the last token must be fed: 39 < 40
    eid, n = store.match(prompt + [1], None)
    assert n == len(prompt)
    assert eid is not None
    with pytest.raises(ValueError, match="not 30"):
        store.restore(runner.memory, 1, eid, 30)
    store.restore(runner.memory, 1, eid, n)
    assert runner.memory.restorable(1, n - 1) == 0  # no restore point inside it
    # an attention-only model may use any shared length
    dense = ModelRunner(_model("qwen2"), 1, CTX)
    dstore = PromptStore(2**26, block=BLOCK)
    dense.prefill(0, prompt)
    dstore.save(dense.memory, 0, prompt, None)
    assert dstore.match(prompt[:30] + _tokens(10, 28), None)[1] == 30


def test_hybrid_engine_never_restores_inside_an_entry() -> None:
    engine = _stored_engine("qwen3_5")
    a = _tokens(40, 29)
    (first,) = engine.generate([_request(a)])
    engine.generate([_request(_tokens(30, 30))])  # a goes to the store
    branch = first.context[:30] + _tokens(8, 31)
    (req,) = engine.generate([_request(branch)])
    assert req.timings.cache_n == 0
    assert req.output == _fresh("qwen3_5", branch)


def _filled(prompts: list[list[int]]) -> Memory:
    runner = ModelRunner(_model("qwen2"), len(prompts), CTX)
    for slot, p in enumerate(prompts):
        runner.prefill(slot, p)
    return runner.memory


def _accounted(store: PromptStore) -> int:
    """The store's bytes counted from scratch: every distinct block once, every entry's own."""
    blocks = {bid for e in store.entries.values() for bid in e.blocks}
    per_block = {bid: store._blocks[bid].nbytes for bid in blocks}
    return sum(per_block.values()) + sum(e.own_bytes for e in store.entries.values())


def test_budget_is_never_exceeded_and_eviction_is_lru() -> None:
    prompts = [_tokens(40, 40 + i) for i in range(5)]
    memory = _filled(prompts)
    probe = PromptStore(2**30, block=BLOCK)
    probe.save(memory, 0, prompts[0], None)
    one = probe.bytes
    store = PromptStore(3 * one, block=BLOCK)  # room for three
    for slot in range(3):
        assert store.save(memory, slot, prompts[slot], None)
    eid0 = store.match(prompts[0] + [1], None)[0]
    assert eid0 is not None
    store.restore(memory, 4, eid0, len(prompts[0]))  # 0 is now the most recently used
    assert store.save(memory, 3, prompts[3], None)
    assert store.bytes <= store.budget and store.bytes == _accounted(store)
    assert store.evictions == 1
    held = [e.tokens for e in store.entries.values()]
    assert tuple(prompts[1]) not in held  # the least recently used went first
    assert [tuple(p) for p in (prompts[2], prompts[0], prompts[3])] == held
    assert not PromptStore(one - 1, block=BLOCK).save(memory, 0, prompts[0], None)  # too big


def test_shared_prefixes_are_stored_once() -> None:
    system = _tokens(48, 50)  # three blocks
    a, b = system + _tokens(20, 51), system + _tokens(25, 52)
    memory = _filled([a, b, a[:40]])
    b_alone = PromptStore(2**30, block=BLOCK)
    b_alone.save(memory, 1, b, None)
    store = PromptStore(2**30, block=BLOCK)
    store.save(memory, 0, a, None)
    before = store.bytes
    store.save(memory, 1, b, None)
    block_bytes = store._blocks[store.entries[max(store.entries)].blocks[0]].nbytes
    assert store.bytes - before == b_alone.bytes - 3 * block_bytes
    assert len(store._blocks) == 3 + 1 + 1  # the system prompt's three, one more each
    assert store.bytes == _accounted(store)
    assert store.save(memory, 2, a[:40], None)  # a prefix of an entry: held already
    assert len(store) == 2


def test_an_entry_that_extends_another_replaces_it() -> None:
    a = _tokens(50, 53)
    memory = _filled([a[:40], a])
    store = PromptStore(2**30, block=BLOCK)
    store.save(memory, 0, a[:40], None)
    store.save(memory, 1, a, None)
    assert [e.tokens for e in store.entries.values()] == [tuple(a)]
    assert store.bytes == _accounted(store)


def test_salted_requests_never_match_each_others_entries() -> None:
    prompt = _tokens(40, 60)
    memory = _filled([prompt])
    store = PromptStore(2**30, block=BLOCK)
    store.save(memory, 0, prompt, "tenant-a")
    assert store.match(prompt + [1], "tenant-b") == (None, 0)
    assert store.match(prompt + [1], None) == (None, 0)
    assert store.match(prompt + [1], "tenant-a")[1] == len(prompt)
    blocks = len(store._blocks)
    store.save(memory, 0, prompt, "tenant-b")  # its own entry and its own blocks
    assert len(store._blocks) == 2 * blocks


def test_engine_salts_keep_store_entries_apart() -> None:
    engine = _stored_engine("qwen2")
    a = _tokens(40, 61)
    req = _request(a)
    req.cache_salt = "x"
    (first,) = engine.generate([req])
    engine.generate([_request(_tokens(30, 62))])  # a goes to the store
    other = _request(first.context + [3])
    other.cache_salt = "y"
    (got,) = engine.generate([other])
    assert got.timings.cache_n == 0
    same = _request(first.context + [3])
    same.cache_salt = "x"
    (back,) = engine.generate([same])
    assert back.timings.cache_n == len(first.context) - 1


def test_many_conversations_over_few_slots_all_come_back() -> None:
    """Five conversations take turns on two slots: from the second turn on, each prefills
    only its new message, and its answers are a full prefill's."""
    engine = _stored_engine("qwen2", slots=2)
    convs = [_tokens(30, 70 + i) for i in range(5)]
    held = [0] * 5
    for _turn in range(2):
        for i, conv in enumerate(convs):
            (req,) = engine.generate([_request(conv, n=8)])
            assert req.timings.cache_n == held[i]
            assert req.output == _fresh("qwen2", conv, n=8)
            held[i] = len(req.context) - 1
            convs[i] = req.context + _tokens(5, 80 + i)
    assert _store(engine).hits >= 3
    assert _store(engine).misses == 5  # each first turn: nothing in a slot or the store
    assert _store(engine).bytes <= _store(engine).budget


def test_default_budget_reads_available_memory(tmp_path: Path) -> None:
    info = tmp_path / "meminfo"
    info.write_text("MemTotal: 100 kB\nMemAvailable:    4000 kB\n")
    assert default_budget(str(info)) == 1000 * 1024
    info.write_text("MemAvailable: 999999999 kB\n")
    assert default_budget(str(info)) == 8 * 2**30
    assert default_budget(str(tmp_path / "missing")) == 0
