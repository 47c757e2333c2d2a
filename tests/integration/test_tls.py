"""TLS where configured (docs/security.md): a nats-server with a certificate from a CA the
test makes, reached by the agent's connection and the controller's connect options; the
HTTP API over HTTPS, refusing (and logging) writes without the admin token, and saying
who leads."""

from __future__ import annotations

import datetime
import ipaddress
import logging
import ssl
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import nats
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from nats.aio.client import Client

from metalguard.agent.connection import Connection, NatsSettings
from metalguard.controller.api.server import start_api
from metalguard.controller.broker.server import NatsServer
from metalguard.controller.config import HttpSection, NatsSection
from metalguard.controller.leader import Leadership
from metalguard.controller.service import connect_options
from metalguard.proto.subjects import Subjects
from tests.support.harness.api_env import ADMIN_TOKEN, FLEET, READ_TOKEN, api_env

DEADLINE_S = 10.0


@dataclass(frozen=True)
class Pki:
    ca: Path
    cert: Path
    key: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_pki(directory: Path) -> Pki:
    """A CA and a server certificate for 127.0.0.1 / localhost, signed by it (PEM files)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("metalguard test CA"))
        .issuer_name(_name("metalguard test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("localhost"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pki = Pki(directory / "ca.pem", directory / "server.pem", directory / "server.key")
    pki.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    pki.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pki.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_server(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    root = tmp_path_factory.mktemp("tls-nats")
    conf = root / "server.conf"
    conf.write_text(
        "listen: 127.0.0.1:-1\n"
        f'tls {{ cert_file: "{pki.cert}", key_file: "{pki.key}", ca_file: "{pki.ca}" }}\n'
    )
    server = NatsServer(config_file=conf)
    server.start()
    try:
        yield server
    finally:
        server.close()


async def test_agent_and_controller_reach_nats_over_tls_with_the_ca(
    pki: Pki, tls_server: NatsServer
) -> None:
    url = tls_server.url.replace("nats://", "tls://")
    connection = Connection(NatsSettings(servers=[url], tls_ca=str(pki.ca)))
    try:
        assert await connection.start()
        assert connection.is_connected
    finally:
        await connection.close()

    options = connect_options(NatsSection(servers=(url,), tls_ca=str(pki.ca)))
    options["max_reconnect_attempts"] = 1
    nc = await nats.connect(**options)
    try:
        assert nc.connected_url is not None
        await nc.flush()
    finally:
        await nc.close()

    # without the CA the server's certificate is not trusted
    untrusting = Connection(
        NatsSettings(servers=[url], tls=ssl.create_default_context(), first_connect_timeout_s=1.0)
    )
    try:
        assert not await untrusting.start()
    finally:
        await untrusting.close()


@pytest.fixture
async def https_api(nc: Client, subjects: Subjects, pki: Pki, tmp_path: Path) -> AsyncIterator[str]:
    """The API served by ``start_api`` over HTTPS with read and admin tokens."""
    (tmp_path / "read").write_text(f"{READ_TOKEN}\n")
    (tmp_path / "admin").write_text(f"# admins\n{ADMIN_TOKEN}\n")
    cfg = HttpSection(
        listen="127.0.0.1:0",
        read_tokens_file=str(tmp_path / "read"),
        admin_tokens_file=str(tmp_path / "admin"),
        tls_cert=str(pki.cert),
        tls_key=str(pki.key),
    )
    async with api_env(nc, subjects) as env:
        await env.feed(*FLEET)
        runner = await start_api(cfg, env.controller, env.source, leader=Leadership.always())
        try:
            port = runner.addresses[0][1]
            yield f"https://127.0.0.1:{port}"
        finally:
            await runner.cleanup()


async def test_https_api_refuses_and_logs_writes_without_the_admin_token(
    https_api: str, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    trust = ssl.create_default_context(cafile=str(pki.ca))
    cordon = f"{https_api}/v1/nodes/r1.c1.n1/cordon"
    body = {"reason": "test"}
    caplog.set_level(logging.WARNING, logger="metalguard.controller.api.auth")
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{https_api}/healthz", ssl=trust) as r:
            assert r.status == 200
            health = await r.json()
            assert health["status"] == "ok"
            assert health["leading"] is True
        async with http.get(
            f"{https_api}/v1/leader", ssl=trust, headers={"Authorization": f"Bearer {READ_TOKEN}"}
        ) as r:
            assert r.status == 200
            assert (await r.json())["leading"] is True
        async with http.post(cordon, json=body, ssl=trust) as r:
            assert r.status == 401
        read = {"Authorization": f"Bearer {READ_TOKEN}"}
        async with http.post(cordon, json=body, ssl=trust, headers=read) as r:
            assert r.status == 403
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        async with http.post(cordon, json=body, ssl=trust, headers=admin) as r:
            assert r.status == 200, await r.text()
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await http.get(f"{https_api}/healthz", ssl=ssl.create_default_context())
    refused = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused")]
    assert len(refused) == 2, refused
    assert all("POST /v1/nodes/r1.c1.n1/cordon" in m for m in refused)
    assert "401" in refused[0]
    assert "403" in refused[1]
