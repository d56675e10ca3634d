"""The autoscaler's Prometheus client against a secured Prometheus (Debian's binary) on
loopback: its web config serves https with a certificate from a CA made here and
requires basic auth. Without credentials or without the CA a query fails and says why;
with them (the operator's flags: files) it is answered. Bearer tokens and tenant headers,
which Prometheus' own web config does not check, are checked on the wire by a small
HTTP server standing in for a gateway in front of Prometheus (as Mimir's or a managed
service's would)."""

from __future__ import annotations

import base64
import datetime
import ipaddress
import ssl
import subprocess
import urllib.request
import warnings
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from loopback import PROMETHEUS, free_port, wait_until

from pdcluster.io.prometheus import Prometheus, PrometheusUnavailable
from pdcluster.io.prometheus_auth import CredentialsUnavailable, OperatorCredentials

with warnings.catch_warnings():  # deprecated since 3.11; bcrypt is what Prometheus checks
    warnings.simplefilter("ignore", DeprecationWarning)
    crypt = pytest.importorskip("crypt")

pytestmark = pytest.mark.skipif(not Path(PROMETHEUS).exists(), reason="Debian's prometheus is not installed")

USER, PASSWORD = "autoscaler", "s3cret-pässword"
PROMQL = "vector(42)"


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _write_tls(root: Path) -> None:
    """A CA (ca.crt) and a serving certificate for 127.0.0.1 signed by it (server.crt/.key)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("pdcluster test CA"))
        .issuer_name(_name("pdcluster test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(ca_key, hashes.SHA256())
    )
    server = (
        x509.CertificateBuilder()
        .subject_name(_name("127.0.0.1"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    (root / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (root / "server.crt").write_bytes(server.public_bytes(serialization.Encoding.PEM))
    (root / "server.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )


@pytest.fixture(scope="module")
async def secured(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[str, Path]]:
    """Prometheus over https with basic auth; its URL and the directory with ca.crt."""
    root = tmp_path_factory.mktemp("prometheus-auth")
    _write_tls(root)
    hashed = crypt.crypt(PASSWORD, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16))
    (root / "web.yml").write_text(
        f"tls_server_config:\n  cert_file: {root / 'server.crt'}\n  key_file: {root / 'server.key'}\n"
        f"basic_auth_users:\n  {USER}: '{hashed}'\n"
    )
    (root / "prometheus.yml").write_text("global:\n  scrape_interval: 1m\n")
    address = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={root / 'prometheus.yml'}",
            f"--storage.tsdb.path={root / 'data'}",
            f"--web.listen-address={address}",
            f"--web.config.file={root / 'web.yml'}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"https://{address}"
    try:
        await wait_until(
            lambda: _ready(url, root / "ca.crt"), timeout=60, interval=0.1, message="Prometheus ready"
        )
        yield url, root
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def _ready(url: str, ca: Path) -> bool:
    context = ssl.create_default_context(cafile=str(ca))
    opener = urllib.request.build_opener(urllib.request.HTTPSHandler(context=context))
    basic = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    request = urllib.request.Request(url + "/-/ready", headers={"Authorization": basic})
    try:
        with opener.open(request, timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


async def _ask(url: str, creds: OperatorCredentials) -> float | None:
    async with aiohttp.ClientSession() as session:
        return await Prometheus(url, session, creds=creds.load()).query(PROMQL)


def _files(root: Path, **texts: str) -> dict[str, Path]:
    out = {}
    for name, text in texts.items():
        (root / name).write_text(text)
        out[name] = root / name
    return out


async def test_without_credentials_the_query_fails_and_says_so(secured: tuple[str, Path]) -> None:
    url, root = secured
    with pytest.raises(PrometheusUnavailable, match="401 Unauthorized"):
        await _ask(url, OperatorCredentials(ca_file=root / "ca.crt"))


async def test_without_the_ca_the_certificate_is_not_trusted(secured: tuple[str, Path]) -> None:
    url, root = secured
    f = _files(root, user="autoscaler\n", password=PASSWORD + "\n")
    with pytest.raises(PrometheusUnavailable, match=r"certificate is not trusted.*set a CA bundle"):
        await _ask(url, OperatorCredentials(username_file=f["user"], password_file=f["password"]))


async def test_a_wrong_password_is_refused(secured: tuple[str, Path]) -> None:
    url, root = secured
    f = _files(root, user2=USER, password2="not-it")
    creds = OperatorCredentials(
        username_file=f["user2"], password_file=f["password2"], ca_file=root / "ca.crt"
    )
    with pytest.raises(PrometheusUnavailable, match="401"):
        await _ask(url, creds)


async def test_basic_auth_over_tls_is_answered(secured: tuple[str, Path]) -> None:
    url, root = secured
    f = _files(root, user3=USER + "\n", password3=PASSWORD + "\n")
    creds = OperatorCredentials(
        username_file=f["user3"],
        password_file=f["password3"],
        ca_file=root / "ca.crt",
        headers={"X-Scope-OrgID": "tenant-1"},
    )
    assert await _ask(url, creds) == 42.0


async def test_a_missing_credentials_file_is_named(tmp_path: Path) -> None:
    creds = OperatorCredentials(bearer_token_file=tmp_path / "token")
    with pytest.raises(CredentialsUnavailable, match=r"token: No such file"):
        creds.load()


async def test_bearer_token_and_tenant_header_reach_the_server(tmp_path: Path) -> None:
    """Re-read per load: a rotated token is the one sent next."""
    seen: list[tuple[str | None, str | None]] = []

    async def query(request: web.Request) -> web.Response:
        seen.append((request.headers.get("Authorization"), request.headers.get("X-Scope-OrgID")))
        return web.json_response({"status": "success", "data": {"resultType": "scalar", "result": [0, "7"]}})

    app = web.Application()
    app.router.add_get("/api/v1/query", query)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        token = tmp_path / "token"
        creds = OperatorCredentials(bearer_token_file=token, headers={"X-Scope-OrgID": "team-a"})
        for value in ("first\n", "rotated\n"):
            token.write_text(value)
            assert await _ask(f"http://127.0.0.1:{port}", creds) == 7.0
    finally:
        await runner.cleanup()
    assert seen == [("Bearer first", "team-a"), ("Bearer rotated", "team-a")]
