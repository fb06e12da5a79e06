"""TLS and mutual TLS on the TCP port, with certificates made by openssl for the test."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from chunkstore.client import ChunkStoreClient
from chunkstore.errors import Unavailable


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(d: Path) -> None:
    d.mkdir()
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=chunkstore test CA",
        cwd=d,
    )
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={name}",
            cwd=d,
        )
        openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "2",
            "-extfile",
            "san.cnf",
            cwd=d,
        )


def test_mutual_tls_admits_only_clients_with_a_certificate(serve, tmp_path: Path) -> None:
    pki = tmp_path / "pki"
    make_pki(pki)
    daemon = serve(
        "--tls-cert",
        str(pki / "server.pem"),
        "--tls-key",
        str(pki / "server.key"),
        "--tls-client-ca",
        str(pki / "ca.pem"),
    )
    ca = (pki / "ca.pem").read_bytes()
    with ChunkStoreClient(
        daemon.tcp,
        transport="stream",
        root_certificates=ca,
        client_cert_chain=(pki / "client.pem").read_bytes(),
        client_key=(pki / "client.key").read_bytes(),
    ) as client:
        k = torch.randn(1, 4, 1, 8)
        assert client.put(b"k" * 16, k, k, 0)
        got = client.get(b"k" * 16)
        assert got is not None and torch.equal(got.keys, k)
    with pytest.raises(Unavailable):  # no client certificate
        ChunkStoreClient(daemon.tcp, transport="stream", root_certificates=ca, timeout=3)
    with pytest.raises(Unavailable):  # plaintext to a TLS port
        ChunkStoreClient(daemon.tcp, transport="stream", timeout=3)
