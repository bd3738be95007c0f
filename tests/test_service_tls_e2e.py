"""`mesh serve --tls-cert --tls-key`: the service speaks HTTPS (a self-signed certificate made
with the openssl command), clients that trust it are served, and a bad certificate setting
is refused at start with a clear message."""
from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from test_service_e2e import ADMIN, Server

pytestmark = pytest.mark.slow


def self_signed(folder: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed (apt-get install openssl)")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-keyout", str(key),
                    "-out", str(cert), "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


def test_https_with_a_trusted_certificate(tmp_path):
    cert, key = self_signed(tmp_path)
    server = Server(tmp_path / "data", tmp_path, tmp_path / "server.log",
                    extra=("--tls-cert", str(cert), "--tls-key", str(key)))
    server.start()
    try:
        assert server.url.startswith("https://127.0.0.1:")
        trusted = ssl.create_default_context(cafile=str(cert))
        body = json.dumps({"model": "demo/smollm2", "max_tokens": 4,
                           "messages": [{"role": "user", "content": "Hi"}]}).encode()
        request = urllib.request.Request(f"{server.url}/v1/chat/completions", data=body, headers={
            "Authorization": f"Bearer {server.key}", "Content-Type": "application/json"})
        with urllib.request.urlopen(request, context=trusted, timeout=120) as resp:
            assert resp.status == 200 and json.loads(resp.read())["usage"]["completion_tokens"] >= 1
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            urllib.request.urlopen(f"{server.url}/healthz", timeout=30)  # a client that does not trust it
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(server.url.replace("https://", "http://") + "/healthz", timeout=30)
    finally:
        assert server.stop() == 0


def test_a_key_that_does_not_match_is_refused_at_start(tmp_path):
    cert, _ = self_signed(tmp_path)
    (tmp_path / "other").mkdir()
    _, other_key = self_signed(tmp_path / "other")
    env = dict(os.environ, MESH_ADMIN_TOKEN=ADMIN)
    out = subprocess.run([sys.executable, "-m", "mesh.cli", "serve", "--port", "0", "--data-dir",
                          str(tmp_path / "data"), "--tls-cert", str(cert), "--tls-key", str(other_key)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1 and "cannot use the TLS certificate" in out.stderr, out.stderr
    assert "KEY_VALUES_MISMATCH" in out.stderr
    out = subprocess.run([sys.executable, "-m", "mesh.cli", "serve", "--tls-cert", str(cert)],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2 and "HTTPS needs both tls_cert and tls_key" in out.stderr
