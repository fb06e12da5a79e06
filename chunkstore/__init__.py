"""chunkstore: a position-independent KV-cache service for RAG serving.

Where things live (imports run down this list, never up):
- ``chunkstore.errors``: the typed errors every part raises.
- ``chunkstore.kv``: the chunk math (segments, keys, fingerprints, RoPE remap, isolation
  masks and attention, paging, cache writers, an entry's byte layout).
- ``chunkstore.protocol``: what the daemon and its clients share (the gRPC stubs and their
  conversions, the shared-memory block layout, the default address).
- ``chunkstore.daemon``: what ``chunkstore serve`` runs.
- ``chunkstore.client``: the daemon's Python client.
- ``chunkstore.models`` (the models ``chunkstore models`` builds) and
  ``chunkstore.processes`` (real local processes: a daemon, redis-server, a vLLM probe): what
  the commands run beside the daemon; they import only the layers above this line.
- the faces: ``cli`` (the ``chunkstore`` command), ``ingest``, ``bench``, and ``testing``
  (helpers only the tests import).
- ``chunkstore.connector_config``: the connector's settings (``kv_connector_extra_config``),
  which the router and the benches read too.
The vLLM connector is the sibling package ``chunkstore_vllm`` (folder ``connector/``): it
imports chunkstore, never the reverse (``tests/test_layout.py``); its commands (``chunkstore
doctor``, ``bench hook``) reach the ``chunkstore`` command through entry points
(pyproject.toml).
"""

__version__ = "0.1.0"
