"""Where `muxd serve` listens, as vLLM's flags say: HTTPS with --ssl-keyfile/--ssl-certfile (a self-signed
certificate made here), a Unix domain socket with --uds; real server processes."""
from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from live_server import free_port  # noqa: E402

SMALL = ["--kv-cache-memory", "16MiB", "--max-model-len", "128"]


def self_signed(where: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    key_file, cert_file = where / "key.pem", where / "cert.pem"
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_file, cert_file


def serve(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "appliance", "serve", *SMALL, *args], stdout=log.open("w"),
                            stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def ready(proc: subprocess.Popen, client: httpx.Client, url: str, log: Path) -> None:
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, log.read_text()[-2000:]
        assert time.monotonic() < deadline, log.read_text()[-2000:]
        try:
            if client.get(url).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)


def test_https_with_a_key_and_certificate(tmp_path):
    """HTTPS, with --ssl-ciphers limiting TLS 1.2 to one cipher family: a TLS 1.2 client offering only another family
    is refused, one offering that family is served."""
    key, cert = self_signed(tmp_path)
    port, log = free_port(), tmp_path / "server.log"
    proc = serve(["--port", str(port), "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
                  "--ssl-ciphers", "ECDHE+AESGCM"], log)
    try:
        with httpx.Client(verify=str(cert), timeout=60) as client:
            ready(proc, client, f"https://127.0.0.1:{port}/ready", log)
            out = client.post(f"https://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 2
        for ciphers, served in (("ECDHE+AESGCM", True), ("ECDHE+CHACHA20", False)):
            tls12 = ssl.create_default_context(cafile=str(cert))
            tls12.maximum_version = ssl.TLSVersion.TLSv1_2
            tls12.set_ciphers(ciphers)
            try:
                with httpx.Client(verify=tls12, timeout=10) as client:
                    ok = client.get(f"https://127.0.0.1:{port}/health").status_code == 200
            except httpx.TransportError:
                ok = False
            assert ok == served, ciphers
        with httpx.Client(timeout=10) as plain:  # plain HTTP on the HTTPS port gets no answer
            try:
                refused = plain.get(f"http://127.0.0.1:{port}/health").status_code != 200
            except httpx.TransportError:
                refused = True
            assert refused
        assert f"on https://127.0.0.1:{port}" in log.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_a_unix_domain_socket(tmp_path):
    sock, log = tmp_path / "muxd.sock", tmp_path / "server.log"
    proc = serve(["--uds", str(sock)], log)
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=60) as client:
            ready(proc, client, "http://muxd/ready", log)
            out = client.post("http://muxd/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 2
        assert f"on unix socket {sock}" in log.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
