"""TLS and mutual TLS on the TCP port, with certificates made by openssl for the test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from chunkstore.client import ChunkStoreClient
from chunkstore.errors import Unavailable
from chunkstore.testing.pki import make_pki


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
