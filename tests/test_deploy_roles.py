"""The role boundaries of deploy/nats: a secured 3-node cluster from cluster.conf with fresh `kvmesh gen-creds`
output refuses what each role may not do, with the server's exact permissions violation; plus gen-creds itself
(files, modes, --force, certificate names, no seed on stdout)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import socket
import ssl
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from ipaddress import ip_address
from pathlib import Path

import nats
import nats.errors
import pytest
from cryptography import x509
from nats.aio.client import Client
from nats.aio.msg import Msg

from kvmesh.client import AuthorizationError, NatsAuth, Router, TLSError
from kvmesh.deploy import creds
from kvmesh.deploy.nodes import LocalNodes
from kvmesh.harness.ports import free_block
from kvmesh.runtime import subjects
from kvmesh.runtime.nats import connect, connect_options

KVMESH = [sys.executable, "-m", "kvmesh.cli"]
MODEL = "roles-model"
WORKERS = ["sim-0", "sim-1"]
STREAM = subjects.STREAM
SNAPS = subjects.snapshot_bucket(STREAM)


@dataclass
class Deployment:
    """The secured cluster, its secrets and the kvmesh processes running on it."""

    nodes: LocalNodes
    secrets: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def auth(self, role: str) -> NatsAuth:
        return NatsAuth(
            nats_nkey_seed_file=str(self.nodes.seed_file(role)),
            nats_tls_ca_file=str(self.nodes.ca_file),
            nats_inbox_prefix=creds.inbox_prefix(role),
        )

    def run(self, role: str, *args: str, log: Path) -> subprocess.Popen[bytes]:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.nodes.env(role))
        with open(log, "ab") as out:
            proc = subprocess.Popen([*KVMESH, *args], env=env, stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """cluster.conf's 3 nodes with fresh secrets, provisioned at R3, a simulated engine, its ingest and a router."""
    root = tmp_path_factory.mktemp("deploy")
    secrets = root / "secrets"
    creds.generate(secrets, workers=WORKERS)
    nodes = LocalNodes(root / "nodes", secrets_dir=secrets).start()
    d = Deployment(nodes, secrets)
    try:
        env = dict(os.environ, **nodes.env("operator"))
        done = subprocess.run(
            [*KVMESH, "provision", "--replicas", "3"], env=env, check=False, capture_output=True, timeout=60
        )
        assert done.returncode == 0, done.stderr.decode()
        base = free_block(12)
        d.run(
            "sim", "sim", "--worker-id=sim-0", f"--base-port={base}", "--block-size=16", log=root / "sim.log"
        )
        d.run("ingest-sim-0", "ingest", "--worker-id=sim-0", f"--model={MODEL}", "--block-size=16",
              f"--zmq-endpoint=tcp://127.0.0.1:{base}", f"--replay-endpoint=tcp://127.0.0.1:{base + 10}",
              log=root / "ingest.log")  # fmt: skip
        d.run("router", "router", log=root / "router.log")
        yield d
    finally:
        for p in d.procs:
            p.terminate()
        for p in d.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        nodes.stop()


class Errors:
    """The asynchronous errors (server -ERR lines) one connection received."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self._more = asyncio.Event()

    async def cb(self, exc: Exception) -> None:
        self.seen.append(str(exc))
        self._more.set()

    async def wait(self, count: int = 1, timeout_s: float = 5.0) -> list[str]:
        """The errors so far, once there are ``count`` of them (or after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while len(self.seen) < count and time.monotonic() < deadline:
            self._more.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._more.wait(), max(0.0, deadline - time.monotonic()))
        return self.seen


@pytest.fixture
async def as_role(deployment: Deployment) -> AsyncIterator[object]:
    """Connect as a role: ``await as_role(role)`` → (connection, its errors); all closed at the end."""
    opened: list[Client] = []

    async def open_(role: str) -> tuple[Client, Errors]:
        errors = Errors()
        nc = await nats.connect(
            deployment.nodes.urls.split(","),
            error_cb=errors.cb,
            allow_reconnect=False,
            **connect_options(deployment.auth(role)),
        )
        opened.append(nc)
        return nc, errors

    yield open_
    for nc in opened:
        await nc.close()


def _pub_violation(subject: str) -> str:
    """The error nats-py reports for the server's publish violation (it lower-cases the -ERR line)."""
    return f'nats: permissions violation for publish to "{subject}"'.lower()


def _sub_violation(subject: str) -> str:
    """The error nats-py reports for the server's subscription violation (lower-cased)."""
    return f'nats: permissions violation for subscription to "{subject}"'.lower()


async def _js_refused(nc: Client, errors: Errors, subject: str, body: bytes = b"") -> None:
    """A JetStream API request on ``subject`` gets no answer and the server reports the publish violation."""
    with pytest.raises(nats.errors.TimeoutError):
        await nc.request(subject, body, timeout=1.0)
    assert _pub_violation(subject) in await errors.wait()


pytestmark = [pytest.mark.nats, pytest.mark.e2e, pytest.mark.slow, pytest.mark.anyio]


async def _route_ok(deployment: Deployment) -> None:
    """Wait until the real router answers a client's route with sim-0."""
    deadline = time.monotonic() + 60
    last: object = None
    while time.monotonic() < deadline:
        try:
            async with await Router.connect(deployment.nodes.urls, auth=deployment.auth("client")) as r:
                reply = await r.route(MODEL, list(range(32)))
            if reply.worker_id == "sim-0":
                return
            last = reply
        except Exception as exc:  # the router or the worker may still be starting
            last = exc
        await asyncio.sleep(0.5)
    raise AssertionError(f"no route to sim-0: {last!r}")


async def test_client_cannot_answer_route_and_the_real_router_still_does(
    deployment: Deployment, as_role: object
) -> None:
    """A client's fake kvmesh.route responder is refused; the caller gets the real router's answer."""
    await _route_ok(deployment)
    nc, errors = await as_role("client")  # type: ignore[operator]
    fake: list[bytes] = []

    async def answer(msg: Msg) -> None:
        fake.append(msg.data)
        await msg.respond(b'{"worker_id": "evil"}')

    await nc.subscribe(subjects.ROUTE_SUBJECT, queue=subjects.ROUTER_QUEUE, cb=answer)
    assert await errors.wait() == [
        _sub_violation(subjects.ROUTE_SUBJECT) + f' using queue "{subjects.ROUTER_QUEUE}"'
    ]
    async with await Router.connect(deployment.nodes.urls, auth=deployment.auth("client")) as r:
        for _ in range(5):
            assert (await r.route(MODEL, list(range(32)))).worker_id == "sim-0"
    assert fake == []


async def test_no_role_reads_another_roles_replies(as_role: object) -> None:
    """A client may subscribe below its own inbox prefix only: every inbox (``_INBOX.>``) and the router's and
    operator's inboxes are subscription violations."""
    nc, errors = await as_role("client")  # type: ignore[operator]
    await nc.subscribe("_INBOX_client.mine")
    for n, subject in enumerate(("_INBOX.>", "_INBOX_router.>", "_INBOX_operator.>"), start=1):
        await nc.subscribe(subject)
        assert await errors.wait(n) == [
            _sub_violation(s) for s in ("_INBOX.>", "_INBOX_router.>", "_INBOX_operator.>")[:n]
        ]


async def test_client_cannot_publish_kv_events(as_role: object) -> None:
    """A client's fake KV event on a worker's events subject is a publish violation."""
    nc, errors = await as_role("client")  # type: ignore[operator]
    subject = subjects.events_subject(subjects.EVENTS_PREFIX, MODEL, "sim-0", 0)
    await nc.publish(subject, b"fake")
    await nc.flush()
    assert await errors.wait() == [_pub_violation(subject)]


async def test_client_cannot_read_or_purge_the_stream_or_the_snapshots(as_role: object) -> None:
    """Stream info, message get, purge and the snapshot bucket's info and purge are refused to a client."""
    nc, errors = await as_role("client")  # type: ignore[operator]
    for subject in (
        f"$JS.API.STREAM.INFO.{STREAM}",
        f"$JS.API.STREAM.MSG.GET.{STREAM}",
        f"$JS.API.DIRECT.GET.{STREAM}",
        f"$JS.API.CONSUMER.CREATE.{STREAM}",
        f"$JS.API.STREAM.PURGE.{STREAM}",
        f"$JS.API.STREAM.INFO.OBJ_{SNAPS}",
        f"$JS.API.STREAM.PURGE.OBJ_{SNAPS}",
        f"$JS.API.DIRECT.GET.OBJ_{SNAPS}",
    ):
        await _js_refused(nc, errors, subject, b"{}")
    await nc.subscribe(f"$O.{SNAPS}.>")
    assert _sub_violation(f"$O.{SNAPS}.>") in await errors.wait(len(errors.seen) + 1)


async def test_ingest_cannot_publish_another_workers_events_or_read_snapshots(as_role: object) -> None:
    """sim-0's ingest may not publish sim-1's events nor read the snapshot bucket; its own subject is fine."""
    nc, errors = await as_role("ingest-sim-0")  # type: ignore[operator]
    other = subjects.events_subject(subjects.EVENTS_PREFIX, MODEL, "sim-1", 0)
    await nc.publish(other, b"fake")
    await nc.flush()
    assert await errors.wait() == [_pub_violation(other)]
    await _js_refused(nc, errors, f"$JS.API.STREAM.INFO.OBJ_{SNAPS}")
    await _js_refused(nc, errors, f"$JS.API.CONSUMER.CREATE.OBJ_{SNAPS}", b"{}")
    await _js_refused(nc, errors, f"$JS.API.STREAM.PURGE.{STREAM}", b"{}")
    other_key = f"$KV.{subjects.registry_bucket(STREAM)}.{subjects.kv_key('sim-1')}"
    await nc.publish(other_key, b"{}")
    await nc.flush()
    assert _pub_violation(other_key) in await errors.wait(len(errors.seen) + 1)


async def test_anonymous_connection_is_refused(deployment: Deployment) -> None:
    """TLS without credentials: the server refuses the connection (authorization violation)."""
    with pytest.raises(AuthorizationError) as info:
        await connect(deployment.nodes.urls, name="anon", wait_s=3, **connect_options(
            NatsAuth(nats_tls_ca_file=str(deployment.nodes.ca_file))))  # fmt: skip
    assert str(info.value) == (
        f"cannot connect to NATS at {deployment.nodes.urls}: the server refused the credentials"
        " (authorization violation)"
    )


async def test_connection_without_tls_is_refused(deployment: Deployment) -> None:
    """The client port announces tls_required; a plain-text CONNECT fails the TLS handshake and is closed."""
    with socket.create_connection(("127.0.0.1", deployment.nodes.ports[0]), timeout=5) as s:
        info = s.recv(4096).decode()
        assert info.startswith("INFO ") and json.loads(info[5:])["tls_required"] is True
        s.sendall(b'CONNECT {"verbose":false}\r\nPING\r\n')
        assert s.recv(4096) == b""


async def test_a_client_trusting_another_ca_is_refused(deployment: Deployment, tmp_path: Path) -> None:
    """The nodes present the gen-creds certificate: a client trusting only another CA fails the TLS handshake."""
    other = creds.certificates(["nats-1"])
    (tmp_path / "other-ca.pem").write_bytes(other["ca.pem"])
    auth = NatsAuth(nats_nkey_seed_file=str(deployment.nodes.seed_file("client")),
                    nats_tls_ca_file=str(tmp_path / "other-ca.pem"))  # fmt: skip
    with pytest.raises(TLSError) as info:
        await connect(deployment.nodes.urls, name="x", wait_s=3, **connect_options(auth))
    assert str(info.value) == (
        f"cannot connect to NATS at {deployment.nodes.urls}: TLS handshake failed: CERTIFICATE_VERIFY_FAILED"
        " (the server's certificate is not signed by a CA this process trusts, or does not name the host: "
        "set --nats-tls-ca-file / KVMESH_NATS_TLS_CA_FILE to its CA, --nats-tls-server-name to its name)"
    )


async def test_a_role_without_its_inbox_prefix_is_told_why_its_requests_time_out(
    deployment: Deployment, caplog: pytest.LogCaptureFixture
) -> None:
    """An operator connecting without its inbox prefix may not subscribe to _INBOX.>: its JetStream request
    times out, and the connection logs the server's refusal with the setting that fixes it."""
    auth = NatsAuth(
        nats_nkey_seed_file=str(deployment.nodes.seed_file("operator")),
        nats_tls_ca_file=str(deployment.nodes.ca_file),
    )
    nc = await connect(deployment.nodes.urls, name="no-prefix", wait_s=5, **connect_options(auth))
    try:
        with caplog.at_level(logging.WARNING, logger="kvmesh.runtime.nats"):
            with pytest.raises(nats.errors.TimeoutError):
                await nc.jetstream(timeout=1.0).stream_info(STREAM)
            for _ in range(100):
                if caplog.records:
                    break
                await asyncio.sleep(0.05)
    finally:
        await nc.close()
    (message,) = [r.getMessage() for r in caplog.records]
    assert re.fullmatch(
        r'nats: no-prefix: the server refused: nats: permissions violation for subscription to "_inbox\.\w+\.\*"'
        r"; the reply inbox is not permitted: set --nats-inbox-prefix / KVMESH_NATS_INBOX_PREFIX to the "
        r"role's own prefix",
        message,
    ), message


def test_routes_are_mutual_tls(deployment: Deployment) -> None:
    """Every node routes to the two others over TLS with verify (a plain route port announces tls_required)."""
    for i in range(3):
        varz = deployment.nodes.monitor(i, "/varz")
        assert varz is not None
        assert (varz["cluster"]["tls_required"], varz["cluster"]["tls_verify"]) == (True, True)
        routez = deployment.nodes.monitor(i, "/routez")
        assert routez is not None
        names = {r["remote_name"] for r in routez["routes"]}
        assert names == {n for j, n in enumerate(deployment.nodes.names) if j != i}
    ctx = ssl.create_default_context(cafile=str(deployment.nodes.ca_file))
    with socket.create_connection(("127.0.0.1", deployment.nodes.cluster_ports[0]), timeout=5) as raw:
        with pytest.raises(ssl.SSLError) as info, ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            tls.sendall(b"PING\r\n")  # no client certificate: the node ends the handshake
            tls.recv(4096)
        assert info.value.reason == "TLSV13_ALERT_CERTIFICATE_REQUIRED"


def test_no_violation_from_the_services(deployment: Deployment) -> None:
    """The running ingest, router and simulator never hit a permissions violation with their role's rights."""
    mine = [line for line in deployment.nodes.violations() if "python3:kvmesh-" in line]
    assert mine == []


# ------------------------------------------------------------------ gen-creds


def _gen(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KVMESH, "gen-creds", "--out", str(out), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.nats
def test_gen_creds_files_modes_and_names(tmp_path: Path) -> None:
    """gen-creds writes every file, secrets 0600, certificate SANs = hosts + localhost + 127.0.0.1; no seed printed."""
    out = tmp_path / "s"
    done = _gen(out, "--workers", "w-a,w-b", "--hosts", "n1,n2")
    assert (done.returncode, done.stderr) == (0, "")
    roles = ["operator", "indexer", "router", "client", "sim", "ingest-w-a", "ingest-w-b"]
    names = {"ca.pem", "ca-key.pem", "server.pem", "server-key.pem", "auth.conf", *(f"{r}.nk" for r in roles)}
    assert {p.name for p in out.iterdir()} == names
    secret = {"ca-key.pem", "server-key.pem", *(f"{r}.nk" for r in roles)}
    for p in out.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == (0o600 if p.name in secret else 0o644), p.name
    for r in roles:
        seed = (out / f"{r}.nk").read_text().strip()
        assert seed.startswith("SU") and seed not in done.stdout
    cert = x509.load_pem_x509_certificate((out / "server.pem").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["n1", "n2", "localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [ip_address("127.0.0.1")]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert [o._name for o in eku] == ["serverAuth", "clientAuth"]
    ca = x509.load_pem_x509_certificate((out / "ca.pem").read_bytes())
    cert.verify_directly_issued_by(ca)
    auth = (out / "auth.conf").read_text()
    assert auth.count("nkey: ") == len(roles)
    assert '"kvmesh.events.*.w-a.>"' in auth and '"$KV.KVMESH_EVENTS_WORKERS.w-a"' in auth


@pytest.mark.nats
def test_gen_creds_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    """A second run fails naming the files (exit 1) and changes nothing; --force writes new seeds."""
    out = tmp_path / "s"
    assert _gen(out, "--workers", "w").returncode == 0
    before = (out / "client.nk").read_text()
    again = _gen(out, "--workers", "w")
    assert again.returncode == 1
    assert again.stderr == (
        f"kvmesh gen-creds: {out} already holds ca.pem, ca-key.pem, server.pem, server-key.pem, auth.conf,"
        " operator.nk, indexer.nk, router.nk, client.nk, sim.nk, ingest-w.nk: pass --force to replace them"
        " (rotation)\n"
    )
    assert (out / "client.nk").read_text() == before
    assert _gen(out, "--workers", "w", "--force").returncode == 0
    assert (out / "client.nk").read_text() != before
    assert stat.S_IMODE((out / "client.nk").stat().st_mode) == 0o600
    other = _gen(out, "--workers", "v", "--force")
    assert other.returncode == 0
    assert "  removed ingest-w.nk (its worker is not in --workers)\n" in other.stdout
    assert sorted(p.name for p in out.glob("ingest-*.nk")) == ["ingest-v.nk"]


def test_auth_conf_denies_everything_a_role_is_given_nothing_of() -> None:
    """nats-server reads an empty allow list as no restriction: an empty permission is written as deny all."""
    conf = creds.auth_conf({"client": "UCLIENT"})
    assert 'publish: { allow: ["kvmesh.route", ' in conf
    perms = creds.Permissions(publish=(), subscribe=("x",))
    assert creds._allow(perms.publish) == '{ deny: [">"] }'
    assert creds._allow(perms.subscribe) == '{ allow: ["x"] }'


@pytest.mark.nats
def test_gen_creds_refuses_bad_worker_names(tmp_path: Path) -> None:
    """A worker id that cannot be a file name is refused before anything is written."""
    done = _gen(tmp_path / "s", "--workers", "../x")
    assert (done.returncode, done.stderr) == (
        1,
        "kvmesh gen-creds: worker '../x': use letters, digits, '_', '.' and '-' (up to 100, starting with a"
        " letter or digit)\n",
    )
    assert not (tmp_path / "s").exists()


def test_gen_creds_never_writes_through_a_symbolic_link(tmp_path: Path) -> None:
    """A seed's name taken by a link (dangling or not) is refused before anything is written: a secret never
    lands where the link points."""
    out, elsewhere = tmp_path / "s", tmp_path / "elsewhere.nk"
    out.mkdir()
    (out / "client.nk").symlink_to(elsewhere)
    done = _gen(out, "--workers", "w")
    assert done.returncode == 1
    assert done.stderr == (
        f"kvmesh gen-creds: {out}: client.nk is a symbolic link: refusing to write a secret through it\n"
    )
    assert not elsewhere.exists()
    assert sorted(p.name for p in out.iterdir()) == ["client.nk"]


def test_a_failed_rotation_changes_nothing(tmp_path: Path) -> None:
    """A --force run that cannot finish (a seed's name taken by a directory) leaves every earlier file as it
    was, auth.conf and the seeds still matching."""
    out = tmp_path / "s"
    assert _gen(out, "--workers", "w").returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (out / "sim.nk").unlink()
    (out / "sim.nk").mkdir()
    done = _gen(out, "--workers", "w", "--force")
    assert done.returncode == 1
    assert done.stderr == f"kvmesh gen-creds: {out}: sim.nk is a directory: nothing was changed\n"
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert after == {k: v for k, v in before.items() if k != "sim.nk"}
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["--workers", "a.b,a_b"], "--workers: ingest-a.b and ingest-a_b would share one reply inbox prefix"),
        (["--stream", ">"], "--stream '>': a stream name is letters, digits, '_' and '-' (up to 100)"),
        (["--stream", "bad stream"], "--stream 'bad stream': a stream name is letters, digits"),
    ],
)
def test_gen_creds_refuses_names_that_would_weaken_or_break_the_permissions(
    tmp_path: Path, args: list[str], why: str
) -> None:
    done = _gen(tmp_path / "s", *args)
    assert done.returncode == 1
    assert done.stderr.startswith(f"kvmesh gen-creds: {why}"), done.stderr
    assert not (tmp_path / "s").exists()


def test_a_host_given_as_an_address_is_an_ip_name_of_the_certificate(tmp_path: Path) -> None:
    out = tmp_path / "s"
    assert _gen(out, "--workers", "w", "--hosts", "nats-1,10.0.0.5").returncode == 0
    cert = x509.load_pem_x509_certificate((out / "server.pem").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["nats-1", "localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [ip_address("10.0.0.5"), ip_address("127.0.0.1")]
