"""Tally of what speculators did across a test module, so it can assert that the cases that
break rollback (empty drafts, whole rejections, whole acceptances) really occurred."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.speculative.base import SpecStats


@dataclass
class CasesSeen:
    drafts: int = 0
    empty: int = 0
    rejected_whole: int = 0
    accepted_whole: int = 0

    def add(self, s: SpecStats) -> None:
        self.drafts += s.drafts_generated
        self.empty += s.empty_drafts
        self.rejected_whole += s.accept_len_hist[0] if s.accept_len_hist else 0
        self.accepted_whole += s.drafts_full

    def assert_all_occurred(self) -> None:
        assert self.drafts > 0
        assert self.empty > 0, "no step had an empty draft"
        assert self.rejected_whole > 0, "no draft was rejected whole"
        assert self.accepted_whole > 0, "no draft was accepted whole"
