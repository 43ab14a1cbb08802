"""`specserve train-head` on a tiny model: a few steps of training-time-test training on
the model's own greedy text, resumed from its checkpoint, saved in the public layout, then
loaded and drafting (greedy output still exact)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from specserve.bench import train_head
from specserve.engine.engine import Engine
from specserve.engine.request import Request
from specserve.engine.runner import ModelRunner
from specserve.engine.sampling import SamplingParams
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
    return p.parse_args(
        ["--model", "tiny", "--draft-vocab", "100", "--steps", "3", *kw.pop("argv", [])]
    )


def test_unrolled_steps_see_what_drafting_sees(target) -> None:  # noqa: ANN001
    """Step 0 of the unrolled forward equals the head's cached forward over the same rows
    (the training-time test starts from exactly what serving computes)."""
    from specserve.batch import FlatBatch

    model = nearly_bigram(target).float()
    seq = _own_text(model, n=1)[0]
    rows = ht.target_rows(model, seq, (2, 1, 0))
    head = ht.new_head(model, torch.arange(100))
    ((logits, labels), *_) = ht.unrolled_logits(head, model.embed, rows, 2)
    n = len(seq) - 1
    cache = head.new_cache(1, n)
    batch = FlatBatch.build([0], [0], [n], torch.device("cpu"))
    with torch.no_grad():
        normed, _ = head(model.embed(rows.tokens[1:]), head.fuse(rows.aux[:n]), batch, cache)
    assert torch.allclose(head.lm_head(normed), logits, atol=1e-5)
    assert labels.tolist() == rows.labels[1:].tolist()


def test_train_resume_save_and_draft(target, tmp_path: Path) -> None:  # noqa: ANN001
    model = nearly_bigram(target).float()
    loaded = LoadedModel(model, None, tmp_path / "tiny")
    seqs = _own_text(model)
    far = time.monotonic() + 600
    first = train_head.train(loaded, list(seqs), tmp_path, _args(argv=["--max-steps", "30"]), far)
    assert first["steps"] == 30 and 0.0 <= first["top1"] <= 1.0
    assert len(first["per_position"]) == 3
    again = train_head.train(loaded, list(seqs), tmp_path, _args(argv=["--max-steps", "60"]), far)
    assert again["steps"] == 60  # resumed from the checkpoint's 30
    assert first["loss_last"] < first["loss_first"]  # it learns
    assert again["top1"] > 0.3  # and drafts the nearly-bigram model's next tokens
    head = load_eagle3(tmp_path, model.cfg, torch.float32)
    from tests.speculative.test_eagle3 import _prompts, _run

    plain, _ = _run(model, "", None, _prompts()[:2])
    out, spec = _run(model, "eagle3", head, _prompts()[:2])
    assert out == plain
    assert spec is not None and spec.stats.tokens_accepted > 0


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
