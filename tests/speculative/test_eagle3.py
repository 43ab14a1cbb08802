"""`eagle3`: greedy output with an EAGLE-3 head drafting (alone and in the chain) equals
output without speculation, 128 tokens, 1 and 3 slots (tiny float64 models); the head is
fed the taps of the verify forward the engine ran anyway."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specserve.cache.store import PromptStore
from specserve.engine.engine import Engine
from specserve.engine.request import Request, SpecParams
from specserve.engine.runner import ModelRunner
from specserve.engine.sampling import SamplingParams
from specserve.errors import SpecserveError
from specserve.loading.eagle3 import load_eagle3
from specserve.models.eagle3 import Eagle3Head, HeadCalibration
from specserve.speculative.cost import ForwardCost
from specserve.speculative.mtp import CONFIDENCE
from specserve.speculative.registry import build_speculator
from tests.loading.test_eagle3_heads import LAYOUTS
from tests.speculative.cases_seen import CasesSeen
from tests.speculative.test_hybrid_exactness import _models as hybrid_models
from tests.speculative.test_hybrid_exactness import _prompts as hybrid_prompts
from tests.tiny import VOCAB, device_under_test
from tests.tiny_eagle3 import foreseeing_head, nearly_bigram, random_head

N_TOKENS = 128
CTX = 320


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for n in (50, 70, 60):
        body = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        out.append(body + body[5:25])
    return out


def _run(
    model,
    types: str,
    head: Eagle3Head | None,
    prompts,
    n_max: int = 8,
    p_min: float = 0.0,
    **runner_args,
):  # noqa: ANN001, ANN003, ANN201
    runner = ModelRunner(model, num_slots=len(prompts), max_len=CTX, **runner_args)
    if head is not None:
        head = head.to(runner.device)  # the heads are made on the CPU; the target may not be
    spec = (
        build_speculator(types.split(","), target=runner, eagle3_head=head, eagle3_cost=0.05)
        if types
        else None
    )
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS)
    reqs = [Request(p, params, SpecParams(n_max=n_max, p_min=p_min)) for p in prompts]
    # verify rows nearly free, so the head is asked even after misses: more cases covered
    Engine(runner, spec, cost=ForwardCost(measure=False, per_row=0.05)).generate(reqs)
    return [r.output for r in reqs], spec


@pytest.fixture(scope="module")
def bigram(target):  # noqa: ANN001, ANN201
    return nearly_bigram(target)


@pytest.fixture(scope="module")
def reference(bigram) -> list[list[int]]:  # noqa: ANN001
    return [_run(bigram, "", None, [p])[0][0] for p in _prompts()]


SEEN = CasesSeen()
HEADS = {
    "foreseeing": lambda t: foreseeing_head(t, noise=0.6),
    "random": lambda t: random_head(t.cfg, seed=4),
}


@pytest.mark.parametrize("n_max", [1, 8])
@pytest.mark.parametrize("types", ["eagle3", "ngram-map-k,suffix,eagle3"])
@pytest.mark.parametrize("kind", HEADS)
def test_eagle3_equals_plain_greedy(kind: str, types: str, n_max: int, bigram, reference) -> None:  # noqa: ANN001
    head = HEADS[kind](bigram)
    prompts = _prompts()
    out, spec = _run(bigram, types, head, prompts, n_max)
    assert out == reference  # three slots at once
    out1, spec1 = _run(bigram, types, head, prompts[1:2], n_max)
    assert out1 == reference[1:2]  # and one alone
    for s in (spec, spec1):
        assert s is not None
        SEEN.add(s.stats)


@pytest.mark.parametrize("layout", ["specforge", "vllm", "gguf"])
def test_heads_loaded_from_each_layout_keep_greedy_exact(
    layout: str, bigram, reference, tmp_path: Path
) -> None:  # noqa: ANN001
    head = foreseeing_head(bigram, noise=0.3)
    path = LAYOUTS[layout](head, tmp_path)
    loaded = load_eagle3(path, bigram.cfg, torch.float64, device_under_test())
    out, spec = _run(bigram, "eagle3", loaded, _prompts())
    assert out == reference
    assert spec is not None
    SEEN.add(spec.stats)


def _turns(target, store: bool) -> tuple[Request, int, list[int]]:  # noqa: ANN001
    """Turn 1, then (with `store`: another conversation in the one slot, which sends turn
    1's to the prompt store) turn 2 re-sending turn 1 and a new message, on one engine with
    the head and the prompt cache -> (turn 2's request, the tokens turn 1 left fed at
    least, the follow-up prompt)."""
    runner = ModelRunner(target, num_slots=1, max_len=CTX)
    head = foreseeing_head(target, noise=0.3).to(runner.device)
    spec = build_speculator(["eagle3"], target=runner, eagle3_head=head, eagle3_cost=0.05)
    engine = Engine(runner, spec, cost=ForwardCost(measure=False, per_row=0.05))
    if store:
        engine.prompts.use_store(PromptStore(1 << 30), spec)
    params = SamplingParams(temperature=0, max_tokens=40)
    a, b = _prompts()[:2]
    (first,) = engine.generate([Request(a, params, SpecParams(n_max=8))])
    if store:
        engine.generate([Request(b, params, SpecParams(n_max=8))])
    follow = first.context + b[:12]
    (second,) = engine.generate([Request(follow, params, SpecParams(n_max=8))])
    return second, len(first.context) - 1, follow


@pytest.mark.parametrize("store", [False, True], ids=["slot", "store"])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3_5"])
def test_a_follow_up_turn_reuses_its_prefix_and_the_head_drafts_after_it(
    arch: str, store: bool, bigram
) -> None:  # noqa: ANN001
    """The reused prefix has no hidden states here: the head starts after it, and the answer
    equals a full prefill's without speculation (a hybrid target's too)."""
    target = bigram if arch == "qwen2" else hybrid_models(arch)[0]
    second, held, follow = _turns(target, store)
    cached = second.timings.cache_n  # turn 1's last token was fed too where it was drafted
    assert held <= cached < len(follow) and second.timings.prompt_n == len(follow) - cached
    assert second.output == _run(target, "", None, [follow])[0][0][:40]
    assert 0 < second.timings.draft_n_accepted < second.timings.draft_n


@pytest.mark.parametrize("rollback", ["snapshots", "checkpoint"])
def test_hybrid_target_with_eagle3_equals_plain(rollback: str) -> None:
    """Qwen3.5 (Gated DeltaNet + gated attention): the head taps its layers while the
    target's recurrent state goes back by snapshots or checkpoint and replay."""
    target, _ = hybrid_models("qwen3_5")
    prompts = hybrid_prompts()
    plain, _ = _run(target, "", None, prompts, rollback=rollback)
    head = foreseeing_head(target, noise=0.3)
    out, spec = _run(target, "eagle3", head, prompts, rollback=rollback)
    assert out == plain
    assert spec is not None and spec.stats.tokens_accepted > 0
    SEEN.add(spec.stats)


def test_an_unsure_head_still_drafts_its_first_token_labelled_by_confidence(
    bigram,
    reference,  # noqa: ANN001
) -> None:
    """p_min 1: the head is never sure. Its first tokens are drafted all the same, in
    confidence tiers whose rates are learnt apart; no draft goes past its first token."""
    head = foreseeing_head(bigram, noise=0.6)
    with torch.no_grad():
        head.lm_head.weight.mul_(6.0)  # the same argmax, sure on some tokens and not others
    out, spec = _run(bigram, "eagle3", head, _prompts(), p_min=1.0)
    assert out == reference
    assert spec is not None and spec.stats.tokens_accepted > 0
    assert len(spec.stats.proposed_per_pos) == 1
    assert len(spec.rates.tiers) > 1 and set(spec.rates.tiers) <= {1, 2, 3, 4, 5}


def test_empty_rejected_and_full_drafts_all_occurred() -> None:
    """Runs after the parametrized cases above (pytest keeps file order)."""
    SEEN.assert_all_occurred()


def test_foreseeing_head_is_mostly_right(bigram) -> None:  # noqa: ANN001
    """The drafts are kept often: the head really drafts from what it is fed."""
    _, spec = _run(bigram, "eagle3", foreseeing_head(bigram), _prompts())
    assert spec is not None and spec.stats.acceptance_rate > 0.3


def test_eagle3_and_mtp_together_are_refused(bigram) -> None:  # noqa: ANN001
    runner = ModelRunner(bigram, num_slots=1, max_len=CTX)
    with pytest.raises(SpecserveError, match="pick one"):
        build_speculator(["mtp", "eagle3"], target=runner, eagle3_head=random_head(bigram.cfg))
    with pytest.raises(SpecserveError, match="needs --draft-model"):
        build_speculator(["eagle3"], target=runner)


def test_runners_over_one_model_keep_their_own_taps(bigram) -> None:  # noqa: ANN001
    """A benchmark builds engines over one loaded model in turn: one without a head must
    not go on tapping (nor hand an MTP head the taps) after one with a head."""
    prompt = _prompts()[0]
    with_head = ModelRunner(bigram, num_slots=1, max_len=CTX)
    build_speculator(["eagle3"], target=with_head, eagle3_head=random_head(bigram.cfg))
    plain, final = (ModelRunner(bigram, num_slots=1, max_len=CTX) for _ in range(2))
    final.record_hidden = True  # as an MTP head asks
    width = bigram.cfg.hidden_size
    handed: list[object] = []  # the taps each forward was handed
    hook = bigram.register_forward_pre_hook(
        lambda _m, _a, kwargs: handed.append(kwargs.get("taps")), with_kwargs=True
    )
    try:
        for runner, taps in ((with_head, 3), (plain, 0), (final, 0), (with_head, 3)):
            runner.prefill(0, prompt)
            assert (handed[-1] is not None) == (taps > 0)
            if runner.record_hidden:
                _, rows = runner.take_hidden(0)
                assert rows.shape == (len(prompt), width * max(1, taps))
    finally:
        hook.remove()


def test_engine_settings_load_the_head_named_by_draft_model(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """`--spec-type eagle3 --draft-model HEAD` as llama.cpp's -md; by default the model's
    own head, `<model>-eagle3` in the cache."""
    from specserve.engine.setup import EngineSettings, build_engine
    from specserve.loading.eagle3 import save_eagle3
    from specserve.loading.model import LoadedModel
    from specserve.speculative.cost import SEED_ROWS
    from tests.tiny import write_hf_folder

    write_hf_folder("qwen2", tmp_path / "tiny", seed=11)
    from specserve.loading.model import load_model

    target = load_model(tmp_path / "tiny", "float64", with_tokenizer=False)
    save_eagle3(random_head(target.cfg), tmp_path / "head")
    s = EngineSettings(str(tmp_path / "tiny"), "float64", spec_types=("eagle3",),
                       draft_model=str(tmp_path / "head"), ctx_size=CTX)  # fmt: skip
    assert s.spec_types == ("eagle3",) and s.draft_head == str(tmp_path / "head")
    engine, _ = build_engine(s, target=target, progress=False)
    assert engine.speculator is not None and engine.speculator.name == "eagle3"
    # its verify rows are priced by forwards timed before serving (speculative/cost.py)
    assert [n for n, _ in engine.cost._known()] == [n for n in SEED_ROWS if n <= CTX]
    assert engine.runner.memory.length(0) == 0  # the timed slot is free again
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    s = EngineSettings(str(tmp_path / "tiny"), "float64", spec_types=("eagle3",), ctx_size=CTX)
    with pytest.raises(SpecserveError, match="no EAGLE-3 head 'tiny-eagle3'"):
        build_engine(s, target=LoadedModel(target.model, None, target.path), progress=False)
    save_eagle3(random_head(target.cfg), tmp_path / "cache" / "heads" / "tiny-eagle3")
    engine, _ = build_engine(s, target=target, progress=False)
    assert engine.speculator is not None and engine.speculator.name == "eagle3"


def test_the_default_chain_takes_in_the_models_own_head(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """`serve` without --spec-type: the default chain, plus eagle3 once train-head has saved
    the model's head (not while its first run trains); an explicit --spec-type is kept as
    given."""
    from specserve.cli import build_parser
    from specserve.engine.flags import spec_types_from_args
    from specserve.server.cli_args import DEFAULT_SPEC

    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    args = build_parser().parse_args(["serve", "--model", "some/tiny.gguf"])
    default = tuple(DEFAULT_SPEC.split(","))
    assert spec_types_from_args(args) == default
    head = tmp_path / "heads" / "tiny-eagle3"
    head.mkdir(parents=True)
    (head / "checkpoint.pt").write_bytes(b"")  # a first train-head run, not done yet
    assert spec_types_from_args(args) == default
    (head / "config.json").write_text("{}")  # save_eagle3 writes it last
    assert spec_types_from_args(args) == (*default, "eagle3")
    explicit = build_parser().parse_args(["serve", "-m", "some/tiny.gguf", "--spec-type", "suffix"])
    assert spec_types_from_args(explicit) == ("suffix",)
    generate = build_parser().parse_args(["generate", "-m", "some/tiny.gguf", "--prompt", "x"])
    assert spec_types_from_args(generate) == ()  # its default is no speculation


def test_a_models_own_head_keeps_the_dots_of_its_name() -> None:
    from specserve.loading.eagle3 import own_head_name

    assert own_head_name("qwen2.5-coder-0.5b") == "qwen2.5-coder-0.5b-eagle3"
    assert (
        own_head_name("/m/qwen2.5-coder-0.5b-instruct.gguf") == "qwen2.5-coder-0.5b-instruct-eagle3"
    )
    assert own_head_name("/m/Qwen2.5-0.5B") == "Qwen2.5-0.5B-eagle3"


def _calibrated(head: Eagle3Head, kept: tuple[int, ...], rows: tuple[int, ...]) -> Eagle3Head:
    head.calibration = HeadCalibration(CONFIDENCE, kept, rows, 0.75, 180, 192)
    return head


def test_a_heads_record_gives_its_drafts_first_rates(bigram) -> None:  # noqa: ANN001
    """Class 0.4-0.6 kept 28 of 92 first tokens on held-out text, and 180 of 192 later
    tokens past p_min were kept: with CALIBRATION_WEIGHT 8 rows at the promise (0.5, and
    p_min), a fresh speculator expects (28 + 4) / 100 and (180 + 6) / 200 of them."""
    runner = ModelRunner(bigram, num_slots=1, max_len=CTX)
    plain = build_speculator(["eagle3"], target=runner, eagle3_head=random_head(bigram.cfg))
    head = _calibrated(random_head(bigram.cfg), (0, 0, 28, 0, 0), (0, 0, 92, 0, 0))
    measured = build_speculator(["eagle3"], target=runner, eagle3_head=head)
    assert plain is not None and measured is not None
    assert plain.acceptance_rates(0, 2, 3) == pytest.approx([0.5, 0.25])
    assert measured.acceptance_rates(0, 2, 3) == pytest.approx([0.32, 0.32 * 0.93])
    assert measured.acceptance_rates(0, 1, 5) == pytest.approx([0.9])  # no rows: its promise
    assert measured.acceptance_rates(0, 1, 0) == pytest.approx([(28 + 4) / (92 + 8)])  # sampled
    # every held-out first token fell in class 3, so that is where its drafts are expected
    assert measured.rates.first_shares == {1: 0.0, 2: 0.0, 3: 1.0, 4: 0.0, 5: 0.0}
    assert plain.rates.first_shares == {}


def test_a_head_whose_record_is_wrong_is_overruled_by_the_text(bigram, reference) -> None:  # noqa: ANN001
    """A mostly-right head recorded as never right: its drafts are not verified at first,
    but their first tokens are checked all the same (rates.py), so it is verified and kept
    again once the text shows them right; the output is plain decoding's throughout."""
    _, trusted = _run(bigram, "eagle3", foreseeing_head(bigram), _prompts())
    wrong = _calibrated(foreseeing_head(bigram), (0,) * 5, (1000,) * 5)
    out, doubted = _run(bigram, "eagle3", wrong, _prompts())
    assert out == reference
    assert trusted is not None and doubted is not None
    assert doubted.stats.drafts_generated < trusted.stats.drafts_generated
    assert doubted.stats.acceptance_rate > 0.3
