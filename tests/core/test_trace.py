"""Tests of Mooncake trace loading and token expansion (`kvmesh.sim.trace`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.sim.trace import (
    TraceFormatError,
    TraceRequest,
    default_trace_path,
    expand_tokens,
    load_trace,
)


def test_shipped_trace_has_1000_requests_and_the_exact_first_request() -> None:
    """The packaged trace loads as 1,000 requests; the first and last are exactly Mooncake's."""
    trace = load_trace(default_trace_path())
    assert len(trace) == 1000
    assert trace[0] == TraceRequest(
        timestamp_ms=0, input_length=6758, output_length=500, hash_ids=tuple(range(14))
    )
    assert trace[1].hash_ids[:2] == (0, 14)
    assert (trace[-1].timestamp_ms, trace[-1].input_length, trace[-1].output_length) == (330000, 19399, 285)
    assert trace[-1].hash_ids[-1] == 21513


def test_limit_reads_only_the_first_requests() -> None:
    """limit=3 returns the first three requests; limit=0 returns none."""
    full = load_trace(default_trace_path())
    assert load_trace(default_trace_path(), limit=3) == full[:3]
    assert load_trace(default_trace_path(), limit=0) == []


def test_expansion_is_deterministic_and_pinned() -> None:
    """The same request always expands to the same tokens, pinned here so other processes agree."""
    req = load_trace(default_trace_path(), limit=1)[0]
    tokens = expand_tokens(req)
    assert tokens == expand_tokens(req)
    assert tokens[:8] == [30480, 7394, 29044, 10212, 30869, 9822, 5917, 6258]
    assert tokens[512:516] == [970, 370, 24036, 31515]
    assert tokens[-3:] == [16742, 18575, 21872]
    assert expand_tokens(req, seed=1)[:4] == [19962, 12191, 23596, 20246]


def test_expanded_tokens_stay_in_the_vocabulary() -> None:
    """Every expanded token id lies in [0, 32000)."""
    req = load_trace(default_trace_path(), limit=1)[0]
    tokens = expand_tokens(req)
    assert all(0 <= t < 32000 for t in tokens)
    assert len(set(tokens)) > 1000


def test_shared_hash_ids_give_a_shared_token_prefix() -> None:
    """Requests 0 and 1 share hash id 0 only: their first 512 tokens are equal, the next 512 differ."""
    r0, r1 = load_trace(default_trace_path(), limit=2)
    t0, t1 = expand_tokens(r0), expand_tokens(r1)
    assert t0[:512] == t1[:512]
    assert t0[512:1024] != t1[512:1024]
    same = TraceRequest(timestamp_ms=5, input_length=512, output_length=1, hash_ids=(14,))
    assert expand_tokens(same) == t1[512:1024]


def test_partial_last_block_is_cut_to_input_length() -> None:
    """6,758 tokens = 13 full blocks + 102 tokens, the prefix of hash id 13's full expansion."""
    req = load_trace(default_trace_path(), limit=1)[0]
    tokens = expand_tokens(req)
    assert len(tokens) == 6758
    whole = expand_tokens(
        TraceRequest(timestamp_ms=0, input_length=512, output_length=0, hash_ids=(req.hash_ids[-1],))
    )
    assert tokens[13 * 512 :] == whole[:102]


def test_trace_block_tokens_changes_the_block_width() -> None:
    """With 16 tokens per id, ids (7, 7) expand to the same 16 tokens twice, cut to 20."""
    req = TraceRequest(timestamp_ms=0, input_length=20, output_length=0, hash_ids=(7, 7))
    tokens = expand_tokens(req, trace_block_tokens=16)
    assert len(tokens) == 20
    assert tokens[16:20] == tokens[:4]


def test_input_length_beyond_the_blocks_is_rejected() -> None:
    """An input_length larger than len(hash_ids) × 512 raises ValueError."""
    req = TraceRequest(timestamp_ms=0, input_length=513, output_length=0, hash_ids=(1,))
    with pytest.raises(ValueError, match="exceeds 1 blocks"):
        expand_tokens(req)


def test_malformed_line_names_its_line(tmp_path: Path) -> None:
    """A line with a missing field raises TraceFormatError carrying the 1-based line number."""
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [1]}\n'
        "\n"
        '{"timestamp": 1, "input_length": 3, "hash_ids": [2]}\n'
    )
    with pytest.raises(TraceFormatError) as info:
        load_trace(path)
    assert (info.value.line, info.value.path) == (3, path)
    assert load_trace(path, limit=1) == [
        TraceRequest(timestamp_ms=0, input_length=3, output_length=1, hash_ids=(1,))
    ]


def test_input_length_that_does_not_fit_the_ids_is_a_format_error(tmp_path: Path) -> None:
    """A line whose input_length exceeds its blocks raises TraceFormatError at load time."""
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(TraceFormatError) as info:
        load_trace(path)
    assert info.value.line == 1
