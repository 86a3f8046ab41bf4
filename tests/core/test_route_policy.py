"""The route policy: request parsing, the cost function, ties, temperature, busy skip, tiers (pure)."""

from __future__ import annotations

import json
import math

import pytest

from kvmesh.core.errors import RequestError
from kvmesh.core.index import Holder
from kvmesh.core.load import ActiveLoad, LoadLedger
from kvmesh.core.protocol import Routed, WorkerLoad
from kvmesh.core.route import (
    Candidate,
    Policy,
    apply_override,
    decide,
    merge_candidates,
    parse_route_request,
    route_seed,
    score,
    softmax_probabilities,
)

BS = 16


def cand(
    w: str, overlap: int, cached: int = 0, dp: int = 0, tiers: dict[str, int] | None = None
) -> Candidate:
    """A candidate with the given overlap and cache size."""
    return Candidate(worker_id=w, dp_rank=dp, overlap_blocks=overlap, cached_blocks=cached, tiers=tiers)


def costs(d: object) -> dict[str, float]:
    """Map worker/dp → cost from a decision."""
    assert d is not None
    return {f"{s.worker_id}/{s.dp_rank}": s.cost for s in d.scores}  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------- cost


def test_worked_example_affinity_outweighs_a_little_decode_load() -> None:
    """64 tokens, A caches 3 blocks but has 32 prefill tokens and 2 blocks active: A 3.2, B 4.0, A wins.

    Default weights: A = (64 − 48 + 32) / 16 + 0.1 × 2 = 3.2; B = 64 / 16 = 4.0.
    """
    d = decide(
        [cand("a", 3, 10), cand("b", 0, 0)],
        prompt_tokens=64,
        block_size=BS,
        active={Holder("a", 0): ActiveLoad(prefill_tokens=32, blocks=2, requests=1)},
    )
    assert d is not None
    assert costs(d) == {"a/0": 3.2, "b/0": 4.0}
    a = d.scores[0]
    assert (a.prefill_blocks, a.decode_blocks, a.cached_tokens) == (3.0, 2.0, 48.0)
    assert d.winner.worker_id == "a"


def test_worked_example_queued_prefill_outweighs_a_short_overlap() -> None:
    """The same prompt when A has 64 tokens queued to prefill: A = (16 + 64) / 16 + 0.2 = 5.2 > B 4.0, B wins."""
    d = decide(
        [cand("a", 3, 10), cand("b", 0, 0)],
        prompt_tokens=64,
        block_size=BS,
        active={Holder("a", 0): ActiveLoad(prefill_tokens=64, blocks=2, requests=2)},
    )
    assert costs(d) == {"b/0": 4.0, "a/0": 5.2}
    assert d is not None and d.winner.worker_id == "b"


def test_dynamo_weights_let_decode_load_outweigh_a_short_overlap() -> None:
    """Dynamo's form (decode_weight 1.0): the first example costs A 3 + 2 = 5.0 and B 4.0, so B wins."""
    d = decide(
        [cand("a", 3, 10), cand("b", 0, 0)],
        prompt_tokens=64,
        block_size=BS,
        policy=Policy(decode_weight=1.0),
        active={Holder("a", 0): ActiveLoad(prefill_tokens=32, blocks=2, requests=1)},
    )
    assert costs(d) == {"b/0": 4.0, "a/0": 5.0}
    assert d is not None and d.winner.worker_id == "b"


def test_overlap_weight_brings_affinity_back() -> None:
    """With Dynamo's decode weight 1.0 and overlap_weight 4 the same example costs A 14.0 and B 16.0: A wins."""
    d = decide(
        [cand("a", 3, 10), cand("b", 0, 0)],
        prompt_tokens=64,
        block_size=BS,
        policy=Policy(overlap_weight=4.0, decode_weight=1.0),
        active={Holder("a", 0): ActiveLoad(prefill_tokens=32, blocks=2, requests=1)},
    )
    assert costs(d) == {"a/0": 14.0, "b/0": 16.0}
    assert d is not None and d.winner.worker_id == "a"


def test_default_weights_choose_as_dynamo_with_overlap_weight_10() -> None:
    """decode_weight 0.1 is Dynamo's w = 10 scaled by 1/10: every cost is a tenth, every winner the same."""
    assert (Policy().overlap_weight, Policy().decode_weight) == (1.0, 0.1)
    dynamo = Policy(overlap_weight=10.0, decode_weight=1.0)
    winners = []
    for a_prefill, a_blocks in [(0, 0), (32, 2), (64, 2), (0, 29), (0, 30), (0, 31)]:
        active = {Holder("a", 0): ActiveLoad(prefill_tokens=a_prefill, blocks=a_blocks, requests=1)}
        cands = [cand("a", 3, 10), cand("b", 0, 0)]
        ours = decide(cands, prompt_tokens=64, block_size=BS, active=active)
        theirs = decide(cands, prompt_tokens=64, block_size=BS, active=active, policy=dynamo)
        assert ours is not None and theirs is not None
        assert ours.winner.worker_id == theirs.winner.worker_id
        assert [s.cost for s in ours.scores] == pytest.approx([s.cost / 10 for s in theirs.scores])
        winners.append(ours.winner.worker_id)
    assert winners == [
        "a",
        "a",
        "b",
        "a",
        "b",
        "b",
    ]  # A = 1 + 0.1 × 29 = 3.9 < 4.0; 30 ties → B's emptier cache


def test_decode_weight_scales_the_active_blocks() -> None:
    """decode_weight 0.5 halves the decode term: 3 prefill blocks + 0.5 × 10 active blocks = 8.0."""
    s = score(
        cand("a", 1),
        prompt_tokens=64,
        block_size=BS,
        policy=Policy(decode_weight=0.5),
        active=ActiveLoad(prefill_tokens=0, blocks=10, requests=2),
    )
    assert (s.prefill_blocks, s.decode_blocks, s.cost) == (3.0, 10.0, 8.0)


def test_zero_load_cost_is_blocks_left_to_prefill() -> None:
    """Without load or tiers the cost is prompt blocks − overlap blocks, and the longest overlap wins."""
    d = decide([cand("a", 2, 9), cand("b", 3, 50), cand("c", 0, 0)], prompt_tokens=48, block_size=BS)
    assert costs(d) == {"b/0": 0.0, "a/0": 1.0, "c/0": 3.0}
    assert d is not None and d.winner.worker_id == "b"


def test_partial_trailing_block_counts_in_fractions() -> None:
    """A 40-token prompt (2.5 blocks) with 2 cached blocks costs 0.5."""
    assert score(cand("a", 2), prompt_tokens=40, block_size=BS, policy=Policy()).cost == 0.5


def test_unknown_block_size_counts_tokens() -> None:
    """Block size 0 (no worker reported one yet) counts the prompt in tokens instead of dividing by zero."""
    assert score(cand("a", 0), prompt_tokens=7, block_size=0, policy=Policy()).cost == 7.0


# ---------------------------------------------------------------------------------------- ties


def test_tie_goes_to_fewest_cached_blocks() -> None:
    """Equal cost: the emptier cache wins."""
    d = decide([cand("a", 1, 30), cand("b", 1, 20)], prompt_tokens=32, block_size=BS)
    assert d is not None and [s.worker_id for s in d.scores] == ["b", "a"]


def test_full_tie_is_a_seeded_choice_replicas_agree_on() -> None:
    """A full tie is broken by the request's seed: the same seed always picks the same worker, seeds differ."""
    cands = [cand(w, 0, 0) for w in ("w0", "w1", "w2", "w3")]
    winners = {
        seed: decide(cands, prompt_tokens=32, block_size=BS, seed=seed).winner.worker_id  # type: ignore[union-attr]
        for seed in range(40)
    }
    again = {
        seed: decide(list(reversed(cands)), prompt_tokens=32, block_size=BS, seed=seed).winner.worker_id  # type: ignore[union-attr]
        for seed in range(40)
    }
    assert winners == again
    assert set(winners.values()) == {"w0", "w1", "w2", "w3"}


def test_route_seed_is_from_request_id_else_body() -> None:
    """The seed is XXH3-64 of the request id, or of the body when there is none."""
    assert route_seed("r-1", b"ignored") == route_seed("r-1", b"other")
    assert route_seed(None, b'{"a": 1}') != route_seed(None, b'{"a": 2}')
    assert route_seed("", b"x") == 3244421341483603138


# ---------------------------------------------------------------------------------------- temperature


def test_softmax_over_normalised_costs() -> None:
    """Costs 0 and 1 at temperature 1 give e⁰ : e⁻¹; costs are normalised, so 0 and 10 give the same."""
    p = softmax_probabilities([0.0, 1.0], 1.0)
    assert p == pytest.approx([1 / (1 + math.exp(-1)), math.exp(-1) / (1 + math.exp(-1))], abs=1e-15)
    assert softmax_probabilities([0.0, 10.0], 1.0) == p
    assert softmax_probabilities([3.0, 3.0, 3.0], 0.5) == [1 / 3, 1 / 3, 1 / 3]


def test_temperature_samples_with_the_request_seed() -> None:
    """With temperature 1 the winner follows random.Random(seed): seed 0 → b (r=0.844 ≥ 0.731), seed 1 → a."""
    cands = [cand("a", 2), cand("b", 1)]
    pol = Policy(temperature=1.0)
    d0 = decide(cands, prompt_tokens=32, block_size=BS, policy=pol, seed=0)
    d1 = decide(cands, prompt_tokens=32, block_size=BS, policy=pol, seed=1)
    assert d0 is not None and d1 is not None
    # a (cost 0) has P = 0.7311, b (cost 1) 0.2689: Random(0).random() = 0.8444 → b; Random(1) = 0.1344 → a.
    assert (d0.winner.worker_id, d1.winner.worker_id) == ("b", "a")
    assert [round(s.probability or 0, 4) for s in d0.scores] == [0.7311, 0.2689]
    assert decide(cands, prompt_tokens=32, block_size=BS, policy=pol, seed=0) == d0


def test_temperature_zero_never_samples() -> None:
    """At temperature 0 there are no probabilities and the lowest cost wins for every seed."""
    cands = [cand("a", 2), cand("b", 1)]
    for seed in range(20):
        d = decide(cands, prompt_tokens=32, block_size=BS, seed=seed)
        assert d is not None and d.winner.worker_id == "a" and d.winner.probability is None


# ---------------------------------------------------------------------------------------- busy


def test_busy_worker_is_skipped_while_another_is_free() -> None:
    """A's KV cache is 97 % full: B wins despite its higher cost; B queueing 8 requests makes both busy → A."""
    cands = [cand("a", 4), cand("b", 0)]
    full = {Holder("a", 0): WorkerLoad(worker_id="a", kv_usage=0.97)}
    d = decide(cands, prompt_tokens=64, block_size=BS, engine=full)
    assert d is not None
    assert [(s.worker_id, s.busy, s.cost) for s in d.scores] == [("b", False, 4.0), ("a", True, 0.0)]
    both = {**full, Holder("b", 0): WorkerLoad(worker_id="b", waiting=8)}
    d2 = decide(cands, prompt_tokens=64, block_size=BS, engine=both)
    assert d2 is not None and d2.winner.worker_id == "a"


def test_busy_thresholds_are_per_request_policy() -> None:
    """busy_waiting 0 turns the waiting check off; busy_kv_usage 0.99 lets 97 % through."""
    cands = [cand("a", 4), cand("b", 0)]
    eng = {Holder("a", 0): WorkerLoad(worker_id="a", kv_usage=0.97, waiting=50)}
    d = decide(
        cands,
        prompt_tokens=64,
        block_size=BS,
        engine=eng,
        policy=Policy(busy_kv_usage=0.99, busy_waiting=0),
    )
    assert d is not None and d.winner.worker_id == "a" and not d.winner.busy


# ---------------------------------------------------------------------------------------- tiers


def test_slower_tiers_count_less() -> None:
    """4 blocks on CPU (weight 0.5) count as 32 tokens: cost 2.0, so 3 GPU blocks (cost 1.0) win."""
    d = decide(
        [cand("a", 4, tiers={"CPU": 4}), cand("b", 3, tiers={"GPU": 3})], prompt_tokens=64, block_size=BS
    )
    assert d is not None
    assert costs(d) == {"b/0": 1.0, "a/0": 2.0}
    a = d.scores[1]
    assert (a.cached_tokens, dict(a.tier_tokens)) == (32.0, {"CPU": 64})


def test_mixed_tiers_and_unknown_tier() -> None:
    """2 GPU + 1 DISK (0.25) + 1 unknown tier (0.5) = 32 + 4 + 8 = 44 tokens cached of 64: cost 1.25."""
    s = score(
        cand("a", 4, tiers={"GPU": 2, "DISK": 1, "NVME": 1}), prompt_tokens=64, block_size=BS, policy=Policy()
    )
    assert (s.cached_tokens, s.cost) == (44.0, 1.25)


def test_tier_weights_override_merges() -> None:
    """A request's tier_weights override merges into the router's, case-insensitively."""
    req = parse_route_request(b'{"model": "m", "token_ids": [1], "policy": {"tier_weights": {"cpu": 1.0}}}')
    assert req.policy is not None
    pol = apply_override(Policy(), req.policy)
    assert dict(pol.tier_weights) == {"GPU": 1.0, "CPU": 1.0, "DISK": 0.25}


# ---------------------------------------------------------------------------------------- hot prefix


def _hot_prefix_picks(policy: Policy) -> tuple[list[str], LoadLedger]:
    """Route eight 5-block requests sharing a 4-block prefix cached on A alone (no prefill completes)."""
    ledger = LoadLedger()
    prompt = 80  # 5 blocks: 4 shared + 1 own
    picks = []
    for i in range(8):
        cands = [cand("a", 4, 40), cand("b", 0, 0)]
        active = {k: ledger.load(*k) for k in (Holder("a", 0), Holder("b", 0))}
        d = decide(cands, prompt_tokens=prompt, block_size=BS, active=active, seed=i, policy=policy)
        assert d is not None
        w = d.winner
        picks.append(w.worker_id)
        ledger.routed(
            Routed(
                request_id=f"r{i}",
                worker_id=w.worker_id,
                dp_rank=0,
                prefill_tokens=prompt - w.overlap_blocks * BS,
                blocks=5,
            ),
            now_s=float(i),
        )
    return picks, ledger


def test_hot_prefix_spreads_once_a_worker_is_busier() -> None:
    """Eight requests sharing a 4-block prefix: overlap-only sends all to A; with load, 7 go to A and 1 to B.

    Costs A = (16 + A's prefill) / 16 + 0.1 × A's blocks vs B = (80 + B's prefill) / 16 + 0.1 × B's blocks:
    request 3 sees A 5.5 > B 5.0 and goes to B; after that B costs 10.5 and A reaches 10.0 at request 7.
    """
    overlap_only = [
        decide([cand("a", 4, 40), cand("b", 0, 0)], prompt_tokens=80, block_size=BS).winner.worker_id  # type: ignore[union-attr]
        for _ in range(8)
    ]
    assert overlap_only == ["a"] * 8
    picks, ledger = _hot_prefix_picks(Policy())
    assert picks == ["a", "a", "a", "b", "a", "a", "a", "a"]
    assert ledger.load("a", 0) == ActiveLoad(prefill_tokens=112, blocks=35, requests=7)
    assert ledger.load("b", 0) == ActiveLoad(prefill_tokens=80, blocks=5, requests=1)


def test_hot_prefix_with_dynamo_weights_alternates_sooner() -> None:
    """With decode_weight 1.0 (Dynamo's form) 5 go to A and 3 to B; request 6 ties at 25.0 and goes to B's
    emptier cache."""
    picks, ledger = _hot_prefix_picks(Policy(decode_weight=1.0))
    assert picks == ["a", "b", "a", "a", "b", "a", "b", "a"]
    assert ledger.load("a", 0) == ActiveLoad(prefill_tokens=80, blocks=25, requests=5)
    assert ledger.load("b", 0) == ActiveLoad(prefill_tokens=240, blocks=15, requests=3)


def test_worked_example_a_half_done_prefill_keeps_a_returning_conversation() -> None:
    """A 7,000-token turn whose first 6,400 tokens (400 blocks) are cached on A; B is idle and cold.

    A learned 10,000 tokens/s from an earlier request (5,000 tokens, routed at −1.0, done at −0.5) and is
    prefilling another 7,000-token request (438 blocks) routed at 0.0. At 0.6 s it has 1,000 tokens left:
    A = (7,000 − 6,400 + 1,000) / 16 + 0.1 × 438 = 100 + 43.8 = 143.8 against B = 7,000 / 16 = 437.5.
    Counting that request's whole prefill (``prefill_progress=False``, the former accounting) A costs
    (600 + 7,000) / 16 + 43.8 = 518.8 and the conversation loses its cache to B.
    """
    cands = [cand("a", 400, 5000), cand("b", 0, 0)]
    picks = {}
    for progress in (True, False):
        ledger = LoadLedger(prefill_progress=progress)
        ledger.routed(
            Routed(request_id="r0", worker_id="a", dp_rank=0, prefill_tokens=5000, blocks=313), -1.0
        )
        ledger.prefill_done("r0", -0.5)
        ledger.finished("r0", -0.4)
        ledger.routed(Routed(request_id="r1", worker_id="a", dp_rank=0, prefill_tokens=7000, blocks=438), 0.0)
        active = {Holder("a", 0): ledger.load("a", 0, now_s=0.6)}
        d = decide(cands, prompt_tokens=7000, block_size=BS, active=active)
        assert d is not None
        picks[progress] = (d.winner.worker_id, costs(d))
    assert picks[True] == ("a", {"a/0": pytest.approx(143.8), "b/0": 437.5})
    assert picks[False] == ("b", {"b/0": 437.5, "a/0": pytest.approx(518.8)})


# ---------------------------------------------------------------------------------------- candidates


def test_candidates_filter_and_registry_merge() -> None:
    """`allowed` narrows by worker id; a registry drops dead holders and adds live empty ones."""
    cands = [cand("a", 2, dp=0), cand("a", 1, dp=1), cand("b", 3)]
    d = decide(cands, prompt_tokens=48, block_size=BS, allowed=["a"])
    assert d is not None and [(s.worker_id, s.dp_rank) for s in d.scores] == [("a", 0), ("a", 1)]
    assert decide(cands, prompt_tokens=48, block_size=BS, allowed=["z"]) is None
    merged = merge_candidates(cands, [Holder("a", 1), Holder("c", 0)])
    assert [(c.worker_id, c.dp_rank, c.overlap_blocks) for c in merged] == [("a", 1, 1), ("c", 0, 0)]
    assert merge_candidates(cands, None) == cands


# ---------------------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("body", "field", "text"),
    [
        ({"model": "m", "token_ids": [1, "x"]}, "token_ids", "$.token_ids[1]"),
        ({"model": 3, "token_ids": [1]}, "model", "Expected `str`"),
        ({"token_ids": [1]}, "model", "missing required field `model`"),
        ({"model": "m", "token_ids": [1], "explain": "yes"}, "explain", "Expected `bool`"),
        ({"model": "m", "token_ids": [1], "policy": {"temperature": "hot"}}, "policy.temperature", "float"),
        ({"model": "m", "token_ids": [1], "policy": {"temprature": 1}}, "policy.temprature", "unknown field"),
        ({"model": "m", "token_ids": [1], "policy": {"temperature": -1}}, "policy.temperature", "≥ 0"),
        (
            {"model": "m", "token_ids": [1], "policy": {"tier_weights": {"CPU": 2}}},
            "policy.tier_weights.CPU",
            "[0, 1]",
        ),
        ({"model": "m", "token_ids": [1, 2, 3, 4, 5]}, "token_ids", "more than the limit of 4"),
        ({"model": "m", "token_ids": [-1]}, "token_ids", "token_ids[0] is outside [0, 2^32)"),
        ({"model": "m", "token_ids": [7, 2**32]}, "token_ids", "token_ids[1] is outside [0, 2^32)"),
        (
            {"model": "m", "token_ids": [7, 2**32 - 1, 2**64]},
            "token_ids",
            "token_ids[2] is outside [0, 2^32)",
        ),
    ],
)
def test_bad_requests_name_the_field(body: dict[str, object], field: str, text: str) -> None:
    """Each invalid request raises RequestError naming the field at fault."""
    with pytest.raises(RequestError) as err:
        parse_route_request(json.dumps(body).encode(), max_tokens=4)
    assert err.value.field == field
    assert text in str(err.value)


def test_unknown_top_level_fields_are_ignored() -> None:
    """Unknown top-level fields of any type are ignored (forward compatibility)."""
    req = parse_route_request(b'{"model": "m", "token_ids": [1], "future": {"x": [1]}, "policy": null}')
    assert (req.model, list(req.token_ids), req.policy) == ("m", [1], None)


def test_policy_override_applies_only_given_terms() -> None:
    """A policy override changes only the terms it names."""
    req = parse_route_request(
        b'{"model": "m", "token_ids": [1], "policy": {"overlap_weight": 2, "temperature": 0.5}}'
    )
    assert req.policy is not None
    pol = apply_override(Policy(decode_weight=3.0), req.policy)
    assert (pol.overlap_weight, pol.decode_weight, pol.temperature, pol.busy_waiting) == (2.0, 3.0, 0.5, 8)


def test_deeply_nested_unknown_field_is_a_bad_request() -> None:
    """An unknown field nested 50,000 objects deep is a RequestError, not a RecursionError."""
    from kvmesh.core.errors import RequestError
    from kvmesh.core.route import parse_route_request

    body = b'{"model": "m", "token_ids": [1, 2], "x": ' + b'{"a":' * 50_000 + b"1" + b"}" * 50_000 + b"}"
    with pytest.raises(RequestError, match="nested too deeply"):
        parse_route_request(body)
