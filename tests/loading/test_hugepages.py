"""Low-bit records on huge pages (loading/hugepages.py): same bits, one buffer, real 2 MiB pages."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from specserve.batch import FlatBatch
from specserve.loading import hugepages
from specserve.loading.hugepages import (
    HUGE_PAGE,
    huge_page_buffer,
    record_buffers,
    records_to_huge_pages,
)
from specserve.loading.model import load_model
from specserve.models.layers.lowbit import LowbitCall
from specserve.models.layers.lowbit_fused import FusedLowbit
from specserve.ops.cpu.build import problem
from tests.tiny import VOCAB, make_hf_model
from tests.tiny_gguf import write_gguf

needs_lowbit = pytest.mark.skipif(problem() is not None, reason=f"low-bit kernels: {problem()}")


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "none"
    return text.split("[")[1].split("]")[0]


def _huge_kib(start: int, end: int) -> int:
    """AnonHugePages (KiB) of the mappings of this process that overlap [start, end)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo < end and start < hi
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


def _logits(model: torch.nn.Module, prompt: torch.Tensor) -> torch.Tensor:
    cache = model.new_cache(1, 32)
    with torch.no_grad():
        hidden = model(prompt, FlatBatch.build([0], [0], [len(prompt)], "cpu"), cache)
        return model.logits(hidden)


def _records(model: torch.nn.Module) -> list[torch.Tensor]:
    return [getattr(module, name) for module, name in record_buffers(model)]


@needs_lowbit
def test_records_move_into_one_aligned_buffer_and_keep_their_bits(tmp_path: Path) -> None:
    path = write_gguf(make_hf_model("qwen2", seed=3), "qwen2", tmp_path / "m.gguf")
    prompt = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(1))
    loaded = load_model(path, "float32", with_tokenizer=False, weights="int8").model
    # fused q/k/v and gate/up hold their parts' records themselves: those move too
    assert any(isinstance(m, FusedLowbit) for m in loaded.modules())
    records = _records(loaded)
    calls = [m for m in loaded.modules() if isinstance(m, LowbitCall)]
    used = [r.data_ptr() for call in calls for r in call.parts()[0]]  # what the kernels read
    assert sorted(r.data_ptr() for r in records) == sorted(used)
    # load_model moved them already: one buffer, each tensor on a cache line
    bases = {r.untyped_storage().data_ptr() for r in records}
    assert len(records) > 4 and len(bases) == 1
    assert all(r.data_ptr() % 64 == 0 for r in records)
    assert min(r.data_ptr() for r in records) % HUGE_PAGE == 0
    want = _logits(loaded, prompt)
    # moved again (a second buffer): the same bytes, so the same logits bit for bit
    before = [r.clone() for r in records]
    assert records_to_huge_pages(loaded) >= sum(r.numel() for r in before)
    after = _records(loaded)
    assert all(torch.equal(b, a) for b, a in zip(before, after, strict=True))
    assert {r.untyped_storage().data_ptr() for r in after} != bases
    assert torch.equal(_logits(loaded, prompt), want)


@pytest.mark.skipif(
    _thp_mode() not in ("always", "madvise"), reason=f"transparent huge pages: {_thp_mode()}"
)
def test_the_buffer_gets_huge_pages_where_the_system_gives_them() -> None:
    # a shared anonymous map (Python's default) got none: its huge pages are another setting
    buffer = huge_page_buffer(3 * HUGE_PAGE)
    assert buffer is not None and buffer.data_ptr() % HUGE_PAGE == 0
    buffer.fill_(1)  # first touch: the page faults that take huge pages
    start = buffer.data_ptr()
    assert _huge_kib(start, start + buffer.numel()) >= HUGE_PAGE // 1024


@needs_lowbit
def test_without_the_advice_nothing_moves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)
    assert hugepages.huge_page_buffer(HUGE_PAGE) is None
    path = write_gguf(make_hf_model("qwen2", seed=3), "qwen2", tmp_path / "m.gguf")
    model = load_model(path, "float32", with_tokenizer=False, weights="int8").model
    records = _records(model)
    assert len({r.untyped_storage().data_ptr() for r in records}) == len(records) > 4
    assert records_to_huge_pages(model) == 0


@needs_lowbit
def test_the_move_trims_malloc_as_it_goes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # old copies below glibc's mmap threshold stay in the heap until a trim: trimmed only at
    # the end, the 1.5B's load peaked ~850 MB higher
    path = write_gguf(make_hf_model("qwen2", seed=3), "qwen2", tmp_path / "m.gguf")
    model = load_model(path, "float32", with_tokenizer=False, weights="int8").model
    trims: list[int] = []
    monkeypatch.setattr(hugepages, "TRIM_EVERY", 1)
    monkeypatch.setattr(hugepages, "release_freed_memory", lambda collect: trims.append(collect))
    assert records_to_huge_pages(model) > 0
    assert len(trims) == len(_records(model)) and not any(trims)
