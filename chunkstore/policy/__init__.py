"""The policy: what the connector, the router and the reference do with a request's chunks,
decided once from the connector's settings, beside the chunk math it reads (``chunkstore.kv``).

- ``selection``: the request's ``kv_transfer_params`` (``TransferParams``), which chunks are
  relevant and which tokens are recomputed.
- ``treatment``: ``Policy`` (the settings that decide it) and ``treat``, what each chunk gets:
  where it is attended, its temperature and scale, what is recomputed.

Import each name from the module that defines it; this package re-exports nothing.
"""
