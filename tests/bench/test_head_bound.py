"""`bench head-bound`: its policy and oracle arithmetic on made-up rows, the scoring of a
tiny target's answer against what a drafting head keeps, and the timing of its rows."""

from __future__ import annotations

import pytest
import torch

from specserve.bench.head_bound import (
    P_MINS,
    PHIS,
    THETAS,
    Costs,
    Scored,
    best_policies,
    best_policy,
    given_costs,
    main,
    oracle_value,
    policy_value,
    scored,
    time_costs,
)
from specserve.cli import build_parser
from specserve.engine.engine import Engine
from specserve.engine.request import Request
from specserve.engine.runner import ModelRunner
from specserve.engine.sampling import SamplingParams
from specserve.errors import SpecserveError
from specserve.loading.model import load_model
from specserve.speculative import head_training as ht
from tests.tiny import write_hf_folder
from tests.tiny_eagle3 import foreseeing_head, nearly_bigram

COSTS = Costs({1: 1.0, 2: 1.5, 3: 2.0}, head=0.1, one_row_ms=10.0)
BRANCH_COSTS = Costs({1: 1.0, 2: 1.5, 3: 2.0, 4: 2.5}, head=0.1, one_row_ms=10.0)


def _rows(kept: list[list[bool]], p: float = 0.9) -> Scored:
    k = torch.tensor(kept)
    return Scored(k, torch.full(k.shape, p))


def test_a_draft_kept_whole_advances_past_it_and_pays_its_rows_and_head_steps() -> None:
    s = _rows([[True, True]] * 5)
    # row 0: 2 drafted and kept (3 tokens for 2 rows' 2.0 + 2 head steps); row 3: one
    # token left to draft (2 tokens for 1.5 + 0.1): 5 tokens in 3.8 steps
    assert policy_value(s, COSTS, theta=0.5, p_min=0.5, k=2) == pytest.approx(5 / 3.8)
    assert oracle_value(s, COSTS) == pytest.approx(5 / 3.8)


def test_a_missed_draft_still_pays_its_rows_and_the_oracle_never_asks_there() -> None:
    s = _rows([[False, False]] * 4)
    # one token a step: two steps with 2 draft rows and 2 head steps (2.2 each), then one
    # with room for one (1.6), then the last with none (1.0)
    assert policy_value(s, COSTS, theta=0.0, p_min=0.0, k=2) == pytest.approx(4 / 7.0)
    assert oracle_value(s, COSTS) == 1.0
    assert best_policy(s, COSTS)[0] == 1.0 and best_policy(s, COSTS)[3] == 0  # never ask


def test_thresholds_cut_drafts_where_the_head_is_unsure() -> None:
    s = Scored(torch.tensor([[True, True]] * 3), torch.tensor([[0.9, 0.1]] * 3))
    # p_min 0.5 stops the draft after one token (both head steps paid): 2 tokens for
    # 1.5 + 0.2, then the last row, with no room to draft, alone
    assert policy_value(s, COSTS, theta=0.5, p_min=0.5, k=2) == pytest.approx(3 / 2.7)
    # theta over the first token's 0.9: nothing verified, one head step where there is room
    assert policy_value(s, COSTS, theta=0.95, p_min=0.0, k=2) == pytest.approx(3 / 3.2)


def test_the_oracle_bounds_every_policy() -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        s = Scored(torch.rand(60, 3, generator=g) < 0.6, torch.rand(60, 3, generator=g))
        costs = Costs({1: 1.0, 2: 1.2, 3: 1.35, 4: 1.5}, head=0.08, one_row_ms=10.0)
        value, *_ = best_policy(s, costs)
        assert 1.0 <= value <= oracle_value(s, costs)


def test_a_right_second_choice_beside_a_missed_first_gains_two_tokens_for_a_row() -> None:
    s = Scored(torch.tensor([[False, False]] * 4), torch.full((4, 2), 0.4), torch.ones(4).bool())
    # one-token drafts with a sibling: rows 0 and 2 each miss the first, keep the second
    # and the target's token after it: 2 tokens for 3 rows' 2.0 + 1 head step, twice
    assert policy_value(s, BRANCH_COSTS, theta=0.0, p_min=0.0, k=1, phi=0.5) == pytest.approx(
        4 / 4.2
    )
    # phi under the first token's probability: no sibling, one token a step as before
    assert policy_value(s, BRANCH_COSTS, 0.0, 0.0, 1, phi=0.3) == policy_value(
        s, BRANCH_COSTS, 0.0, 0.0, 1
    )


def test_a_sibling_beside_a_kept_first_token_is_paid_for_nothing() -> None:
    s = Scored(torch.tensor([[True, False]] * 3), torch.full((3, 2), 0.4), torch.ones(3).bool())
    # row 0: its first kept (2 tokens), its sibling's row paid (2.0 + 0.1); row 2 alone
    assert policy_value(s, BRANCH_COSTS, 0.0, 0.0, 1, phi=0.5) == pytest.approx(3 / 3.1)
    # given costs up to 3 rows: row 0's two-token draft goes without a sibling (row 1, with
    # room for one token, is sure enough to need none)
    p = torch.tensor([[0.4, 0.4], [0.9, 0.9], [0.9, 0.9]])
    s2 = Scored(torch.tensor([[False, False]] * 3), p, torch.ones(3).bool())
    assert policy_value(s2, COSTS, 0.0, 0.0, 2, phi=0.5) == policy_value(s2, COSTS, 0.0, 0.0, 2)


def test_branching_is_chosen_only_where_it_pays() -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        kept = torch.rand(60, 3, generator=g) < 0.5
        s = Scored(kept, torch.rand(60, 3, generator=g), torch.rand(60, generator=g) < 0.3)
        costs = Costs({1: 1.0, 2: 1.2, 3: 1.35, 4: 1.5, 5: 1.6}, head=0.08, one_row_ms=10.0)
        assert best_policy(s, costs, PHIS)[0] >= best_policy(s, costs)[0]
        found = best_policies(s, costs, PHIS)  # one pass gives each phi's best
        assert found[0.0] == best_policy(s, costs)
        for phi, (value, theta, p_min, k, at) in found.items():  # against every policy
            every = [policy_value(s, costs, t, p, n, phi) for t, p, n in _grid(3)]
            assert at == phi and value == max(1.0, *every)  # 1.0: never asking
            assert k == 0 or value == policy_value(s, costs, theta, p_min, k, phi)
        never_right = Scored(s.kept, s.p, torch.zeros(60, dtype=torch.bool))
        value, *_, phi = best_policy(never_right, costs, PHIS)
        assert phi == 0.0 and value == best_policy(s, costs)[0]


def _grid(steps: int) -> list[tuple[float, float, int]]:
    """Every (theta, p_min, k) a policy search tries."""
    return [(t, p, k) for t in THETAS for p in P_MINS for k in range(1, steps + 1)]


@pytest.fixture(scope="module")
def bigram(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    folder = tmp_path_factory.mktemp("target")
    write_hf_folder("qwen2", folder, seed=11)
    # then float32, as served: the scoring reads the target's tapped states in float32
    return nearly_bigram(load_model(folder, dtype="float64").model).float()


def test_scored_rows_are_the_drafts_a_head_makes_and_the_target_keeps(bigram) -> None:  # noqa: ANN001
    head = foreseeing_head(bigram).float()
    prompt = [5, 17, 3, 99, 41, 8]
    req = Request(prompt, SamplingParams(temperature=0, max_tokens=40))
    Engine(ModelRunner(bigram, 1, 64)).generate([req])
    s = scored(head, bigram, prompt, req.output, steps=3)
    assert s.kept.shape == s.p.shape == (39, 3)
    assert ((s.p[:, 0] > 0) & (s.p[:, 0] <= 1)).all()
    # row i (after answer token i) drafts token i + 1 first: the head's likeliest there
    rows = ht.target_rows(bigram, prompt + req.output, head.cfg.aux_layers)
    logits, _ = ht.unrolled_logits(head, bigram.embed, rows, 1)[0]
    drafts = head.d2t[logits.argmax(dim=-1)][len(prompt) - 1 :]
    assert s.kept[:, 0].tolist() == (drafts[:39] == torch.tensor(req.output[1:])).tolist()
    assert 0 < int(s.kept[:, 0].sum()) < 39  # some kept, some missed
    seconds = head.d2t[logits.topk(2, dim=-1).indices[:, 1]][len(prompt) - 1 :]
    assert s.second is not None
    assert s.second.tolist() == (seconds[:39] == torch.tensor(req.output[1:])).tolist()


def test_costs_are_timed_for_every_row_count_against_one_row(bigram) -> None:  # noqa: ANN001
    head = foreseeing_head(bigram, noise=0.3).float()
    costs = time_costs(ModelRunner(bigram, 1, 96), head, list(range(2, 50)), 3, rounds=2)
    # up to a full draft and its first token's sibling
    assert sorted(costs.rows) == [1, 2, 3, 4, 5] and costs.rows[1] == 1.0
    assert all(v > 0 for v in costs.rows.values()) and costs.head > 0


def test_the_command_defaults_to_the_issue_workloads_and_a_served_head() -> None:
    args = build_parser().parse_args(["bench", "head-bound"])
    assert args.workloads == ["quicksort-python", "quicksort-c", "quicksort-java", "prose"]
    assert args.draft_weights == "int4" and args.steps == 4 and args.costs is None


def test_given_costs_stand_for_the_timed_ones() -> None:
    c = given_costs("1.27,1.46,1.66,1.85,0.10", steps=4)
    assert c.rows == {1: 1.0, 2: 1.27, 3: 1.46, 4: 1.66, 5: 1.85} and c.head == 0.10
    for bad in ("1.27,1.46,0.1", "1.27,x,1.66,1.85,0.1", "1.27,1.46,1.66,1.85,0"):
        with pytest.raises(SpecserveError, match="--costs: 5 positive numbers"):
            given_costs(bad, steps=4)


def test_bad_costs_fail_before_any_model_loads() -> None:
    args = build_parser().parse_args(
        ["bench", "head-bound", "--models", "no-such-model", "--costs", "1,2"]
    )
    with pytest.raises(SpecserveError, match="--costs"):
        main(args)
