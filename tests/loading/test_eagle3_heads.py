"""EAGLE-3 heads load from every public layout (SpecForge's and vLLM's HF folders, the
speculators' nesting, llama.cpp's GGUF) into the same head, checked against the target."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from specserve.batch import FlatBatch
from specserve.errors import SpecserveError
from specserve.loading.eagle3 import load_eagle3, save_calibration, save_eagle3
from specserve.models.eagle3 import Eagle3Head, HeadCalibration
from specserve.models.layers.lowbit_fused import FusedPart
from tests.tiny_eagle3 import random_head, write_gguf_head, write_vllm_layout


@pytest.fixture(scope="module")
def target():  # noqa: ANN201
    """What the loader checks heads against: a tiny target's config (3 layers, H = 64)."""
    from types import SimpleNamespace

    from specserve.loading.hf import config_from_hf
    from tests.tiny import hf_config

    return SimpleNamespace(cfg=config_from_hf(hf_config("qwen2").to_dict()))


LAYOUTS = {
    "specforge": lambda h, d: (save_eagle3(h, d), d)[1],
    "vllm": lambda h, d: write_vllm_layout(h, d),
    "speculators": lambda h, d: write_vllm_layout(h, d, speculators=True),
    "gguf": lambda h, d: write_gguf_head(h, d / "head.gguf"),
}


def _same(a: Eagle3Head, b: Eagle3Head) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        # GGUF and the saved layout hold float32: the float64 head's weights rounded
        assert torch.allclose(sa[k].double(), sb[k].double(), rtol=0, atol=1e-7), k
    assert a.cfg.aux_layers == b.cfg.aux_layers
    assert a.cfg.draft_vocab_size == b.cfg.draft_vocab_size


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_loads_the_same_head(layout: str, tmp_path: Path, target) -> None:  # noqa: ANN001
    head = random_head(target.cfg, draft_vocab=96, seed=2)
    path = LAYOUTS[layout](head, tmp_path)
    loaded = load_eagle3(path, target.cfg, torch.float64)
    _same(head, loaded)
    assert loaded.d2t.tolist() != list(range(96))  # a real reduced vocabulary, mapped back
    # the same drafts: one step over the same rows
    x = torch.randn(5, target.cfg.hidden_size, dtype=torch.float64)
    mine = head.layer(x, x, lambda y: head.attn.o(head.attn.v(y)))[0]
    theirs = loaded.layer(x, x, lambda y: loaded.attn.o(loaded.attn.v(y)))[0]
    assert torch.allclose(mine, theirs, atol=1e-5)


def test_a_head_is_found_by_name_in_the_cache(tmp_path: Path, target, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    save_eagle3(random_head(target.cfg), tmp_path / "heads" / "tiny-eagle3")
    assert load_eagle3("tiny", target.cfg, torch.float64).cfg.draft_vocab_size == 96
    with pytest.raises(SpecserveError, match="no EAGLE-3 head 'other'"):
        load_eagle3("other", target.cfg)


MISFITS = {
    "hidden": ({"target_hidden_size": 32}, "hidden states of size 32"),
    "vocab": ({"vocab_size": 100}, "vocabulary has 100 tokens"),
    "layers": ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 7]}}, "taps layers"),
    "two layers": ({"num_hidden_layers": 2}, "one decoder layer"),
}


@pytest.mark.parametrize("case", MISFITS)
def test_a_head_for_another_model_is_refused(case: str, tmp_path: Path, target) -> None:  # noqa: ANN001
    save_eagle3(random_head(target.cfg), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    change, message = MISFITS[case]
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(SpecserveError, match=message):
        load_eagle3(tmp_path, target.cfg)


def test_a_gguf_of_another_architecture_is_refused(tmp_path: Path, target) -> None:  # noqa: ANN001
    from tests.tiny import make_hf_model
    from tests.tiny_gguf import write_gguf

    path = write_gguf(make_hf_model("llama"), "llama", tmp_path / "m.gguf")
    with pytest.raises(SpecserveError, match="not an eagle3 head"):
        load_eagle3(path, target.cfg)


def test_a_saved_head_keeps_its_residual_form(tmp_path: Path, target) -> None:  # noqa: ANN001
    head = random_head(target.cfg)
    head.cfg = dataclasses.replace(head.cfg, norm_before_residual=True)
    save_eagle3(head, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["norm_before_residual"] is True
    assert load_eagle3(tmp_path, target.cfg, torch.float64).cfg.norm_before_residual


@pytest.mark.parametrize(
    ("weights", "share", "similar"),
    [("int8", (0.2, 0.35), 0.99), ("auto", (0.2, 0.35), 0.99), ("int4", (0.1, 0.2), 0.98)],
)
def test_a_head_beside_quantized_weights_is_quantized_too(
    weights: str,
    share: tuple[float, float],
    similar: float,
    tmp_path: Path,
    target,  # noqa: ANN001
) -> None:
    """A head is served on quantized kernels (--draft-weights: int4 by default), so its
    step reads about a quarter (int8) or an eighth (int4) of the bytes a float32 one does;
    its logits stay close to those of the float head."""
    from specserve.models.size import step_bytes

    save_eagle3(random_head(target.cfg, draft_vocab=96, seed=3), tmp_path)
    plain = load_eagle3(tmp_path, target.cfg, torch.float32)
    quant = load_eagle3(tmp_path, target.cfg, torch.float32, "cpu", weights)
    assert not any(type(m) is torch.nn.Linear for m in quant.modules())
    assert any(type(m) is torch.nn.Linear for m in plain.modules())
    assert share[0] * step_bytes(plain) < step_bytes(quant) < share[1] * step_bytes(plain)
    assert load_eagle3(tmp_path, target.cfg, torch.float64, "cpu", weights).fc.weight.dtype == (
        torch.float64  # no quantized kernel for float64: the head stays as the target does
    )
    x = torch.randn(6, 3 * target.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    e = torch.randn(6, target.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    want, got = (
        h.target_logits(h.lm_head(h.layer(e, h.fuse(x), h.attn.v)[0]), target.cfg.vocab_size)
        for h in (plain, quant)
    )
    kept = want.isfinite()
    assert torch.equal(kept, got.isfinite())
    assert torch.nn.functional.cosine_similarity(want[kept], got[kept], dim=0) > similar
    # q/k/v and gate/up run as one kernel call each, as a loaded model's; a cached step
    # then runs the one-op attention over the head's 2H-wide input
    assert all(isinstance(p, FusedPart) for p in (quant.attn.q, quant.attn.v, quant.mlp.up))
    steps = [cached_steps(h, x, e) for h in (plain, quant)]
    for a, b in zip(*steps, strict=True):
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > similar


def cached_steps(head: Eagle3Head, x: torch.Tensor, e: torch.Tensor) -> list[torch.Tensor]:
    """The head's outputs over rows 0..3 as one prefill, then rows 4 and 5 one at a time."""
    cache = head.new_cache(1, 8)
    g = head.fuse(x)
    out = []
    for lo, hi in ((0, 4), (4, 5), (5, 6)):
        batch = FlatBatch.build([0], [lo], [hi - lo], "cpu")
        out.append(head(e[lo:hi], g[lo:hi], batch, cache)[0])
    return out


CALIBRATION = HeadCalibration((0.5,), (3, 40), (10, 50), 0.75, 70, 90)


def test_a_heads_calibration_is_read_back_from_its_folder(tmp_path: Path, target) -> None:  # noqa: ANN001
    head = random_head(target.cfg, draft_vocab=96, seed=2)
    save_eagle3(head, tmp_path)
    assert load_eagle3(tmp_path, target.cfg, torch.float64).calibration is None
    save_calibration(CALIBRATION, tmp_path)
    assert load_eagle3(tmp_path, target.cfg, torch.float64).calibration == CALIBRATION
    write_gguf_head(head, tmp_path / "head.gguf")  # a single file has no folder to keep it in
    assert load_eagle3(tmp_path / "head.gguf", target.cfg, torch.float64).calibration is None


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"first_kept": [3]}, "do not fit"),  # one class short
        ({"later_kept": 91}, "do not fit"),  # more kept than counted
        ({"p_min": "high"}, "not a head calibration"),
        ({"bounds": None}, "not a head calibration"),
    ],
)
def test_a_broken_calibration_is_named_not_used(
    change: dict,
    says: str,
    tmp_path: Path,
    target,  # noqa: ANN001
) -> None:
    save_eagle3(random_head(target.cfg, draft_vocab=96, seed=2), tmp_path)
    raw = {**dataclasses.asdict(CALIBRATION), **change}
    (tmp_path / "calibration.json").write_text(json.dumps(raw))
    with pytest.raises(SpecserveError, match=says):
        load_eagle3(tmp_path, target.cfg, torch.float64)
