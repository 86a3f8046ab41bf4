"""The Grafana dashboard and the Prometheus configuration of deploy/ hold together with what the services export.

The dashboard (deploy/grafana/dashboards/kvmesh.json) is valid, its panel ids are unique, every panel queries
through the provisioned data source, every quantile is taken of ``sum by (le, ...)`` of bucket rates, and
every metric it queries is exported by a real ingest, indexer or router: the end-to-end test starts them as
processes with ``--metrics-port 0``, makes each metric exist (events, a gap, a snapshot, a match, routes, a
busy skip, an error, a finish with the engine's cached tokens) and scrapes each endpoint. Prometheus
(deploy/prometheus/prometheus.yml) scrapes exactly the compose services that set ``KVMESH_METRICS_PORT``, on
that port; Grafana's provisioning points at the compose file's Prometheus and the mounted dashboard.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats.errors
import pytest
import yaml
from tests.test_ingest_faults import ANY, BS, T, U, blk, stored

from kvmesh.client import Router
from kvmesh.core import protocol
from kvmesh.core.protocol import MatchRequest, WorkerLoad
from kvmesh.harness.procs import ChildProcesses
from kvmesh.runtime.metrics import parse_exposition
from kvmesh.runtime.nats import connect
from kvmesh.runtime.vllm_metrics import publish_load
from kvmesh.sim.publisher import EventPublisher

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "kvmesh.json"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"
COMPOSE = ROOT / "docker-compose.yml"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
ROWS = [
    "Pipeline: engines → ingest → stream",
    "Index: replicas of the stream",
    "Routing",
    "Reuse: available → captured → delivered",
]
RECEIPTS = (
    "kvmesh_router_available_tokens_total",
    "kvmesh_router_captured_tokens_total",
    "kvmesh_router_delivered_tokens_total",
    "kvmesh_router_delivered_requests_total",
    "kvmesh_router_chosen_requests_total",
    "kvmesh_router_regret_tokens_total",
    "kvmesh_router_misprediction_tokens_total",
    "kvmesh_router_unpredicted_tokens_total",
)
"""The route receipts' counters: the reuse row's metrics (the routing row uses only the chosen requests)."""
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
}
_LISTENING = re.compile(r"metrics on http://[^:]+:(\d+)/metrics")


def _dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return doc


def _panels(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows and the panels of collapsed rows included."""
    for panel in doc["panels"]:
        yield panel
        yield from panel.get("panels", [])


def _queries(doc: dict[str, Any]) -> list[str]:
    """Every PromQL expression: the panels' targets and the query variables'."""
    exprs = [t["expr"] for p in _panels(doc) for t in p.get("targets", [])]
    for var in doc["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(var["query"]["query"])
    return exprs


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: what is left once strings, label matchers, range and
    grouping clauses, function names, keywords and numbers are taken out."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings ("$worker", label values)
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"^label_values\((\w+),\s*\w+\)$", r"\1", text.strip())  # a variable's label_values(m, l)
    text = re.sub(r"\b\d+(?:\.\d+)?(?:[eE][+-]?\d+)?\b", "", text)  # numbers
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        if text[m.end() :].lstrip().startswith("(") or m.group(0) in _KEYWORDS:
            continue  # a function or an aggregation
        names.add(m.group(0))
    return names


def test_metric_names_strip_functions_matchers_and_clauses() -> None:
    """The extraction keeps metric names alone, from every form the dashboard uses."""
    expr = (
        'histogram_quantile(0.99, sum by (le, stage) (rate(kvmesh_router_route_seconds_bucket{stage!="x"}'
        "[$__rate_interval]))) / on() group_left() sum(rate(kvmesh_a_total[5m])) - 1e3"
    )
    assert metric_names(expr) == {"kvmesh_router_route_seconds_bucket", "kvmesh_a_total"}
    assert metric_names("label_values(kvmesh_ingest_batches_total, worker_id)") == {
        "kvmesh_ingest_batches_total"
    }


def test_dashboard_is_valid_with_unique_ids_and_one_data_source() -> None:
    """Schema ≥ 39, the four rows in order, unique panel ids, every panel and query through ${DS_PROMETHEUS}
    (a data source variable of type prometheus), panels inside the 24-column grid without overlap."""
    doc = _dashboard()
    assert doc["schemaVersion"] >= 39
    assert (doc["uid"], doc["title"]) == ("kvmesh", "kvmesh")
    panels = list(_panels(doc))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    assert [p["title"] for p in panels if p["type"] == "row"] == ROWS
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert (variables["DS_PROMETHEUS"]["type"], variables["DS_PROMETHEUS"]["query"]) == (
        "datasource",
        "prometheus",
    )
    assert variables["worker"]["datasource"] == DATASOURCE
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps another panel"
                cells.add((x, y))
        if p["type"] == "row":
            assert "targets" not in p, p["title"]
            continue
        assert p["datasource"] == DATASOURCE, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"] == DATASOURCE, p["title"]
            assert t["expr"].strip(), p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
    assert len(panels) - len(ROWS) == 40


def test_quantiles_and_ratios_are_taken_of_rates() -> None:
    """Every histogram_quantile reads ``sum by (le, ...) (rate(<histogram>_bucket[...]))``; every counter
    (``_total``, ``_bucket``, ``_sum``, ``_count``) is read through rate() or increase(); no mean of ratios
    (no avg)."""
    doc = _dashboard()
    for expr in (t["expr"] for p in _panels(doc) for t in p.get("targets", [])):
        for m in re.finditer(r"histogram_quantile\(", expr):
            inner = expr[m.end() :]
            assert re.match(r"[0-9.]+, sum by \(le(?:, \w+)*\) \(rate\(\w+_bucket[{\[]", inner), expr
        assert "avg" not in expr, expr
        for name in metric_names(expr):
            if name.endswith(("_total", *_HISTOGRAM_SUFFIXES)):
                uses = len(re.findall(rf"\b{name}\b", expr))
                assert len(re.findall(rf"(?:rate|increase)\({name}[{{\[]", expr)) == uses, (name, expr)


def test_each_row_queries_its_own_services_metrics() -> None:
    """The pipeline row reads the ingests', the index row the replicas' (indexers and routers' local ones),
    the routing row the routers' (no receipts but the chosen requests), the reuse row the route receipts."""
    doc = _dashboard()
    row = ""
    by_row: dict[str, set[str]] = {r: set() for r in ROWS}
    for p in doc["panels"]:
        if p["type"] == "row":
            row = p["title"]
            continue
        for t in p["targets"]:
            by_row[row] |= metric_names(t["expr"])
    assert all(n.startswith("kvmesh_ingest_") for n in by_row[ROWS[0]])
    assert all(n.startswith(("kvmesh_indexer_", "kvmesh_router_replica_")) for n in by_row[ROWS[1]])
    routing = by_row[ROWS[2]]
    assert all(n.startswith("kvmesh_router_") and not n.startswith("kvmesh_router_replica_") for n in routing)
    assert routing & set(RECEIPTS) == {"kvmesh_router_chosen_requests_total"}
    assert by_row[ROWS[3]] == set(RECEIPTS)


def _compose_metrics_ports() -> dict[str, int]:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    return {
        name: int(svc["environment"]["KVMESH_METRICS_PORT"])
        for name, svc in services.items()
        if "KVMESH_METRICS_PORT" in (svc.get("environment") or {})
    }


def test_prometheus_scrapes_exactly_the_services_with_a_metrics_port() -> None:
    """One job per service kind; the targets are the compose services that set KVMESH_METRICS_PORT, on that
    port; the instance label becomes the service name."""
    ports = _compose_metrics_ports()
    assert ports == {f"{kind}-{i}": 9464 for kind in ("ingest", "indexer", "router") for i in (0, 1)}
    config = yaml.safe_load(PROMETHEUS.read_text())
    targets: dict[str, list[str]] = {}
    for job in config["scrape_configs"]:
        targets[job["job_name"]] = [t for sc in job["static_configs"] for t in sc["targets"]]
        assert job["relabel_configs"] == [
            {
                "source_labels": ["__address__"],
                "regex": "([^:]+):\\d+",
                "target_label": "instance",
                "replacement": "$1",
            }
        ]
    assert sorted(t for ts in targets.values() for t in ts) == sorted(f"{n}:{p}" for n, p in ports.items())
    for job, ts in targets.items():
        kind = job.removeprefix("kvmesh-")
        assert all(t.startswith(f"{kind}-") for t in ts), job


def test_grafana_provisions_the_compose_prometheus_and_the_mounted_dashboard() -> None:
    """The data source is the compose file's prometheus service on its port (uid prometheus, the default);
    the dashboard provider reads the directory the compose file mounts deploy/grafana/dashboards at; Grafana
    and Prometheus keep their data in named volumes, publish on 127.0.0.1 only and commit no password."""
    (ds,) = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert (ds["type"], ds["uid"], ds["url"], ds["isDefault"]) == (
        "prometheus",
        "prometheus",
        "http://prometheus:9090",
        True,
    )
    (provider,) = yaml.safe_load((PROVISIONING / "dashboards" / "kvmesh.yml").read_text())["providers"]
    doc = yaml.safe_load(COMPOSE.read_text())
    grafana, prometheus = doc["services"]["grafana"], doc["services"]["prometheus"]
    assert grafana["volumes"] == [
        "./deploy/grafana/provisioning/datasources:/etc/grafana/provisioning/datasources:ro",
        "./deploy/grafana/provisioning/dashboards:/etc/grafana/provisioning/dashboards:ro",
        f"./deploy/grafana/dashboards:{provider['options']['path']}:ro",
        "grafana-data:/var/lib/grafana",
    ]
    assert prometheus["volumes"] == [
        "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro",
        "prometheus-data:/prometheus",
    ]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    assert grafana["depends_on"] == {"prometheus": {"condition": "service_healthy"}}
    assert grafana["ports"] == ["127.0.0.1:3000:3000"] and prometheus["ports"] == ["127.0.0.1:9090:9090"]
    env = grafana["environment"]
    # Viewers only: no login form and no basic auth, so Grafana's default admin account cannot be used.
    assert "GF_SECURITY_ADMIN_PASSWORD" not in env
    assert (env["GF_AUTH_DISABLE_LOGIN_FORM"], env["GF_AUTH_BASIC_ENABLED"]) == ("true", "false")
    assert (env["GF_AUTH_ANONYMOUS_ENABLED"], env["GF_AUTH_ANONYMOUS_ORG_ROLE"]) == ("true", "Viewer")
    assert (env["GF_AUTH_ANONYMOUS_ENABLED"], env["GF_AUTH_ANONYMOUS_ORG_ROLE"]) == ("true", "Viewer")
    assert env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == f"{provider['options']['path']}/kvmesh.json"
    assert {"prometheus-data", "grafana-data"} <= set(doc["volumes"])


# ---------------------------------------------------------------------- against real processes


def _family(name: str, histograms: set[str]) -> str:
    """A sample name as its metric family: a histogram's ``_bucket``, ``_sum`` and ``_count`` as its name."""
    for suffix in _HISTOGRAM_SUFFIXES:
        if name.endswith(suffix) and name.removesuffix(suffix) in histograms:
            return name.removesuffix(suffix)
    return name


def _get(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        body: bytes = resp.read()
    return body.decode()


async def _scrape(port: int) -> dict[str, float]:
    return parse_exposition(await asyncio.to_thread(_get, port))


async def _until(port: int, key: str, want: float | None = None, timeout_s: float = 30.0) -> dict[str, float]:
    """Scrape until ``key`` is there (and reads ``want`` when given); return that scrape."""
    deadline = time.monotonic() + timeout_s
    got: dict[str, float] = {}
    while time.monotonic() < deadline:
        got = await _scrape(port)
        if key in got and (want is None or got[key] == want):
            return got
        await asyncio.sleep(0.1)
    raise AssertionError(f"{key} = {got.get(key)}, wanted {'any value' if want is None else want}")


def _port_of(log: Path, procs: ChildProcesses, timeout_s: float = 30.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = _LISTENING.search(log.read_text(errors="replace")) if log.exists() else None
        if found:
            return int(found.group(1))
        procs.check()
        time.sleep(0.1)
    raise AssertionError(f"{log.name}: no metrics port logged")


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[ChildProcesses]:
    children = ChildProcesses(tmp_path)
    try:
        yield children
    finally:
        children.stop()


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_every_metric_the_dashboard_queries_is_exported(
    nats_url: str, uid: str, procs: ChildProcesses, tmp_path: Path
) -> None:
    """Two ingests, an indexer writing snapshots and a local-index router, each scraped after a run that
    makes every dashboard metric exist: every metric family the dashboard queries is among those exported."""
    stream, prefix = f"KVMESH_D_{uid}", f"d{uid}"
    shared = ["--nats-url", nats_url, "--stream", stream, "--events-prefix", f"{prefix}.events"]
    registry = ["--registry-bucket", f"D_{uid}_W"]
    lifecycle = ["--requests-prefix", f"{prefix}.requests", "--load-prefix", f"{prefix}.load"]
    match_subject, route_subject = f"{prefix}.match", f"{prefix}.route"
    pubs = {w: EventPublisher(ANY, ANY) for w in ("w", "v")}
    try:
        procs.spawn(
            "indexer", "-m", "kvmesh.indexer", *shared, *registry, "--replica-id", "idx",
            "--match-subject", match_subject, "--buckets-memory", "--snapshot-every-messages", "2",
            "--metrics-port", "0",
        )  # fmt: skip
        for w, pub in pubs.items():
            procs.spawn(
                f"ingest-{w}", "-m", "kvmesh.ingest", *shared, *registry, "--worker-id", w, "--model", "m",
                "--block-size", str(BS), "--zmq-endpoint", pub.endpoint, "--replay-endpoint",
                str(pub.replay_endpoint), "--stream-memory", "--stream-max-bytes", str(64 * 2**20), "--metrics-port", "0",
            )  # fmt: skip
        procs.spawn(
            "router", "-m", "kvmesh.router", *shared, *registry, *lifecycle, "--route-subject", route_subject,
            "--metrics-port", "0",
        )  # fmt: skip
        ports = {
            name: _port_of(tmp_path / f"{name}.log", procs)
            for name in ("indexer", "ingest-w", "ingest-v", "router")
        }
        for pub in pubs.values():
            await pub.wait_for_subscribers(1, timeout_s=20.0)
        engine = pubs["w"]
        engine.publish([stored([10], blk(T, 0))])
        engine.drop_next(1)
        engine.publish([stored([11], blk(T, 1), parent=10)])  # dropped: a gap and a replay
        engine.publish([stored([12], blk(T, 2), parent=11), stored([13], blk(T, 3), parent=12)])
        pubs["v"].publish([stored([20], blk(U, 0))])
        await _until(ports["ingest-w"], 'kvmesh_ingest_replays_total{dp_rank="0",worker_id="w"}', 1.0)
        await _until(
            ports["router"], 'kvmesh_router_replica_blocks{dp_rank="0",tier="gpu",worker_id="w"}', 4.0
        )
        await _until(
            ports["router"], 'kvmesh_router_replica_blocks{dp_rank="0",tier="gpu",worker_id="v"}', 1.0
        )
        await _until(ports["indexer"], 'kvmesh_indexer_snapshot_size_bytes{replica="idx"}')
        nc = await connect(nats_url, name="test-dashboard")
        try:
            match = MatchRequest(model="m", token_ids=list(T))
            await nc.request(match_subject, protocol.encode(match, format="msgpack"), timeout=5)
            # The router's metrics (and its replica) come up before its route subscription, which waits for
            # the replica to catch up: ask until it answers (an error reply).
            deadline = time.monotonic() + 30
            while True:
                try:
                    await nc.request(route_subject, b"not a route request", timeout=5)
                    break
                except nats.errors.NoRespondersError:
                    assert time.monotonic() < deadline, "the router never subscribed to its route subject"
                    await asyncio.sleep(0.1)
            client = Router(nc, subject=route_subject, requests_prefix=f"{prefix}.requests")
            reply = await client.route("m", list(T), request_id="r1")
            assert (reply.worker_id, reply.cached_tokens) == ("w", len(T))
            await client.finish("r1", cached_tokens=len(T) - BS)
            await _until(
                ports["router"], 'kvmesh_router_delivered_tokens_total{dp_rank="0",worker_id="w"}', 12.0
            )
            await publish_load(nc, WorkerLoad(worker_id="w", kv_usage=0.99), prefix=f"{prefix}.load")
            busy = 'kvmesh_router_busy_skips_total{dp_rank="0",worker_id="w"}'
            deadline = time.monotonic() + 20
            while busy not in await _scrape(ports["router"]):  # the report reaches the router
                assert time.monotonic() < deadline, "no busy skip"
                await client.route("m", list(T))
                await asyncio.sleep(0.1)
        finally:
            await nc.close()
        labels: dict[str, set[str]] = {}
        for port in ports.values():
            for key in await _scrape(port):
                name, _, rest = key.partition("{")
                labels.setdefault(name, set()).update(re.findall(r'(\w+)="', rest))
        samples = set(labels)
    finally:
        for pub in pubs.values():
            pub.close()
    histograms = {n.removesuffix("_bucket") for n in samples if n.endswith("_bucket")}
    exported = {_family(n, histograms) for n in samples}
    queried = {_family(n, histograms) for e in _queries(_dashboard()) for n in metric_names(e)}
    assert queried - exported == set(), "queried but exported by no service"
    assert len(queried) == 47
    for expr in _queries(_dashboard()):  # every label matcher names a label the metric carries
        for m in re.finditer(r"(\w+)\{([^}]*)\}", expr):
            used = set(re.findall(r"(\w+)\s*[=!]~?", m.group(2)))
            assert used <= labels[m.group(1)], (m.group(0), sorted(labels[m.group(1)]))
