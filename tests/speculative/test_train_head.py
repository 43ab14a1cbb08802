"""`specserve train-head` on a tiny model: a few steps of training-time-test training on
the model's own greedy text, resumed from its checkpoint, saved in the public layout, then
loaded and drafting (greedy output still exact)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest
import torch

from specserve.bench import head_data, row_cache, train_head
from specserve.bench.row_cache import RowCache
from specserve.engine.engine import Engine
from specserve.engine.request import Request
from specserve.engine.runner import ModelRunner
from specserve.engine.sampling import SamplingParams
from specserve.errors import SpecserveError
from specserve.loading.eagle3 import load_eagle3
from specserve.loading.model import LoadedModel
from specserve.speculative import head_training as ht
from tests.tiny import VOCAB
from tests.tiny_eagle3 import nearly_bigram


def _own_text(model, n: int = 12, length: int = 48) -> list[list[int]]:  # noqa: ANN001
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (8,), generator=g).tolist() for _ in range(n)]
    reqs = [Request(p, SamplingParams(temperature=0, max_tokens=length)) for p in prompts]
    Engine(ModelRunner(model, 4, 64)).generate(reqs)
    return [r.prompt + r.output for r in reqs]


def _args(**kw) -> argparse.Namespace:  # noqa: ANN003
    p = argparse.ArgumentParser()
    train_head.add_args(p)
    # argmax labels: the tiny model's next-token distribution is nearly flat (its top token
    # ~4 %), so its top-k teaches a flat head whose argmax is noise
    argv = ["--model", "tiny", "--draft-vocab", "100", "--steps", "3", "--soft-top", "0"]
    return p.parse_args([*argv, *kw.pop("argv", [])])


def test_unrolled_steps_see_what_drafting_sees(target) -> None:  # noqa: ANN001
    """Every unrolled step equals the head's cached forward as serving drafts: step 0 over
    the rows the target's states make, then step j fed token x_{i+1+j} and the pre-norm
    state step j - 1 left (the training-time test trains exactly what serving computes)."""
    from specserve.batch import FlatBatch

    model = nearly_bigram(target).float()
    seq = _own_text(model, n=1)[0]
    rows = ht.target_rows(model, seq, (2, 1, 0))
    head = ht.new_head(model, torch.arange(100))
    with torch.no_grad():  # off its start, so later steps differ from step 0
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    pairs = ht.unrolled_logits(head, model.embed, rows, 3)
    assert pairs[0][1].tolist() == rows.labels[1:].tolist()
    cpu = torch.device("cpu")
    for i in (0, 7, 20):
        cache = head.new_cache(1, len(seq) + 4)
        with torch.no_grad():
            batch = FlatBatch.build([0], [0], [i + 1], cpu)
            g = head.fuse(rows.aux[: i + 1])
            normed, pre = head(model.embed(rows.tokens[1 : i + 2]), g, batch, cache)
            assert torch.allclose(head.lm_head(normed[-1]), pairs[0][0][i], atol=1e-5)
            for j in (1, 2):
                batch = FlatBatch.build([0], [i + j], [1], cpu)
                token = rows.tokens[i + 1 + j : i + 2 + j]
                normed, pre = head(model.embed(token), pre[-1:], batch, cache)
                assert torch.allclose(head.lm_head(normed[-1]), pairs[j][0][i], atol=1e-5)
                assert pairs[j][1][i] == rows.labels[i + 1 + j]


@pytest.mark.parametrize("step", [0, 1])
def test_every_weight_of_the_head_learns_from_every_unrolled_step(target, step: int) -> None:  # noqa: ANN001
    """In float32 on the CPU the norms and the rotary run on our kernels, which have no
    backward: they cut the graph, and for a whole series of runs only the LM head trained
    (the layer stayed as new_head left it, so step 1 said step 0's token again)."""
    model = nearly_bigram(target).float()
    rows = ht.target_rows(model, _own_text(model, n=1)[0], (2, 1, 0))
    head = ht.new_head(model, torch.arange(VOCAB))
    logits, labels = ht.unrolled_logits(head, model.embed, rows, 2)[step]
    torch.nn.functional.cross_entropy(logits, labels).backward()
    still = [n for n, p in head.named_parameters() if p.grad is None or not p.grad.any()]
    assert still == []


def test_train_resume_save_and_draft(target, tmp_path: Path) -> None:  # noqa: ANN001
    model = nearly_bigram(target).float()
    loaded = LoadedModel(model, None, tmp_path / "tiny")
    seqs = _own_text(model)
    far = time.monotonic() + 600
    first = train_head.train(loaded, list(seqs), tmp_path, _args(argv=["--max-steps", "30"]), far)
    assert first["steps"] == 30 and 0.0 <= first["top1"] <= 1.0
    assert len(first["per_position"]) == train_head.EVAL_DEPTH
    again = train_head.train(loaded, list(seqs), tmp_path, _args(argv=["--max-steps", "60"]), far)
    assert again["steps"] == 60  # resumed from the checkpoint's 30
    # a resume peaks lower than a fresh run: at the full rate it undid what the first learnt
    lr, resumed = train_head.LR, train_head.LR * train_head.RESUME_LR
    assert first["lr_peak"] > 0.9 * lr and 0.5 * resumed < again["lr_peak"] <= resumed
    assert first["loss_last"] < first["loss_first"]  # it learns
    assert again["top1"] > 0.3  # and drafts the nearly-bigram model's next tokens
    head = load_eagle3(tmp_path, model.cfg, torch.float32)
    cal = head.calibration  # measured as the held-out acceptance was, and saved beside it
    assert cal is not None and sum(cal.first_rows) == again["rows"]
    assert sum(cal.first_kept) / again["rows"] == pytest.approx(again["top1"])
    evaluated = train_head.train(
        loaded, list(seqs), tmp_path, _args(argv=["--max-steps", "60"]), far
    )
    assert evaluated["steps"] == 60 and evaluated["top1"] == again["top1"]
    assert evaluated["loss_last"] == again["loss_last"]  # a run that trained nothing keeps it
    from tests.speculative.test_eagle3 import _prompts, _run

    plain, _ = _run(model, "", None, _prompts()[:2])
    out, spec = _run(model, "eagle3", head, _prompts()[:2])
    assert out == plain
    assert spec is not None and spec.stats.tokens_accepted > 0


def test_a_given_lr_is_the_peak_fresh_or_resumed() -> None:
    assert train_head.peak_lr(1e-3, resumed=True) == train_head.peak_lr(1e-3, resumed=False) == 1e-3
    assert train_head.peak_lr(None, resumed=True) < train_head.peak_lr(None, resumed=False)


def test_without_max_steps_the_time_budget_alone_bounds_training(  # noqa: ANN201
    target,  # noqa: ANN001
    tmp_path: Path,
):
    # --max-steps 0 (the default) once ended the loop before its first step
    model = nearly_bigram(target).float()
    loaded = LoadedModel(model, None, tmp_path / "tiny")
    report = train_head.train(
        loaded, list(_own_text(model)), tmp_path, _args(argv=[]), time.monotonic() + 3
    )
    assert report["steps"] > 0 and report["tokens"] > 0


def test_a_second_epoch_reuses_the_targets_rows(  # noqa: ANN201
    target,  # noqa: ANN001
    tmp_path: Path,
    monkeypatch,  # noqa: ANN001
):
    model = nearly_bigram(target).float()
    loaded = LoadedModel(model, None, tmp_path / "tiny")
    seqs = _own_text(model, n=6, length=16)
    held = [(seqs[0], 0)]
    calls = []
    real = ht.target_rows

    def counted(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(ht, "target_rows", counted)
    # the rows' budget alone decides: on a machine short of RAM none would be kept
    monkeypatch.setattr(row_cache, "available_memory", lambda: None)
    far = time.monotonic() + 600
    for budget, forwards in (("6", 6 + 1), ("0", 12 + 1)):  # two epochs of 6, the held one
        calls.clear()
        argv = ["--max-steps", "12", "--row-cache-gb", budget]
        (tmp_path / budget).mkdir()
        train_head.train(loaded, list(seqs), tmp_path / budget, _args(argv=argv), far, held)
        assert len(calls) == forwards


def test_soft_labels_that_are_one_hot_give_the_argmax_loss(target) -> None:  # noqa: ANN001
    """The soft cross-entropy is the hard one when the target is sure; and the target's
    top-k mass learns the head toward its distribution, not only its argmax."""
    model = nearly_bigram(target).float()
    seq = _own_text(model, n=1)[0]
    rows = ht.target_rows(model, seq, (2, 1, 0), top=4)
    assert rows.soft_ids is not None and rows.soft_p is not None
    assert rows.soft_ids[:, 0].tolist() == rows.labels.tolist()
    assert torch.all(rows.soft_p[:, :-1] >= rows.soft_p[:, 1:])
    head = ht.new_head(model, torch.arange(100))
    t2d = torch.full((VOCAB,), -1, dtype=torch.long)
    t2d[:100] = torch.arange(100)
    pairs = ht.unrolled_logits(head, model.embed, rows, 2)
    sure = ht.TargetRows(
        rows.tokens,
        rows.aux,
        rows.labels,
        soft_ids=rows.labels[:, None],
        soft_p=torch.ones(len(seq), 1),
    )
    hard = ht.ttt_loss(head, t2d, pairs)
    assert torch.allclose(ht.ttt_loss(head, t2d, pairs, sure), hard)
    soft = ht.ttt_loss(head, t2d, pairs, rows)
    assert not torch.allclose(soft, hard)


def test_feature_loss_pulls_step_zero_toward_the_next_rows_state(target) -> None:  # noqa: ANN001
    """Zero exactly when step 0's state at row i is the fused target state of row i + 1;
    its gradient reaches the head's step, not the fused state it is measured against."""
    model = nearly_bigram(target).float()
    seq = _own_text(model, n=1)[0]
    rows = ht.target_rows(model, seq, (2, 1, 0))
    head = ht.new_head(model, torch.arange(100))
    u = ht.unrolled(head, model.embed, rows, 2)
    assert u.prenorm0 is not None and u.prenorm0.shape == u.fused.shape
    loss = ht.feature_loss(u)
    assert loss is not None and float(loss.detach()) > 0
    loss.backward()
    assert head.mlp.down.weight.grad is not None and head.mlp.down.weight.grad.abs().sum() > 0
    fused = u.fused.detach()
    exact = ht.Unrolled(u.pairs, fused, torch.cat([fused[1:], fused[:1]]))
    assert float(ht.feature_loss(exact)) == 0.0  # type: ignore[arg-type]
    assert ht.feature_loss(exact, start=len(seq)) is None  # no row has a next row


def test_feature_weight_trains_step_zero_toward_the_next_state(  # noqa: ANN201
    target,  # noqa: ANN001
    tmp_path: Path,
):
    """The same run with and without the feature loss: with it, step 0's states end nearer
    the next rows' fused states; the report counts how often a step repeats the one before."""
    model = nearly_bigram(target).float()
    loaded = LoadedModel(model, None, tmp_path / "tiny")
    seqs = _own_text(model)
    far = time.monotonic() + 600
    gap = {}
    for weight in ("0", "3"):
        out = tmp_path / weight
        out.mkdir()
        argv = ["--max-steps", "60", "--lr", "1e-3", "--feature-weight", weight]
        report = train_head.train(loaded, list(seqs), out, _args(argv=argv), far)
        assert len(report["step_repeats"]) == 3  # steps 1-3 against the step before
        assert all(0.0 <= r <= 1.0 for r in report["step_repeats"])
        head = load_eagle3(out, model.cfg, torch.float32)
        with torch.no_grad():
            losses = []
            for s in seqs:
                rows = ht.target_rows(model, s, head.cfg.aux_layers)
                losses.append(ht.feature_loss(ht.unrolled(head, model.embed, rows, 1)))
        gap[weight] = float(torch.stack([x for x in losses if x is not None]).mean())
    assert gap["3"] < 0.8 * gap["0"], gap


def test_taps_choose_the_layers_read_and_a_resumed_run_keeps_them(  # noqa: ANN201
    target,  # noqa: ANN001
    tmp_path: Path,
):
    """`--taps` picks the target layers the head reads; fc starts as the identity on the
    highest of them; the saved head names them; a resume keeps the first run's."""
    model = nearly_bigram(target).float()
    top = model.cfg.num_layers - 1
    head = ht.new_head(model, torch.arange(100), aux=(top, 0, 1))
    h = model.cfg.hidden_size
    assert torch.equal(head.fc.weight[:, :h], torch.eye(h))
    assert not head.fc.weight[:, h:].any()
    loaded = LoadedModel(model, None, tmp_path / "tiny")
    seqs = _own_text(model, n=4, length=16)
    far = time.monotonic() + 600
    argv = ["--max-steps", "2", "--taps", f"0,1,{top}"]
    train_head.train(loaded, list(seqs), tmp_path, _args(argv=argv), far)
    assert load_eagle3(tmp_path, model.cfg, torch.float32).cfg.aux_layers == (0, 1, top)
    argv = ["--max-steps", "4", "--taps", "0,0,0"]  # ignored: the checkpoint's win
    train_head.train(loaded, list(seqs), tmp_path, _args(argv=argv), far)
    assert load_eagle3(tmp_path, model.cfg, torch.float32).cfg.aux_layers == (0, 1, top)
    for bad in (f"0,1,{top + 1}", "0,1", "a,b,c"):
        with pytest.raises(SpecserveError, match="--taps"):
            train_head.taps(bad, model.cfg.num_layers)


def test_answers_are_made_once_and_read_back(  # noqa: ANN201
    target,  # noqa: ANN001
    tmp_path: Path,
    monkeypatch,  # noqa: ANN001
):
    """A second run with the same model, count, length and seed decodes nothing, and any
    run decodes only the prompts no cached file answered, whatever its ask set or seed."""
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    made = []

    class Chat:  # a prompt's ids spell its message
        eog_ids = frozenset({1})

        def chat(self, messages: list[dict[str, str]]) -> list[int]:
            return [ord(c) for c in messages[0]["content"]]

    def reply(prompt: list[int]) -> list[int]:
        return [len(prompt), *prompt[-4:]]

    def fake(loaded, prompts, max_tokens, stop_ids):  # noqa: ANN001, ANN202
        assert stop_ids == Chat.eog_ids
        made.append(len(prompts))
        return [(p, reply(p)) for p in prompts]

    def expected(n: int, seed: int) -> list[tuple[list[int], list[int]]]:
        prompts = [[ord(c) for c in q] for q in head_data.asks(n, seed)]
        return [(p, reply(p)) for p in prompts]

    monkeypatch.setattr(head_data, "answers", fake)
    loaded = LoadedModel(nearly_bigram(target).float(), Chat(), tmp_path / "tiny")  # type: ignore[arg-type]
    first = head_data.cached_answers(loaded, "tiny", 3, 8, 5)
    again = head_data.cached_answers(loaded, "tiny", 3, 8, 5)
    assert first == again == expected(3, 5) and made == [3]
    # another seed's asks: only those the first file did not answer are decoded
    other = head_data.cached_answers(loaded, "tiny", 3, 8, 6)
    assert other == expected(3, 6) != first
    assert made == [3, 3 - len(set(head_data.asks(3, 5)) & set(head_data.asks(3, 6)))]
    # more answers of the same ask set: only the new asks are decoded
    more = head_data.cached_answers(loaded, "tiny", 5, 8, 5)
    assert more == expected(5, 5) and more[:3] == first
    assert made[-1] == 2
    # the same prompts in another order (another version's ask list): all read back
    before = len(made)
    reordered = list(reversed(head_data.asks(5, 5)))
    with monkeypatch.context() as m:
        m.setattr(head_data, "asks", lambda n, seed: reordered[:n])
        again = head_data.cached_answers(loaded, "tiny", 5, 8, 5)
    assert again == list(reversed(expected(5, 5))) and len(made) == before
    # a new version's ask set: its prompts no file answered are decoded, the rest read back
    answered = set(head_data.asks(5, 5)) | set(head_data.asks(3, 6))
    monkeypatch.setattr(head_data, "TOPICS", ["a well-kept secret"])
    newer = head_data.asks(3, 5)
    assert head_data.cached_answers(loaded, "tiny", 3, 8, 5) == expected(3, 5)
    assert made[-1] == len(set(newer) - answered) > 0


def test_step_weights_weigh_each_unrolled_steps_loss(target) -> None:  # noqa: ANN001
    model = nearly_bigram(target).float()
    rows = ht.target_rows(model, _own_text(model, n=1)[0], (2, 1, 0))
    head = ht.new_head(model, torch.arange(100))
    t2d = torch.full((VOCAB,), -1, dtype=torch.long)
    t2d[:100] = torch.arange(100)
    pairs = ht.unrolled_logits(head, model.embed, rows, 2)
    first, second = (ht.ttt_loss(head, t2d, [p]) for p in pairs)
    assert torch.allclose(ht.ttt_loss(head, t2d, pairs), (first + second) / 2)
    assert torch.allclose(ht.ttt_loss(head, t2d, pairs, weights=[1.0, 0.25]), first + second / 4)
    assert train_head.weights_of_steps("1,0.3", 2) == [1.0, 0.3]
    assert train_head.weights_of_steps(None, 2) is None
    for bad in ("1", "1,x", "1,-1", "0,0"):
        with pytest.raises(SpecserveError, match="--step-weights"):
            train_head.weights_of_steps(bad, 2)


@pytest.mark.parametrize(("weights", "prepack"), [("dequant", True), ("int8", False)])
def test_a_new_head_reads_the_lm_head_rows_whatever_kernel_holds_them(
    weights: str, prepack: bool, tmp_path: Path
) -> None:
    """oneDNN's packed float weight and an int8 kernel hold no dense matrix to index."""
    from specserve.loading.model import load_model
    from tests.tiny import write_hf_folder

    write_hf_folder("qwen2", tmp_path, seed=11)
    plain = load_model(tmp_path, "float32", with_tokenizer=False, prepack=False).model
    other = load_model(tmp_path, "float32", with_tokenizer=False, weights=weights, prepack=prepack)
    ids = torch.tensor([0, 5, 17, VOCAB - 1])
    h = plain.cfg.hidden_size
    want = plain.lm_head.weight.detach()[ids]
    got = ht.lm_head_rows(other.model.lm_head, ids, h)
    assert got.shape == want.shape
    assert torch.allclose(
        got, want, atol=1e-6 if weights == "dequant" else float(want.abs().max()) / 50
    )


def _logits_with_top(p: list[float], vocab: int = 4) -> torch.Tensor:
    """Rows of logits whose softmax puts p on token 0 and the rest evenly on the others."""
    top = torch.tensor(p, dtype=torch.float64)[:, None]
    rest = ((1 - top) / (vocab - 1)).expand(-1, vocab - 1)
    return torch.log(torch.cat((top, rest), dim=1))


def test_confidence_counts_follow_a_greedy_draft_as_served() -> None:
    """Four rows, three steps (token 0 drafted each time; label 0 means it was right):
    the first token counts in its probability's class, later ones only where the draft got
    there (every earlier one right and past p_min) and passed p_min themselves."""
    head = argparse.Namespace(d2t=torch.arange(4))
    steps = [
        ([0.9, 0.3, 0.7, 0.55], [0, 0, 1, 0]),  # row 2 misses its first token
        ([0.8, 0.9, 0.9, 0.5], [0, 2, 0, 0]),  # row 3 stops under p_min, row 1 misses
        ([0.65, 0.9, 0.9, 0.9], [3, 0, 0, 0]),  # only row 0 got here, and misses
    ]
    pairs = [(_logits_with_top(p), torch.tensor(lb)) for p, lb in steps]
    cal = ht.confidence_counts(head, pairs, (0.5,), p_min=0.6)  # type: ignore[arg-type]
    assert (cal.first_rows, cal.first_kept) == ((1, 3), (1, 2))
    assert (cal.later_rows, cal.later_kept) == (3, 1)


def test_confidence_classes_are_the_ones_a_server_labels_drafts_with() -> None:
    from collections import Counter

    from specserve.speculative.mtp import CONFIDENCE, confidence_tier

    p = torch.linspace(0.01, 0.97, 49)  # off the bounds, where float32 and 64 could part
    pairs = [(_logits_with_top(p.tolist(), 100), torch.zeros(49, dtype=torch.long))]
    cal = ht.confidence_counts(argparse.Namespace(d2t=torch.arange(100)), pairs, CONFIDENCE, 0.75)  # type: ignore[arg-type]
    tiers = Counter(confidence_tier(float(x)) for x in torch.softmax(pairs[0][0], -1)[:, 0])
    assert cal.first_rows == tuple(tiers[t] for t in range(1, len(CONFIDENCE) + 2))
    assert cal.first_kept == cal.first_rows  # every label was the drafted token


def test_the_row_cache_keeps_rows_only_while_the_reserve_stays_free() -> None:
    made: list[int] = []

    def make(i: int) -> ht.TargetRows:  # tapped states of 1,000 values: 2,000 bytes kept
        made.append(i)
        return ht.TargetRows(torch.arange(4), torch.zeros(4, 250), torch.arange(4))

    cache = RowCache(10**9, reserve=6_000, free=lambda: 10_000 - cache.used)
    for i in (0, 1, 2, 0, 1, 2):
        assert cache.get(i, make).aux.dtype == torch.float32
    assert made == [0, 1, 2, 2]  # the third row would have left under 6,000 bytes free
    assert cache.used == 4_000
    unknown = RowCache(4_000, reserve=6_000, free=lambda: None)
    for i in (0, 1, 2, 0, 1, 2):
        unknown.get(i, make)
    assert made[4:] == [0, 1, 2, 2]  # where free memory is unknown the budget alone bounds it
