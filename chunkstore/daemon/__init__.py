"""What ``chunkstore serve`` runs: its configuration (``config``), the block pool that owns
the bytes (``pool``), the index that owns entries, leases, reservations and sessions
(``index``), the gRPC server that translates between the wire and those two (``server``),
Prometheus metrics (``metrics``), and the optional Redis cluster directory (``directory``)
with the transports it pulls peers' entries over (``peers``). It imports ``chunkstore.kv``,
``chunkstore.protocol`` and ``chunkstore.errors``; never the client, the connector, the
benches or the test helpers."""
