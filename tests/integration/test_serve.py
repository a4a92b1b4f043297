"""``kvgw serve`` as a newcomer meets it: the banner's lines work as printed, a taken port is one line,
and https (``--tls-cert``/``--tls-key``) with boto3, the aws CLI and kvgw's own client."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import boto3
import httpx
import pytest
from botocore.config import Config
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from gateway.bench.launcher import KvgwProcess
from gateway.dataplane.intake import INTAKE_MIN_BYTES, INTAKE_PIECE_BYTES
from kvgw_client.config import ClientSettings
from kvgw_client.http import KvgwClient, PutOutcome
from tests.conftest import REPO, ROOT_AK, ROOT_SK, ServerProcess
from tests.integration.s3api.conftest import find_aws_cli
from tests.integration.test_body_intake import Responses, get_head, put_head
from tests.requirements import require_or_skip


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def make_tls(directory: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1 / localhost signed by it: (ca, cert, key)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name("kvgw test CA")).issuer_name(_name("kvgw test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName("localhost"), x509.DNSName("kvcache.localhost"),
             x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (x509.CertificateBuilder().subject_name(_name("localhost")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = directory / "ca.pem", directory / "server.pem", directory / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


# -- the banner ----------------------------------------------------------------------------------


def banner_line(log: str, marker: str) -> str:
    return next(line.strip() for line in log.splitlines() if marker in line)


def run_shell(line: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", line], capture_output=True, text=True, env=env, timeout=60)


def test_banner_curl_and_aws_lines_work_as_printed(server_factory: type[ServerProcess], tmp_path: Path) -> None:
    server = server_factory(data_dir=tmp_path / "d").start()
    log = server.log()
    assert re.search(r"^kvgw \S+: serving on ", log, re.M)
    env = dict(os.environ, KVGW_ROOT_ACCESS_KEY=ROOT_AK, KVGW_ROOT_SECRET_KEY=ROOT_SK)
    curl = run_shell(banner_line(log, "curl -fsS"), env)
    assert curl.returncode == 0, curl.stderr
    assert httpx.get(server.chunk_url("hello"), headers=server.auth).content == b"hello"
    aws = find_aws_cli()
    if aws is None:
        require_or_skip("the aws CLI is not installed (.ci/run puts it in .ci/.venv-awscli)")
    assert aws is not None
    line = banner_line(log, "aws --endpoint-url").replace(" aws ", f" {aws} ", 1)
    listed = run_shell(line, {**env, "AWS_CONFIG_FILE": str(tmp_path / "none"),
                              "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")})
    assert listed.returncode == 0, listed.stderr
    assert "hello" in listed.stdout


def test_generated_credentials_work_in_the_banner_lines(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGW_ROOT_")}
    server = KvgwProcess(data_dir=tmp_path / "d", inherit_kvgw_env=False)  # no root credentials given
    server.start()
    try:
        curl = banner_line(server.log(), "curl -fsS")
        assert "Bearer KV" in curl  # the generated values, on the start that generated them
        assert run_shell(curl, env).returncode == 0
        server.stop()
        server.start()  # a later start names the credentials file instead of printing the secret again
        curl = banner_line(server.log().split(": serving on")[-1], "curl -fsS")
        assert "root-credentials" in curl
        assert run_shell(curl.replace("/hello", "/hello2"), env).returncode == 0
    finally:
        server.stop()


def test_a_taken_port_is_one_line(server: ServerProcess, tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--port", str(server.port),
                             "--data-dir", str(tmp_path / "second")], capture_output=True, text=True, cwd=REPO,
                            env={**os.environ, "KVGW_LOG_LEVEL": "warning"}, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == f"kvgw: cannot listen on 127.0.0.1:{server.port}: Address already in use"
    assert "serving on" not in result.stdout + result.stderr


# -- TLS -----------------------------------------------------------------------------------------


@pytest.fixture
def tls_server(server_factory: type[ServerProcess], tmp_path: Path) -> ServerProcess:
    ca, cert, key = make_tls(tmp_path)
    return server_factory(data_dir=tmp_path / "d", extra_args=["--tls-cert", str(cert), "--tls-key", str(key)],
                          ca_file=ca).start()


def test_https_with_boto3(tls_server: ServerProcess) -> None:
    assert tls_server.url.startswith("https://")
    s3 = boto3.client("s3", endpoint_url=tls_server.url, aws_access_key_id=ROOT_AK, aws_secret_access_key=ROOT_SK,
                      region_name="us-east-1", verify=str(tls_server.ca_file),
                      config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}))
    body = os.urandom(3 << 20)
    s3.put_object(Bucket="kvcache", Key="over-tls", Body=body)  # https: aws-chunked with a trailing checksum
    assert s3.get_object(Bucket="kvcache", Key="over-tls")["Body"].read() == body
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{tls_server.url}/healthz")  # untrusted without the CA
    trusted = ssl.create_default_context(cafile=str(tls_server.ca_file))
    assert httpx.get(f"{tls_server.url}/healthz", verify=trusted).status_code == 200


def test_https_with_the_aws_cli(tls_server: ServerProcess, tmp_path: Path) -> None:
    aws = find_aws_cli()
    if aws is None:
        require_or_skip("the aws CLI is not installed (.ci/run puts it in .ci/.venv-awscli)")
    assert aws is not None
    source = tmp_path / "blob"
    source.write_bytes(os.urandom(9 << 20))  # multipart through the CLI
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID=ROOT_AK, AWS_SECRET_ACCESS_KEY=ROOT_SK, AWS_DEFAULT_REGION="us-east-1",
               AWS_CONFIG_FILE=str(tmp_path / "none"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"))
    base = [aws, "--endpoint-url", tls_server.url, "--ca-bundle", str(tls_server.ca_file)]
    subprocess.run([*base, "s3", "cp", str(source), "s3://kvcache/cli-tls"], check=True, env=env,
                   capture_output=True, timeout=120)
    subprocess.run([*base, "s3", "cp", "s3://kvcache/cli-tls", str(tmp_path / "back")], check=True, env=env,
                   capture_output=True, timeout=120)
    assert (tmp_path / "back").read_bytes() == source.read_bytes()


def test_large_puts_over_https_go_through_the_body_intake(tls_server: ServerProcess) -> None:
    """The intake takes a TLS connection's transport as it takes a plain one's (uvloop's SSL transport
    then feeds it decrypted bytes): two large PUTs and a GET pipelined on one https connection."""
    first, second = os.urandom(2 * INTAKE_PIECE_BYTES + 777), os.urandom(INTAKE_MIN_BYTES)
    context = ssl.create_default_context(cafile=str(tls_server.ca_file))
    with socket.create_connection(tls_server.address, timeout=30) as raw, \
            context.wrap_socket(raw, server_hostname="localhost") as sock:
        sock.sendall(put_head(tls_server, "tls-1", len(first)) + first + put_head(tls_server, "tls-2", len(second))
                     + second + get_head(tls_server, "tls-1"))
        responses = Responses(sock)
        assert [responses.next()[0] for _ in range(2)] == [201, 201]
        status, _, body = responses.next()
        assert status == 200 and body == first
    trusted = ssl.create_default_context(cafile=str(tls_server.ca_file))
    assert httpx.get(tls_server.chunk_url("tls-2"), headers=tls_server.auth, verify=trusted).content == second
    # the first PUT's body came decrypted through the intake, not from the socket by a threaded receive
    metrics = httpx.get(f"{tls_server.url}/metrics", headers=tls_server.auth, verify=trusted).text
    assert 'kvgw_threaded_receives_total{result="skipped"} 1.0' in metrics


async def test_https_with_kvgw_client(tls_server: ServerProcess) -> None:
    settings = ClientSettings(url=tls_server.url, bucket="kvcache", access_key=ROOT_AK, secret_key=ROOT_SK,
                              ca_bundle=str(tls_server.ca_file))
    client = KvgwClient(settings)
    try:
        assert await client.put("tls-key", b"tls bytes") is PutOutcome.STORED
        assert await client.get("tls-key") == b"tls bytes"
        assert await client.prefix(["tls-key", "absent"]) == 1
        # a plain thread's lookup on its own blocking TLS connection (kvgw_client.calls): no retry means
        # its first attempt, made on that thread, got through
        assert await asyncio.to_thread(client.blocking.exists, ["tls-key", "absent"]) == [True, False]
        assert client.counters.get("exists.retries") == 0 and client.stats()["failures"] == {}
        # batch-get's stream (kvgw_client.stream) over TLS: payloads decrypted straight into the buffers
        large = os.urandom(3 << 20)
        assert await client.put("tls-large", large) is PutOutcome.STORED
        buffers = [bytearray(9), bytearray(len(large))]
        statuses = await client.batch_get_into(["tls-key", "tls-large", "absent"],
                                               lambda i, n: memoryview(buffers[i])[:n] if i < 2 else None)
        assert [str(s) for s in statuses] == ["ok", "ok", "missing"]
        assert (bytes(buffers[0]), bytes(buffers[1])) == (b"tls bytes", large)
    finally:
        await client.aclose()


def test_tls_needs_both_files(tmp_path: Path) -> None:
    _, cert, _ = make_tls(tmp_path)
    result = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--port", "65535", "--data-dir",
                             str(tmp_path / "d"), "--tls-cert", str(cert)], capture_output=True, text=True,
                            cwd=REPO, env={**os.environ, "KVGW_LOG_LEVEL": "warning"}, timeout=60)
    assert result.returncode == 2 and re.search(r"TLS needs both --tls-cert and --tls-key", result.stderr)


def test_no_shell_tools_missing() -> None:
    """The banner's example lines use curl and bash; the suite's machines must have both."""
    assert shutil.which("curl") and shutil.which("bash")
