"""The router's choice rule without Ray: prefix affinity, its load bound, forgetting."""

from __future__ import annotations

import pytest

from specserve.cluster.affinity import PrefixRouter, ReplicaTree

TURN1 = list(range(100, 140))  # a 40-token first-turn prompt


def test_tree_matches_the_longest_routed_prefix_and_evicts_the_oldest() -> None:
    tree = ReplicaTree(max_prompts=2)
    tree.insert([1, 2, 3, 4])
    tree.insert([1, 2, 9])
    assert tree.match([1, 2, 3, 4, 5]) == 4
    assert tree.match([1, 2, 9, 9]) == 3
    assert tree.match([7]) == 0
    tree.insert([5, 6])  # over the cap: [1, 2, 3, 4] goes, its shared [1, 2] stays
    assert len(tree) == 2
    assert tree.match([1, 2, 3, 4]) == 2
    assert tree.match([5, 6, 7]) == 2


def test_follow_up_turn_goes_to_the_replica_holding_its_prefix() -> None:
    router: PrefixRouter[str] = PrefixRouter(threshold=2, min_match=8)
    router.routed("a", TURN1)
    router.routed("b", list(range(500, 540)))
    turn2 = TURN1 + [7, 8, 9]
    # b is less loaded, but within the threshold: the cache wins
    choice = router.choose(turn2, {"a": 2, "b": 0})
    assert choice is not None and (choice.replica, choice.reason) == ("a", "affinity")
    assert choice.matched == len(TURN1)


def test_overloaded_affine_replica_falls_back_to_the_least_loaded() -> None:
    router: PrefixRouter[str] = PrefixRouter(threshold=2, min_match=8)
    router.routed("a", TURN1)
    choice = router.choose(TURN1 + [1], {"a": 5, "b": 3, "c": 1})
    assert choice is not None and (choice.replica, choice.reason) == ("c", "least-loaded")


def test_short_or_missing_matches_leave_the_choice_to_power_of_two() -> None:
    router: PrefixRouter[str] = PrefixRouter(threshold=2, min_match=8)
    router.routed("a", TURN1)
    assert router.choose(TURN1[:5] + [0] * 20, {"a": 0, "b": 0}) is None  # 5 < min_match
    assert router.choose([9] * 30, {"a": 0, "b": 0}) is None
    router.forget("a")  # it died: what it cached is gone
    assert router.choose(TURN1, {"a": 0, "b": 0}) is None


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        PrefixRouter(threshold=-1)


def test_a_prefix_every_replica_holds_is_no_reason_to_queue() -> None:
    """Both hold the shared system prompt; a new conversation goes to the least loaded,
    and its follow-up turn to where it went, within the load bound."""
    router: PrefixRouter[str] = PrefixRouter(threshold=2, min_match=8)
    system = list(range(1000, 1100))
    router.routed("a", system + [1, 2, 3])
    router.routed("b", system + [4, 5, 6])
    first = router.choose(system + [7, 8], {"a": 2, "b": 1})
    assert first is not None and (first.replica, first.reason) == ("b", "least-loaded")
    router.routed("b", system + [7, 8, 9, 10, 11, 12, 13, 14, 15])
    again = router.choose(system + [7, 8, 9, 10, 11, 12, 13, 14, 15, 16], {"a": 0, "b": 2})
    assert again is not None and (again.replica, again.reason) == ("b", "affinity")
    tie = router.choose(system + [99], {"a": 1, "b": 1})  # equal loads: either, not None
    assert tie is not None and tie.reason == "least-loaded"


def test_the_threshold_defaults_to_a_replicas_slots() -> None:
    """Past about one turn of waiting at home, a turn is sooner re-prefilled elsewhere: by
    default the home replica may be as many requests ahead as it has slots, no more."""
    from specserve.cli import build_parser
    from specserve.cluster.deploy import threshold

    serve = ["serve", "--model", "m.gguf", "--replicas", "2"]
    assert threshold(build_parser().parse_args([*serve, "-np", "3"])) == 3
    given = build_parser().parse_args([*serve, "-np", "3", "--affinity-threshold", "1"])
    assert threshold(given) == 1
