"""Attacks on the ``--max-blocks`` settings: every way in (flag, ``KVMESH_MAX_BLOCKS``, the TOML file, ``kvmesh
replay --max-blocks``) refuses a bound that is not a positive integer a replica can report, with a message that
names the setting; a valid one reaches the settings unchanged.

A bound above what a status reply can carry (msgpack ints stop at 2^64 − 1) used to be accepted: the replica
then failed every ``kvmesh status`` request instead of refusing to start.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec
import pytest

from kvmesh.cli import replay_command
from kvmesh.core.errors import ConfigError
from kvmesh.core.state import MAX_BLOCKS_LIMIT, IndexState
from kvmesh.indexer.config import IndexerSettings
from kvmesh.router.config import RouterSettings
from kvmesh.runtime.config import add_arguments, load

SERVICES: list[tuple[type[IndexerSettings] | type[RouterSettings], str]] = [
    (IndexerSettings, "indexer"),
    (RouterSettings, "router"),
]
HUGE = "99999999999999999999999999"


def _load_flag(cls: type[IndexerSettings] | type[RouterSettings], service: str, value: str) -> object:
    parser = argparse.ArgumentParser()
    add_arguments(parser, cls, service)
    return load(cls, service=service, environ={}, args=parser.parse_args([f"--max-blocks={value}"]))


@pytest.mark.parametrize(("cls", "service"), SERVICES)
@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("0", "--max-blocks must be ≥ 1 (none: no bound), got 0"),
        ("-3", "--max-blocks must be ≥ 1 (none: no bound), got -3"),
        ("abc", "--max-blocks / KVMESH_MAX_BLOCKS: must be an integer (or none), got "),
        ("2.5", "--max-blocks / KVMESH_MAX_BLOCKS: must be an integer (or none), got "),
        (HUGE, f"--max-blocks must be ≤ {MAX_BLOCKS_LIMIT}, got {HUGE}"),
        (str(2**64), f"--max-blocks must be ≤ {MAX_BLOCKS_LIMIT}, got {2**64}"),
    ],
)
def test_a_bad_bound_is_refused_by_flag_and_environment(
    cls: type[IndexerSettings] | type[RouterSettings], service: str, value: str, problem: str
) -> None:
    with pytest.raises(ConfigError) as by_flag:
        _load_flag(cls, service, value)
    assert any(p.startswith(problem) for p in by_flag.value.problems), by_flag.value.problems
    with pytest.raises(ConfigError) as by_env:
        load(cls, service=service, environ={"KVMESH_MAX_BLOCKS": value})
    assert any(p.startswith(problem) for p in by_env.value.problems), by_env.value.problems


@pytest.mark.parametrize(("cls", "service"), SERVICES)
@pytest.mark.parametrize(
    ("toml", "problem"),
    [
        ("max_blocks = 0", "--max-blocks must be ≥ 1"),
        ("max_blocks = -1", "--max-blocks must be ≥ 1"),
        ("max_blocks = 1.5", "--max-blocks / KVMESH_MAX_BLOCKS: must be an integer (or none), got "),
        ('max_blocks = "lots"', "--max-blocks / KVMESH_MAX_BLOCKS: must be an integer (or none), got "),
        ("max_blocks = 9223372036854775807", ""),  # the limit itself: accepted
    ],
)
def test_a_bad_bound_is_refused_in_the_config_file(
    cls: type[IndexerSettings] | type[RouterSettings],
    service: str,
    toml: str,
    problem: str,
    tmp_path: Path,
) -> None:
    conf = tmp_path / "kvmesh.toml"
    conf.write_text(f"[{service}]\n{toml}\n")
    if not problem:
        assert load(cls, service=service, environ={}, config_file=conf).max_blocks == MAX_BLOCKS_LIMIT
        return
    with pytest.raises(ConfigError) as info:
        load(cls, service=service, environ={}, config_file=conf)
    assert any(p.startswith(problem) for p in info.value.problems), info.value.problems


@pytest.mark.parametrize(("cls", "service"), SERVICES)
def test_a_good_bound_reaches_the_settings(
    cls: type[IndexerSettings] | type[RouterSettings], service: str
) -> None:
    assert load(cls, service=service, environ={"KVMESH_MAX_BLOCKS": "64000"}).max_blocks == 64_000
    assert load(cls, service=service, environ={"KVMESH_MAX_BLOCKS": ""}).max_blocks is None


def test_the_largest_accepted_bound_still_goes_into_a_status_reply() -> None:
    """The limit is what a msgpack status reply can carry; one more cannot be encoded."""
    assert msgspec.msgpack.decode(msgspec.msgpack.encode({"max_blocks": MAX_BLOCKS_LIMIT})) == {
        "max_blocks": MAX_BLOCKS_LIMIT
    }
    with pytest.raises(OverflowError):
        msgspec.msgpack.encode({"max_blocks": 2**64})


def test_the_index_state_refuses_a_bound_above_the_limit() -> None:
    IndexState(max_blocks=MAX_BLOCKS_LIMIT)
    with pytest.raises(ValueError, match=f"max_blocks must be at most {MAX_BLOCKS_LIMIT}, got {2**64}"):
        IndexState(max_blocks=2**64)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "--max-blocks must be ≥ 1, got 0"),
        ("-2", "--max-blocks must be ≥ 1, got -2"),
        ("x", "argument --max-blocks: invalid int value: 'x'"),
        ("1.5", "argument --max-blocks: invalid int value: '1.5'"),
        (HUGE, f"--max-blocks must be ≤ {MAX_BLOCKS_LIMIT}, got {HUGE}"),
    ],
)
def test_replay_refuses_a_bad_bound(value: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        replay_command(["--nats-url", "nats://127.0.0.1:1", f"--max-blocks={value}"])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("cls", "service"), SERVICES)
@pytest.mark.parametrize("value", ["", "none", "None", " NONE "])
def test_none_or_empty_means_no_bound_as_the_help_says(
    cls: type[IndexerSettings] | type[RouterSettings], service: str, value: str
) -> None:
    """The help reads "(none: no bound)": ``--max-blocks none`` and ``KVMESH_MAX_BLOCKS=none`` (or empty)
    leave the bound unset, like every optional number's "none"."""
    by_flag = _load_flag(cls, service, value)
    by_env = load(cls, service=service, environ={"KVMESH_MAX_BLOCKS": value})
    assert isinstance(by_flag, cls) and isinstance(by_env, cls)
    assert (by_flag.max_blocks, by_env.max_blocks) == (None, None)


def test_a_services_own_variable_overrides_the_shared_one() -> None:
    """``KVMESH_MAX_BLOCKS`` sets every replica's bound, ``KVMESH_INDEXER_MAX_BLOCKS`` the indexer's alone (and
    so for every shared setting, such as the NATS URL); neither is ignored."""
    env = {
        "KVMESH_MAX_BLOCKS": "7",
        "KVMESH_INDEXER_MAX_BLOCKS": "99",
        "KVMESH_NATS_URL": "nats://a:4222",
        "KVMESH_ROUTER_NATS_URL": "nats://b:4222",
    }
    indexer = load(IndexerSettings, service="indexer", environ=env)
    router = load(RouterSettings, service="router", environ=env)
    assert (indexer.max_blocks, indexer.nats_url) == (99, "nats://a:4222")
    assert (router.max_blocks, router.nats_url) == (7, "nats://b:4222")


def test_a_bad_value_is_the_problem_alone_in_the_settings_words() -> None:
    """A service given a value it cannot use prints the problem, in the setting's words, without the usage
    block (the command line's shape was fine), and exits 2 before connecting anywhere."""
    import subprocess
    import sys

    kvmesh = str(Path(sys.executable).parent / "kvmesh")
    done = subprocess.run(
        [kvmesh, "indexer", "--max-blocks", "abc"], capture_output=True, text=True, timeout=60, check=False
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.splitlines() == [
        "kvmesh indexer: error: invalid configuration:",
        "  --max-blocks / KVMESH_MAX_BLOCKS: must be an integer (or none), got 'abc'",
    ]
