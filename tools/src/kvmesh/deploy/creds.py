"""``kvmesh gen-creds``: fresh NKeys, a CA and a server certificate for a secured kvmesh NATS cluster.

Writes into ``--out`` (default ``deploy/nats/secrets``, git-ignored):

* ``ca.pem`` / ``ca-key.pem`` — a new certificate authority (EC P-256, 10 years); the key is 0600;
* ``server.pem`` / ``server-key.pem`` — one certificate for every node (825 days), signed by the CA, usable as
  server and as client (cluster routes present it both ways), subject alternative names: every ``--hosts``
  name, ``localhost`` and ``127.0.0.1``; the key is 0600;
* ``auth.conf`` — the nats-server ``authorization`` block: one NKey user per role with its publish and
  subscribe permissions (`role_permissions`), included by ``deploy/nats/cluster.conf``; each role receives
  its replies below its own inbox prefix (`inbox_prefix`: ``_INBOX_<role>``), which its processes set with
  ``KVMESH_NATS_INBOX_PREFIX``;
* one NKey seed file per role (0600): ``operator.nk``, ``indexer.nk``, ``router.nk``, ``client.nk``,
  ``sim.nk`` and ``ingest-<worker>.nk`` for each worker of ``--workers``.

Existing files are never overwritten without ``--force`` (exit 1 naming them). Rotation is re-running with
``--force`` and restarting the nodes and the services (a reload is not enough): every key, seed and certificate is
new, so the old ones stop working at once. Only public keys and file names are printed, never a seed.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import nkeys
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvmesh.runtime import subjects

DEFAULT_OUT: Final[str] = "deploy/nats/secrets"
DEFAULT_WORKERS: Final[tuple[str, ...]] = ("sim-0", "sim-1")
DEFAULT_HOSTS: Final[tuple[str, ...]] = ("nats-1", "nats-2", "nats-3")
ROLES: Final[tuple[str, ...]] = ("operator", "indexer", "router", "client", "sim")
"""The fixed roles; every worker adds an ``ingest-<worker>`` role."""
CA_DAYS: Final[int] = 3650
SERVER_DAYS: Final[int] = 825
SECRET_MODE: Final[int] = 0o600

_STREAM = re.compile(r"^[A-Za-z0-9_-]{1,100}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


class CredsError(Exception):
    """The arguments or the output directory do not allow writing the credentials (the message says why)."""


@dataclass(frozen=True, slots=True)
class Permissions:
    """One NATS user's permissions: subjects it may publish and subscribe to, and whether it may answer the
    requests it receives (``allow_responses``: publish once to each received message's reply subject)."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False


@dataclass(slots=True)
class Generated:
    """What `generate` wrote: file name → mode, role → NKey public key (``U…``), and the stale seeds removed."""

    files: dict[str, int] = field(default_factory=dict)
    public_keys: dict[str, str] = field(default_factory=dict)
    removed: list[str] = field(default_factory=list)
    """Seed files of workers no longer in ``--workers`` (deleted by a ``--force`` run)."""


def _js(verb: str, target: str) -> str:
    return f"$JS.API.{verb}.{target}" if target else f"$JS.API.{verb}"


def inbox_prefix(role: str) -> str:
    """The reply-inbox prefix of ``role`` (``_INBOX_<role>``, characters other than letters, digits, ``_`` and
    ``-`` as ``_``): its processes connect with ``KVMESH_NATS_INBOX_PREFIX`` set to it, and only they may
    subscribe below it, so no role reads another's replies (JetStream API answers, route answers)."""
    return "_INBOX_" + re.sub(r"[^A-Za-z0-9_-]", "_", role)


def role_permissions(
    role: str, *, stream: str = subjects.STREAM, events_prefix: str = subjects.EVENTS_PREFIX
) -> Permissions:
    """The permissions of ``role`` (one of `ROLES` or ``ingest-<worker>``) for the events stream ``stream``.

    Each grant is one a running fleet uses (a whole fleet run with every other grant removed shows the
    server refusing it); deploy/nats/README.md lists them. Replies to a user's own requests (JetStream API
    answers, ``kvmesh.route`` answers) arrive below its own `inbox_prefix` (``_INBOX_<role>.>``).

    Raises:
        CredsError: an unknown role.
    """
    workers_kv = subjects.registry_bucket(stream)
    lease_kv = subjects.lease_bucket(stream)
    snaps = subjects.snapshot_bucket(stream)
    kv_workers, kv_lease, obj_snaps = f"KV_{workers_kv}", f"KV_{lease_kv}", f"OBJ_{snaps}"
    inbox = f"{inbox_prefix(role)}.>"
    requests, status = subjects.REQUESTS_PREFIX, subjects.STATUS_SUBJECT
    if role == "operator":
        # status, snapshot, replay, reset and provision: the whole kvmesh namespace and JetStream API.
        return Permissions(
            publish=("kvmesh.>", "$JS.API.>", "$KV.>", "$O.>", "$JS.ACK.>", "$JS.FC.>", "$SRV.>"),
            subscribe=(inbox,),
        )
    if role in ("indexer", "router"):
        service = f"kvmesh-{role}"
        micro = (  # the nats.micro service's discovery endpoints, for its own service name only
            "$SRV.PING",
            "$SRV.INFO",
            "$SRV.STATS",
            f"$SRV.*.{service}",  # $SRV.<verb>.kvmesh-<role>
            f"$SRV.*.{service}.*",  # $SRV.<verb>.kvmesh-<role>.<instance id>
        )
        replica = (
            _js("STREAM.INFO", stream),  # wait for the events stream, its subjects and bounds
            _js("CONSUMER.CREATE", stream),  # ordered consumer of the replica (ephemeral, unnamed)
            # The replica's caught-up check (a message past applied_seq?); the indexer's purge also reads
            # each live rank's last message (get_last_msg, subject in the body) so no cursor is purged.
            _js("STREAM.MSG.GET", stream),
            "$JS.FC.>",  # flow-control replies of nats-py's ordered consumers (a large catch-up)
            _js("STREAM.INFO", kv_workers),  # KV watch of the registry: bind the bucket
            _js("CONSUMER.CREATE", kv_workers),  # KV watch of the registry: its ordered consumer
            _js("CONSUMER.INFO", f"{kv_workers}.>"),  # KV watch of the registry: its pending count
            # Object Store get of a snapshot: nats-py finds the chunk stream by subject.
            _js("STREAM.NAMES", ""),
            _js("STREAM.INFO", obj_snaps),  # Object Store bind of the snapshot bucket
            _js("CONSUMER.CREATE", obj_snaps),  # Object Store get: ordered consumer of the chunks
            _js("STREAM.MSG.GET", obj_snaps),  # Object Store get/list: a snapshot's metadata message
        )
    if role == "indexer":
        return Permissions(
            publish=(
                *replica,
                _js("STREAM.PURGE", stream),  # after a snapshot: what no kept snapshot needs
                _js("STREAM.INFO", kv_lease),  # KV bind of the snapshot-writer lease
                _js("STREAM.MSG.GET", kv_lease),  # KV get of the lease (the key is in the body)
                # KV get of a member's own key before its removal (the watch's listing can be early)
                _js("STREAM.MSG.GET", kv_workers),
                f"$KV.{lease_kv}.>",  # KV create/update of the lease
                f"$O.{snaps}.>",  # Object Store put of a snapshot: its chunks and metadata
                _js("STREAM.PURGE", obj_snaps),  # Object Store put/delete drops a replaced or deleted object
                subjects.control_subject(
                    events_prefix
                ),  # WorkerRemoved of a worker whose registry key expired
            ),
            subscribe=(
                inbox,
                subjects.MATCH_SUBJECT,  # match queries of remote-index routers (queue group)
                status,  # kvmesh status
                subjects.SNAPSHOT_SUBJECT,  # kvmesh snapshot
                *micro,
            ),
            allow_responses=True,  # answers to match, status, snapshot and $SRV requests
        )
    if role == "router":
        return Permissions(
            publish=(
                *replica,
                subjects.MATCH_SUBJECT,  # --index remote: match queries to the indexers
                f"{requests}.>",  # routed notes and the ledger sync request of a starting router
            ),
            subscribe=(
                inbox,
                subjects.ROUTE_SUBJECT,  # route requests (queue group)
                f"{requests}.>",  # lifecycle notes (routed, prefill_done, finished) and peers' ledger sync
                f"{subjects.LOAD_PREFIX}.>",  # engine load reports
                f"{status}.router",  # kvmesh status
                *micro,
            ),
            allow_responses=True,  # answers to route, status, ledger sync and $SRV requests
        )
    if role == "client":
        return Permissions(
            publish=(
                subjects.ROUTE_SUBJECT,
                subjects.requests_subject(requests, "prefill_done"),
                subjects.requests_subject(requests, "finished"),
            ),
            subscribe=(inbox,),
        )
    if role == "sim":
        # Development only: the simulated engines, and whatever drives them (a test or a load generator
        # standing in for the engines' HTTP clients), request and answer on the simulator's subjects.
        return Permissions(
            publish=(f"{subjects.SIM_PREFIX}.>",),  # generate and reset requests to a simulated engine
            subscribe=(inbox, f"{subjects.SIM_PREFIX}.>"),  # their answers; the workers' own endpoints
            allow_responses=True,  # answers to generate and reset
        )
    if role.startswith("ingest-") and len(role) > len("ingest-"):
        worker = role[len("ingest-") :]
        own = f"{events_prefix}.*.{subjects.token(worker)}.>"
        key = subjects.kv_key(worker)
        return Permissions(
            publish=(
                own,  # its worker's events (JetStream publish)
                subjects.load_subject(subjects.LOAD_PREFIX, worker),  # --metrics-url: its engine's load
                f"$KV.{workers_kv}.{key}",  # registry heartbeat: KV put of its own key
                f"$KV.{workers_kv}.{key}.*",  # a multi-node worker's node keys (<worker>.dp<start>-<stop>)
                _js("STREAM.INFO", stream),  # wait for the events stream
                _js("STREAM.INFO", kv_workers),  # KV bind of the registry
                # KV get of its registry record (liveness, incarnation): the bucket has no allow_direct, so
                # the key is in the body and the server cannot restrict it to the worker's own key.
                _js("STREAM.MSG.GET", kv_workers),
                # Cursor recovery reads each rank's last message with STREAM.MSG.GET (subject in the body):
                # through the stream leader, for consistency; the server cannot restrict it to its subjects.
                _js("STREAM.MSG.GET", stream),
                # Deletes its own re-ordered messages; the server cannot restrict the sequence to its subjects.
                _js("STREAM.MSG.DELETE", stream),
            ),
            subscribe=(inbox, f"{status}.ingest"),  # kvmesh status
            allow_responses=True,  # answers to kvmesh status
        )
    raise CredsError(f"unknown role {role!r} (one of {', '.join(ROLES)} or ingest-<worker>)")


def _quote(subject: str) -> str:
    return '"' + subject.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _allow(subjects_: Sequence[str]) -> str:
    if not subjects_:
        return '{ deny: [">"] }'
    return "{ allow: [" + ", ".join(_quote(s) for s in subjects_) + "] }"


def auth_conf(users: dict[str, str], *, stream: str = subjects.STREAM) -> str:
    """The nats-server ``authorization`` block for ``users`` (role → NKey public key), as text."""
    lines = [
        "# Made by `kvmesh gen-creds`: one NKey user per role. Do not edit; re-run `kvmesh gen-creds --force`.",
        "authorization {",
        "  users: [",
    ]
    for role, public in users.items():
        p = role_permissions(role, stream=stream)
        lines += [
            f"    # {role}",
            "    {",
            f"      nkey: {_quote(public)}",
            "      permissions: {",
            # nats-server reads an empty allow list as no restriction at all: nothing allowed is deny all.
            "        publish: " + _allow(p.publish),
            "        subscribe: " + _allow(p.subscribe),
        ]
        if p.allow_responses:
            lines.append("        allow_responses: true")
        lines += ["      }", "    }"]
    lines += ["  ]", "}", ""]
    return "\n".join(lines)


def _write(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` (it must not exist; a symbolic link is never followed) with ``mode`` set before any
    byte is written."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        os.fchmod(fd, mode)
        os.write(fd, data)
    finally:
        os.close(fd)


def _new_user() -> tuple[bytes, str]:
    """A fresh NKey user: (seed ``SU…`` as bytes, public key ``U…``)."""
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    kp = nkeys.from_seed(bytearray(seed))
    public = kp.public_key.decode()
    kp.wipe()
    return bytes(seed), public


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def certificates(hosts: Sequence[str], *, now: datetime.datetime | None = None) -> dict[str, bytes]:
    """A new CA and one node certificate for ``hosts`` (+ localhost, 127.0.0.1): file name → PEM bytes."""
    now = now or datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvmesh NATS CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for h in dict.fromkeys([*hosts, "localhost", "127.0.0.1"]):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))  # a client connecting by address checks it
        except ValueError:
            names.append(x509.DNSName(h))
    server = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvmesh NATS server")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=SERVER_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=True,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    return {
        "ca.pem": ca.public_bytes(pem),
        "ca-key.pem": _key_pem(ca_key),
        "server.pem": server.public_bytes(pem),
        "server-key.pem": _key_pem(key),
    }


def _check_name(kind: str, name: str) -> None:
    if not _NAME.match(name):
        raise CredsError(
            f"{kind} {name!r}: use letters, digits, '_', '.' and '-' (up to 100, starting with a letter or digit)"
        )


def generate(
    out: Path,
    *,
    workers: Sequence[str] = DEFAULT_WORKERS,
    hosts: Sequence[str] = DEFAULT_HOSTS,
    stream: str = subjects.STREAM,
    force: bool = False,
) -> Generated:
    """Write every credential file into ``out`` (created 0700 when missing); see the module docstring.

    Raises:
        CredsError: a bad worker or host name, duplicates, or files that exist without ``force``.
    """
    if not workers:
        raise CredsError("--workers: give at least one worker id")
    if not hosts:
        raise CredsError("--hosts: give at least one host name")
    for w in workers:
        _check_name("worker", w)
    for h in hosts:
        _check_name("host", h)
    if len(set(workers)) != len(workers):
        raise CredsError("--workers: a worker id is given twice")
    if not _STREAM.match(stream):
        raise CredsError(f"--stream {stream!r}: a stream name is letters, digits, '_' and '-' (up to 100)")
    roles = [*ROLES, *(f"ingest-{w}" for w in workers)]
    inboxes: dict[str, list[str]] = {}
    for role in roles:
        inboxes.setdefault(inbox_prefix(role), []).append(role)
    shared = [group for group in inboxes.values() if len(group) > 1]
    if shared:
        raise CredsError(
            "--workers: "
            + "; ".join(" and ".join(g) for g in shared)
            + " would share one reply inbox prefix (names differing only in '.' and '_'): rename one"
        )
    names = ["ca.pem", "ca-key.pem", "server.pem", "server-key.pem", "auth.conf", *(f"{r}.nk" for r in roles)]
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise CredsError(f"{out} exists and is not a directory")
    links = [n for n in names if (out / n).is_symlink()]
    if links:
        raise CredsError(
            f"{out}: {', '.join(links)} is a symbolic link: refusing to write a secret through it"
        )
    existing = [n for n in names if os.path.lexists(out / n)]
    if existing and not force:
        raise CredsError(
            f"{out} already holds {', '.join(existing)}: pass --force to replace them (rotation)"
        )
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    done = Generated()
    # Everything is written into a fresh directory beside the files first, and moved into place only when
    # all of it is there: a failed run (a full disk, a name taken by a directory) changes nothing.
    staging = Path(tempfile.mkdtemp(prefix=".gen-creds-", dir=out))
    try:
        for name, data in certificates(hosts).items():
            mode = SECRET_MODE if name.endswith("-key.pem") else 0o644
            _write(staging / name, data, mode)
            done.files[name] = mode
        for role in roles:
            seed, public = _new_user()
            _write(staging / f"{role}.nk", seed + b"\n", SECRET_MODE)
            done.files[f"{role}.nk"] = SECRET_MODE
            done.public_keys[role] = public
        _write(staging / "auth.conf", auth_conf(done.public_keys, stream=stream).encode(), 0o644)
        done.files["auth.conf"] = 0o644
        blocked = [n for n in names if (out / n).is_dir()]
        if blocked:
            raise CredsError(f"{out}: {', '.join(blocked)} is a directory: nothing was changed")
        for name in names:
            os.replace(staging / name, out / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    # A rotation for another worker list revokes the workers left out: their seeds would no longer log in.
    for stale in sorted(out.glob("ingest-*.nk")) if force else []:
        if stale.name not in names:
            stale.unlink()
            done.removed.append(stale.name)
    return done


HELP = """\
Generate fresh credentials for a secured kvmesh NATS cluster (deploy/nats, docker-compose.yml):

  ca.pem, ca-key.pem          a new certificate authority (the key 0600)
  server.pem, server-key.pem  one certificate for every node: the --hosts names, localhost and 127.0.0.1,
                              for client connections and both ends of the cluster routes (the key 0600)
  auth.conf                   the nodes' users: one NKey user per role with its permissions
  <role>.nk                   one NKey seed per role (0600): operator, indexer, router, client, sim, and
                              ingest-<worker> for each worker of --workers

A process of a role connects with KVMESH_NATS_NKEY_SEED_FILE=<out>/<role>.nk,
KVMESH_NATS_TLS_CA_FILE=<out>/ca.pem and KVMESH_NATS_INBOX_PREFIX=_INBOX_<role> (its own reply subjects).
Existing files are kept unless --force. Rotation: run again with --force (same --workers and --hosts), then
restart the nodes and every service: the old seeds and CA stop working; a reload is not enough. With --force,
the seeds of workers no longer listed are removed. Only file names and public keys are printed.
"""


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def command(argv: Sequence[str] | None = None, prog: str = "kvmesh gen-creds") -> int:
    """``kvmesh gen-creds``: 0 written, 1 refused (files exist, bad names), 2 usage."""
    parser = argparse.ArgumentParser(
        prog=prog, description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    parser.add_argument(
        "--workers",
        default=",".join(DEFAULT_WORKERS),
        help="comma-separated worker ids, one ingest user each (default %(default)s)",
    )
    parser.add_argument(
        "--hosts",
        default=",".join(DEFAULT_HOSTS),
        help="comma-separated node host names for the server certificate (default %(default)s)",
    )
    parser.add_argument("--stream", default=subjects.STREAM, help="events stream name (default %(default)s)")
    parser.add_argument("--force", action="store_true", help="replace existing files (rotation)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    try:
        done = generate(
            out, workers=_split(args.workers), hosts=_split(args.hosts), stream=args.stream, force=args.force
        )
    except CredsError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"{prog}: cannot write {exc.filename or out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"wrote {len(done.files)} files to {out.resolve()}:")
    for name, mode in done.files.items():
        print(f"  {name} ({mode:04o})")
    for name in done.removed:
        print(f"  removed {name} (its worker is not in --workers)")
    print("NKey users (public keys):")
    for role, public in done.public_keys.items():
        print(f"  {role}: {public}")
    return 0
