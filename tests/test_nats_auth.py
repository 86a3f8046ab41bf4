"""NATS credentials and TLS: user/password, token, NKey and client-certificate TLS servers, reached by a service,
`kvmesh status` and `Router.connect` with the right settings; the wrong ones fail typed, and no secret leaks."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import nkeys
import pytest

from kvmesh.client import AuthorizationError, ConnectError, NatsAuth, Router, TLSError
from kvmesh.core.errors import ConfigError
from kvmesh.harness.server import NatsServer
from kvmesh.runtime.config import load
from kvmesh.runtime.nats import StreamSettings, close_quietly, connect, connect_options, ensure_stream

KVMESH = str(Path(sys.executable).parent / "kvmesh")
PASSWORD = "pw-Kq93xZ-alpha"
WRONG_PASSWORD = "pw-Wr0ng-bravo"
TOKEN = "tok-7fQ2mZ-charlie"
WRONG_TOKEN = "tok-Wr0ng-delta"


@dataclass(frozen=True)
class Case:
    """One secured server: the settings that reach it, wrong ones, and every secret value that must not leak."""

    kind: str
    url: str
    good: NatsAuth
    bad: NatsAuth
    error: type[ConnectError]
    secrets: list[str] = field(default_factory=list)


def _server(tmp: Path, conf: str) -> NatsServer:
    path = tmp / "server.conf"
    path.write_text(conf)
    return NatsServer(args=["-c", str(path)]).start()


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _make_certs(d: Path) -> None:
    """A CA, a server certificate for the name nats.test, and a client certificate, all signed by the CA."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=kvmesh test CA",
             "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"))  # fmt: skip
    for name, ext in (("server", "subjectAltName=DNS:nats.test"), ("client", "extendedKeyUsage=clientAuth")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                 "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.csr"))  # fmt: skip
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl("x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / "ca.pem"),
                 "-CAkey", str(d / "ca.key"), "-CAcreateserial", "-days", "1",
                 "-extfile", str(d / f"{name}.ext"), "-out", str(d / f"{name}.pem"))  # fmt: skip


def _seed_file(d: Path, name: str) -> tuple[Path, str, str]:
    """Write a fresh NKey user seed to ``d/name``: (the file, the seed, the public key)."""
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    public = nkeys.from_seed(bytearray(seed)).public_key.decode()
    path = d / name
    path.write_bytes(seed + b"\n")
    return path, seed.decode(), public


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _jwt(signer: nkeys.KeyPair, subject: str, nats: dict[str, object]) -> str:
    """A NATS JWT (v2) for ``subject`` with the claims ``nats``, signed by ``signer``'s NKey."""
    head = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    claims = {
        "jti": _b64(os.urandom(16)).upper(),
        "iat": int(time.time()),
        "iss": signer.public_key.decode(),
        "name": subject[:8],
        "sub": subject,
        "nats": {**nats, "version": 2},
    }
    body = _b64(json.dumps(claims).encode())
    return f"{head}.{body}.{_b64(signer.sign(f'{head}.{body}'.encode()))}"


def _keypair(prefix: int) -> tuple[str, nkeys.KeyPair]:
    seed = nkeys.encode_seed(os.urandom(32), prefix)
    return seed.decode(), nkeys.from_seed(bytearray(seed))


def _creds_file(path: Path, account: nkeys.KeyPair) -> str:
    """Write a ``.creds`` file for a fresh user of ``account``; return the user's seed."""
    seed, user = _keypair(nkeys.PREFIX_BYTE_USER)
    claims: dict[str, object] = {"type": "user", "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1}
    token = _jwt(account, user.public_key.decode(), claims)
    path.write_text(
        f"-----BEGIN NATS USER JWT-----\n{token}\n------END NATS USER JWT------\n\n"
        f"-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"
    )
    return seed


def _operator_conf(d: Path) -> tuple[str, Path, str, Path]:
    """An operator-mode server config with one JetStream account (memory resolver): the config text, a
    ``.creds`` file of a user of that account with its seed, and one of an account the server does not know."""
    _, operator = _keypair(nkeys.PREFIX_BYTE_OPERATOR)
    _, account = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    _, system = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    _, stranger = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    limits: dict[str, object] = {"wildcards": True}
    limits |= {k: -1 for k in ("subs", "conn", "leaf", "imports", "exports", "data", "payload")}
    js_limits = limits | {k: -1 for k in ("mem_storage", "disk_storage", "streams", "consumer")}
    acc, sys_acc = account.public_key.decode(), system.public_key.decode()
    op_jwt = _jwt(operator, operator.public_key.decode(), {"type": "operator", "system_account": sys_acc})
    conf = (
        f"operator: {op_jwt}\nsystem_account: {sys_acc}\nresolver: MEMORY\nresolver_preload: {{\n"
        f"  {acc}: {_jwt(operator, acc, {'type': 'account', 'limits': js_limits})}\n"
        f"  {sys_acc}: {_jwt(operator, sys_acc, {'type': 'account', 'limits': limits})}\n}}\n"
    )
    good_seed = _creds_file(d / "user.creds", account)
    bad_seed = _creds_file(d / "stranger.creds", stranger)
    return conf, d / "user.creds", f"{good_seed} {bad_seed}", d / "stranger.creds"


@pytest.fixture(scope="module", params=["user", "token", "nkey", "creds", "tls"])
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Case]:
    """A nats-server secured one way (a fresh one per kind, from a config file)."""
    kind = str(request.param)
    d = tmp_path_factory.mktemp(kind)
    if kind == "user":
        server = _server(d, f'authorization {{ user: alice, password: "{PASSWORD}" }}\n')
        good = NatsAuth(nats_user="alice", nats_password=PASSWORD)
        bad = NatsAuth(nats_user="alice", nats_password=WRONG_PASSWORD)
        c = Case(kind, server.url, good, bad, AuthorizationError, [PASSWORD, WRONG_PASSWORD])
    elif kind == "token":
        server = _server(d, f'authorization {{ token: "{TOKEN}" }}\n')
        good, bad = NatsAuth(nats_token=TOKEN), NatsAuth(nats_token=WRONG_TOKEN)
        c = Case(kind, server.url, good, bad, AuthorizationError, [TOKEN, WRONG_TOKEN])
    elif kind == "nkey":
        seed_path, seed, public = _seed_file(d, "user.nk")
        other_path, other, _ = _seed_file(d, "other.nk")
        server = _server(d, f'authorization {{ users: [ {{ nkey: "{public}" }} ] }}\n')
        good = NatsAuth(nats_nkey_seed_file=str(seed_path))
        bad = NatsAuth(nats_nkey_seed_file=str(other_path))
        c = Case(kind, server.url, good, bad, AuthorizationError, [seed, other])
    elif kind == "creds":
        conf, good_path, seeds, bad_path = _operator_conf(d)
        server = _server(d, conf)
        good, bad = NatsAuth(nats_creds_file=str(good_path)), NatsAuth(nats_creds_file=str(bad_path))
        c = Case(kind, server.url, good, bad, AuthorizationError, seeds.split())
    else:
        if shutil.which("openssl") is None:
            pytest.skip("openssl is needed to make the certificates")
        _make_certs(d)
        conf = (
            f'tls {{ cert_file: "{d / "server.pem"}", key_file: "{d / "server.key"}", '
            f'ca_file: "{d / "ca.pem"}", verify: true }}\n'
        )
        server = _server(d, conf)
        good = NatsAuth(
            nats_tls_ca_file=str(d / "ca.pem"),
            nats_tls_cert_file=str(d / "client.pem"),
            nats_tls_key_file=str(d / "client.key"),
            nats_tls_server_name="nats.test",
        )
        bad = replace(good, nats_tls_ca_file=str(d / "client.pem"))  # a CA that did not sign the server's
        key_body = (d / "client.key").read_text().splitlines()[1]
        c = Case(kind, f"tls://127.0.0.1:{server.port}", good, bad, TLSError, [key_body])
    try:
        yield c
    finally:
        server.stop()


def _env(auth: NatsAuth) -> dict[str, str]:
    """The ``KVMESH_NATS_*`` variables that carry ``auth`` (the way a deployment passes secrets)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    for name in (f for f in NatsAuth.__dataclass_fields__):
        value = getattr(auth, name)
        if value:
            env[f"KVMESH_{name.upper()}"] = value
    return env


def _kvmesh(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run ``kvmesh <args>`` with ``env``: its exit status and output."""
    return subprocess.run([KVMESH, *args], check=False, capture_output=True, text=True, env=env, timeout=30)


def _assert_clean(text: str, case: Case) -> None:
    for secret in case.secrets:
        assert secret not in text


@pytest.mark.anyio
async def test_router_connect_with_the_right_settings_and_status_sees_the_stream(
    case: Case, uid: str
) -> None:
    """Router.connect with the right settings connects, and kvmesh status (settings from the environment)
    reads the stream it made."""
    router = await Router.connect(case.url, connect_timeout_s=5.0, auth=case.good)
    stream = f"S{uid}"
    try:
        nc = await connect(case.url, name="test", wait_s=5.0, **connect_options(case.good))
        await ensure_stream(nc.jetstream(), StreamSettings(name=stream, prefix=f"p{uid}", memory=True))
        await close_quietly(nc)
    finally:
        await router.aclose()
    r = await asyncio.to_thread(
        _kvmesh, ["status", "--json", "--nats-url", case.url, "--stream", stream], _env(case.good)
    )
    assert (r.returncode, r.stderr) == (0, "")
    assert json.loads(r.stdout)["stream"]["name"] == stream
    _assert_clean(r.stdout, case)


@pytest.mark.anyio
async def test_router_connect_with_the_wrong_settings_fails_typed_without_the_secret(case: Case) -> None:
    """Router.connect with the wrong settings raises the typed error, and its text holds no secret."""
    with pytest.raises(ConnectError) as info:
        await Router.connect(case.url, connect_timeout_s=3.0, auth=case.bad)
    assert type(info.value) is case.error
    text = f"{info.value} {info.value!r} {info.value.args}"
    if case.error is AuthorizationError:
        assert str(info.value) == (
            f"cannot connect to NATS at {case.url}: the server refused the credentials (authorization violation)"
        )
    else:
        assert str(info.value).startswith(f"cannot connect to NATS at {case.url}: TLS handshake failed: ")
    _assert_clean(text, case)


def test_status_with_the_wrong_settings_exits_1_without_the_secret(case: Case) -> None:
    """kvmesh status with the wrong settings (flags) exits 1 with one line that names no secret."""
    flags: list[str] = []
    for name in NatsAuth.__dataclass_fields__:
        value = getattr(case.bad, name)
        if value:
            flags.append(f"--{name.replace('_', '-')}={value}")
    r = _kvmesh(["status", "--nats-url", case.url, *flags], _env(NatsAuth()))
    assert r.returncode == 1
    assert r.stdout == ""
    assert r.stderr.startswith(f"kvmesh status: cannot connect to NATS at {case.url}: ")
    assert r.stderr.count("\n") == 1
    _assert_clean(r.stderr, case)


def _service_log(case: Case, auth: NatsAuth, until: str, timeout_s: float = 20.0) -> str:
    """Run ``kvmesh indexer`` with ``auth`` in its environment until its log shows ``until``; return the log."""
    proc = subprocess.Popen(
        [KVMESH, "indexer", "--nats-url", case.url, "--stream", "NOSTREAM", "--log-level", "DEBUG"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env(auth),
    )  # fmt: skip
    lines: list[str] = []
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if until in line:
                break
        title = Path(f"/proc/{proc.pid}/cmdline")
        if title.exists():  # what ps shows for the process
            lines.append(title.read_bytes().replace(b"\0", b" ").decode(errors="replace"))
    finally:
        proc.terminate()
        try:
            rest = proc.communicate(timeout=10)[1] or ""
        except subprocess.TimeoutExpired:
            proc.kill()
            rest = proc.communicate()[1] or ""
    return "".join(lines) + rest


def test_indexer_connects_with_the_right_settings(case: Case) -> None:
    """The indexer, given the right settings in KVMESH_NATS_*, connects and waits for its stream."""
    log = _service_log(case, case.good, "waiting for stream NOSTREAM to exist")
    assert "waiting for stream NOSTREAM to exist" in log
    _assert_clean(log, case)


def test_indexer_with_the_wrong_settings_keeps_trying_and_logs_no_secret(case: Case) -> None:
    """The indexer, given wrong settings, warns that it cannot connect, naming the cause, and logs no secret."""
    log = _service_log(case, case.bad, "still trying")
    assert f"nats: cannot connect to {case.url} (kvmesh-indexer-" in log
    why = "authorization violation" if case.error is AuthorizationError else "TLS handshake failed"
    assert why in log
    _assert_clean(log, case)


def test_print_config_redacts_every_secret(case: Case) -> None:
    """kvmesh router --print-config with the settings from the environment shows no secret value."""
    r = _kvmesh(["router", "--print-config", "--nats-url", case.url], _env(case.good))
    assert r.returncode == 0
    shown = json.loads(r.stdout)
    _assert_clean(r.stdout, case)
    assert shown["nats_password"] == ("***" if case.good.nats_password else "")
    assert shown["nats_token"] == ("***" if case.good.nats_token else "")
    assert shown["nats_nkey_seed_file"] == case.good.nats_nkey_seed_file
    assert shown["nats_tls_server_name"] == case.good.nats_tls_server_name


def test_toml_flags_and_environment_reach_the_same_settings(tmp_path: Path) -> None:
    """The credentials load from TOML, the environment over it, and flags over both."""
    conf = tmp_path / "router.toml"
    conf.write_text(
        '[router]\nnats_user = "alice"\nnats_password = "from-toml"\nnats_tls_server_name = "a"\n'
    )
    from kvmesh.router.config import RouterSettings

    s = load(RouterSettings, service="router", environ={"KVMESH_NATS_PASSWORD": "from-env"}, config_file=conf)
    assert (s.nats_user, s.nats_password, s.nats_tls_server_name) == ("alice", "from-env", "a")


def test_two_ways_of_authenticating_are_refused() -> None:
    """Settings with both a token and a user are refused with one problem naming both flags."""
    with pytest.raises(ConfigError) as info:
        load(NatsAuth, service="nats", environ={"KVMESH_NATS_TOKEN": "t0k", "KVMESH_NATS_USER": "u"})
    assert info.value.problems == [
        "give one way of authenticating to NATS, not --nats-user/--nats-password and --nats-token"
    ]


def test_connect_options_map_every_form(tmp_path: Path) -> None:
    """connect_options turns each form into the nats-py option it names."""
    seed_path, _, _ = _seed_file(tmp_path, "u.nk")
    _, account = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    creds = tmp_path / "u.creds"
    _creds_file(creds, account)
    assert connect_options(NatsAuth(nats_user="u", nats_password="p")) == {"user": "u", "password": "p"}
    assert connect_options(NatsAuth(nats_token="t")) == {"token": "t"}
    assert connect_options(NatsAuth(nats_creds_file=str(creds))) == {"user_credentials": str(creds)}
    assert connect_options(NatsAuth(nats_nkey_seed_file=str(seed_path))) == {"nkeys_seed": str(seed_path)}
    assert connect_options(NatsAuth(nats_inbox_prefix="_INBOX_router")) == {"inbox_prefix": "_INBOX_router"}


@pytest.mark.parametrize("prefix", ["_INBOX.>", "a..b", "a.*", "a b", ".a", "a."])
def test_an_inbox_prefix_that_is_not_literal_subject_tokens_is_refused(prefix: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(NatsAuth, service="nats", environ={"KVMESH_NATS_INBOX_PREFIX": prefix})
    assert info.value.problems == [
        f"--nats-inbox-prefix {prefix!r} is not a subject prefix "
        "(tokens of letters, digits, _ and - separated by dots; no wildcards; at most 200 characters)"
    ]


def test_a_seed_file_without_a_valid_seed_is_refused_without_its_content(tmp_path: Path) -> None:
    """An NKey seed file or .creds file that holds no valid seed is a ConfigError naming the file, not its text."""
    bad = tmp_path / "bad.nk"
    bad.write_text("SUNOTASEED-secret-looking-text\n")
    with pytest.raises(ConfigError) as info:
        connect_options(NatsAuth(nats_nkey_seed_file=str(bad)))
    assert info.value.problems == [f"--nats-nkey-seed-file: {bad} holds no valid NKey seed"]
    with pytest.raises(ConfigError) as info:
        connect_options(NatsAuth(nats_creds_file=str(bad)))
    assert info.value.problems == [
        f"--nats-creds-file: {bad} is not a .creds file (a user JWT and an NKey seed)"
    ]


@pytest.mark.anyio
@pytest.mark.parametrize("case", ["tls"], indirect=True)
async def test_tls_without_a_client_certificate_is_refused(case: Case) -> None:
    """A server with ``verify: true`` refuses a client that trusts it but shows no certificate (TLSError)."""
    anonymous = replace(case.good, nats_tls_cert_file="", nats_tls_key_file="")
    with pytest.raises(ConnectError) as info:
        await Router.connect(case.url, connect_timeout_s=3.0, auth=anonymous)
    assert type(info.value) is TLSError
    assert str(info.value) == (
        f"cannot connect to NATS at {case.url}: TLS handshake failed: TLSV13_ALERT_CERTIFICATE_REQUIRED"
    )


@pytest.mark.parametrize(
    "service", [["ingest", "--worker-id", "w1", "--model", "m"], ["indexer"], ["router"]], ids=lambda a: a[0]
)
def test_every_service_redacts_its_secrets_in_print_config(service: list[str]) -> None:
    """Each service shows a password from its environment and a token from its flags as ``***`` only."""
    env = _env(NatsAuth(nats_user="alice", nats_password=PASSWORD))
    r = _kvmesh([*service, "--print-config"], env)
    assert r.returncode == 0, r.stderr
    assert (json.loads(r.stdout)["nats_user"], json.loads(r.stdout)["nats_password"]) == ("alice", "***")
    assert PASSWORD not in r.stdout
    r = _kvmesh([*service, "--print-config", f"--nats-token={TOKEN}"], _env(NatsAuth()))
    assert (r.returncode, json.loads(r.stdout)["nats_token"]) == (0, "***")
    assert TOKEN not in r.stdout


def test_a_service_with_a_missing_creds_file_exits_2_naming_it(tmp_path: Path) -> None:
    """A service given a .creds file that does not exist stops at once with exit 2, naming the flag and file."""
    missing = tmp_path / "none.creds"
    r = _kvmesh(["router", f"--nats-creds-file={missing}"], _env(NatsAuth()))
    assert r.returncode == 2
    assert r.stderr.endswith(
        f"invalid configuration:\n  --nats-creds-file / KVMESH_NATS_CREDS_FILE: no such file: {missing}\n"
    )


def test_an_operator_command_reads_its_credentials_from_a_toml_file(case: Case, tmp_path: Path) -> None:
    """kvmesh status --config FILE takes the [nats] table of a file that also holds a service's table."""
    lines = [
        f'{name} = "{getattr(case.good, name)}"'
        for name in NatsAuth.__dataclass_fields__
        if getattr(case.good, name)
    ]
    conf = tmp_path / "kvmesh.toml"
    conf.write_text('[router]\nindex = "remote"\n\n[nats]\n' + "\n".join(lines) + "\n")
    r = _kvmesh(
        ["status", "--json", "--nats-url", case.url, "--config", str(conf), "--stream", "NOSTREAM"],
        _env(NatsAuth()),
    )
    assert r.returncode == 1
    assert json.loads(r.stdout)["stream"] == {"name": "NOSTREAM", "error": "stream not found"}
    assert r.stderr == f"kvmesh status: stream NOSTREAM does not exist on {case.url}\n"
    _assert_clean(r.stdout + r.stderr, case)


@pytest.mark.e2e
@pytest.mark.parametrize("case", ["user", "tls"], indirect=True)
def test_up_on_a_secured_server_passes_the_settings_to_every_child(case: Case, tmp_path: Path) -> None:
    """kvmesh up --nats-url with the settings in the environment replays through a secured server, and
    neither its output nor any child's log holds a secret."""
    logs = tmp_path / "logs"
    r = subprocess.run(
        [KVMESH, "up", "--nats-url", case.url, "--requests", "4", "--workers", "1", "--num-blocks", "4096",
         "--log-dir", str(logs)],
        check=False, capture_output=True, text=True, env=_env(case.good), timeout=100,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "replayed 4 requests" in r.stdout
    assert "(0 failed)" in r.stdout
    children = sorted(p.name for p in logs.glob("*.log"))
    assert children == ["indexer.log", "ingest-0.log", "router.log", "sim.log"]
    _assert_clean(r.stdout + r.stderr + "".join(p.read_text() for p in logs.glob("*.log")), case)


def test_up_refuses_credentials_without_a_server_of_its_own() -> None:
    """kvmesh up with a token but no --nats-url exits 2: its embedded server takes no credentials."""
    r = _kvmesh(["up", f"--nats-token={TOKEN}"], _env(NatsAuth()))
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == (
        "kvmesh up: invalid configuration:\n"
        "  NATS credentials and TLS settings need --nats-url (the embedded server has none)\n"
    )
