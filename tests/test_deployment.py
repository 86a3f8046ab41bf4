"""The deployment files are consistent with the code (no Docker engine is needed to check this).

docker-compose.yml cannot be started on machines without a Docker engine; these tests check what can be
checked without one: the file parses, every kvmesh service runs a real subcommand whose flags parse, and
ports and worker ids line up between the simulated workers and their ingests.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_compose_services_use_valid_kvmesh_commands() -> None:
    """Every built service's command is a kvmesh subcommand whose flags parse (checked with --print-config)."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"nats", "sim", "ingest-0", "ingest-1", "indexer", "router"}
    for name, svc in services.items():
        if "build" not in svc:
            continue
        cmd = svc["command"]
        if cmd[0] in ("ingest", "indexer", "router"):
            proc = subprocess.run(
                [sys.executable, "-m", "kvmesh.cli", *cmd, "--print-config"],
                capture_output=True,
                check=False,
                text=True,
                timeout=60,
            )
            assert proc.returncode == 0, (name, proc.stderr)
            assert '"nats_url"' in proc.stdout


def test_compose_ingests_point_at_their_simulated_workers() -> None:
    """ingest-i reads sim-i on base+20i and replays on base+20i+10, as kvmesh sim lays out its ports."""
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for i in (0, 1):
        cmd = services[f"ingest-{i}"]["command"]
        args = dict(zip(cmd[1::2], cmd[2::2], strict=False))
        assert args["--worker-id"] == f"sim-{i}"
        assert args["--zmq-endpoint"] == f"tcp://sim:{5557 + 20 * i}"
        assert args["--replay-endpoint"] == f"tcp://sim:{5567 + 20 * i}"
