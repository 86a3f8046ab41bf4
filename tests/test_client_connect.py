"""Connecting to NATS: bounded, typed failures that name the server without its credentials; TLS; lists."""

from __future__ import annotations

import asyncio
import logging
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.client import (
    AuthorizationError,
    BadURLError,
    ConnectError,
    ConnectRefusedError,
    NotNatsServerError,
    Router,
    TLSError,
    UnknownHostError,
)
from kvmesh.harness.server import NatsServer
from kvmesh.runtime.nats import close_quietly, connect, redact_url

pytestmark = pytest.mark.anyio

BOUND_S = 1.5
"""The connect timeout the tests give; every failure must be answered within it plus SLACK_S."""
SLACK_S = 1.5
SECRET = "s3cret-pw-42"


def free_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def auth_server() -> Iterator[NatsServer]:
    """A nats-server that wants user alice with password SECRET."""
    with NatsServer(args=["--user", "alice", "--pass", SECRET]) as server:
        yield server


async def expect_failure(url: str, kind: type[ConnectError], capsys: pytest.CaptureFixture[str]) -> str:
    """Router.connect(url) raises exactly ``kind`` within the bound and prints nothing; return the message."""
    t0 = time.monotonic()
    with pytest.raises(ConnectError) as info:
        await Router.connect(url, connect_timeout_s=BOUND_S)
    elapsed = time.monotonic() - t0
    assert type(info.value) is kind, repr(info.value)
    assert elapsed < BOUND_S + SLACK_S, elapsed
    out = capsys.readouterr()
    assert out.out == ""
    return str(info.value)


async def test_refused_port_raises_connect_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """A port nothing listens on gives ConnectRefusedError naming host and port, within the bound."""
    port = free_port()
    message = await expect_failure(f"nats://127.0.0.1:{port}", ConnectRefusedError, capsys)
    assert message.startswith(f"cannot connect to NATS at nats://127.0.0.1:{port}: connection refused")
    assert f"127.0.0.1:{port}" in message


async def test_unknown_host_raises_unknown_host(capsys: pytest.CaptureFixture[str]) -> None:
    """A host name that does not resolve gives UnknownHostError naming the host."""
    message = await expect_failure("nats://no-such-host.invalid:4222", UnknownHostError, capsys)
    assert "'no-such-host.invalid' does not resolve" in message


async def test_wrong_scheme_raises_bad_url_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    """An http:// URL is rejected at once with BadURLError naming the scheme, the password redacted."""
    t0 = time.monotonic()
    message = await expect_failure(f"http://bob:{SECRET}@127.0.0.1:4222", BadURLError, capsys)
    assert time.monotonic() - t0 < 0.5
    assert "scheme http://" in message
    assert "http://***@127.0.0.1:4222" in message
    assert SECRET not in message


@pytest.mark.nats
async def test_monitoring_port_raises_not_nats(capsys: pytest.CaptureFixture[str]) -> None:
    """The server's HTTP monitoring port gives NotNatsServerError, not a timeout."""
    mport = free_port()
    with NatsServer(args=["-m", str(mport)]):
        message = await expect_failure(f"nats://127.0.0.1:{mport}", NotNatsServerError, capsys)
    assert "not a NATS client port" in message


@pytest.mark.nats
async def test_wrong_password_raises_authorization_without_the_password(
    auth_server: NatsServer, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """A wrong password gives AuthorizationError at once; neither the message nor any log holds a secret."""
    caplog.set_level(logging.DEBUG)
    wrong = "wr0ng-" + SECRET
    url = f"nats://alice:{wrong}@127.0.0.1:{auth_server.port}"
    message = await expect_failure(url, AuthorizationError, capsys)
    assert message == (
        f"cannot connect to NATS at nats://***@127.0.0.1:{auth_server.port}: the server refused the "
        "credentials (authorization violation)"
    )
    assert wrong not in caplog.text
    # The right password connects.
    router = await Router.connect(f"nats://alice:{SECRET}@127.0.0.1:{auth_server.port}", connect_timeout_s=5)
    await router.aclose()


async def test_service_retry_warnings_redact_the_password(caplog: pytest.LogCaptureFixture) -> None:
    """A service's endless connect loop logs the reason and the URL, never the password."""
    caplog.set_level(logging.DEBUG, logger="kvmesh.runtime.nats")
    port = free_port()
    task = asyncio.ensure_future(connect(f"nats://alice:{SECRET}@127.0.0.1:{port}", name="svc"))
    deadline = time.monotonic() + 15
    while "still trying" not in caplog.text and time.monotonic() < deadline:  # noqa: ASYNC110 - polls a log
        await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert f"cannot connect to nats://***@127.0.0.1:{port} (svc): cannot connect" not in caplog.text
    assert f"nats://***@127.0.0.1:{port} (svc): connection refused" in caplog.text
    assert SECRET not in caplog.text


def test_redact_url_hides_every_credential() -> None:
    """redact_url replaces user:pass@ and token@ of every server in a list."""
    assert (
        redact_url("nats://alice:pw@a:4222, tls://t0ken@b:4222,c:4222")
        == "nats://***@a:4222,tls://***@b:4222,c:4222"
    )


@pytest.mark.nats
async def test_tls_url_to_a_plaintext_server_fails_clearly(
    nats_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """tls:// to a server without TLS raises TLSError instead of connecting in plaintext."""
    url = nats_url.replace("nats://", "tls://")
    message = await expect_failure(url, TLSError, capsys)
    assert "offers none" in message


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NatsServer, Path]]:
    """A nats-server that requires TLS with a self-signed certificate for 127.0.0.1; yields it and the cert."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a certificate")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"),
            *("-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
    )
    with NatsServer(args=["--tls", "--tlscert", str(cert), "--tlskey", str(key)]) as server:
        yield server, cert


@pytest.mark.nats
async def test_tls_url_uses_tls(tls_server: tuple[NatsServer, Path]) -> None:
    """tls:// to a TLS server connects over TLS (the socket is an SSL one) when the CA is trusted."""
    server, cert = tls_server
    ctx = ssl.create_default_context(cafile=str(cert))
    router = await Router.connect(f"tls://127.0.0.1:{server.port}", connect_timeout_s=5, tls=ctx)
    try:
        nc = router._nc
        await nc.flush()
        assert nc.connected_url is not None and nc.connected_url.scheme == "tls"
        writer = nc._transport._io_writer  # type: ignore[union-attr]
        assert writer.get_extra_info("ssl_object") is not None
    finally:
        await router.aclose()


@pytest.mark.nats
async def test_tls_with_an_untrusted_certificate_raises_tls_error(
    tls_server: tuple[NatsServer, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """A certificate the client does not trust gives TLSError at once, not a timeout."""
    server, _ = tls_server
    message = await expect_failure(f"tls://127.0.0.1:{server.port}", TLSError, capsys)
    assert "TLS handshake failed" in message


@pytest.mark.nats
async def test_a_comma_separated_server_list_connects(nats_url: str) -> None:
    """A list with a dead server first still connects through the live one."""
    url = f"nats://127.0.0.1:{free_port()},{nats_url}"
    router = await Router.connect(url, connect_timeout_s=10)
    try:
        await router._nc.flush()
        assert router._nc.is_connected
    finally:
        await router.aclose()


async def test_a_list_of_dead_servers_names_each(capsys: pytest.CaptureFixture[str]) -> None:
    """A list of two refused servers gives ConnectRefusedError naming both ports."""
    a, b = free_port(), free_port()
    message = await expect_failure(f"nats://127.0.0.1:{a},nats://127.0.0.1:{b}", ConnectRefusedError, capsys)
    assert f"127.0.0.1:{a}" in message and f"127.0.0.1:{b}" in message


@pytest.mark.nats
async def test_a_clean_close_is_not_logged_as_reconnecting(
    nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Closing a connection logs that it closed, not that it is reconnecting."""
    caplog.set_level(logging.INFO, logger="kvmesh.runtime.nats")
    nc = await connect(nats_url, name="closer", wait_s=5)
    await close_quietly(nc)
    assert "reconnecting" not in caplog.text
    assert f"nats: connection to {nats_url} closed (closer)" in caplog.text
