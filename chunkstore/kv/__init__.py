"""The chunk math: segmentation of ``sys SEP chunk ... SEP question`` prompts at a separator,
cache keys and model fingerprints, the key space that assembles them (``keyspace``), the
RoPE remap (CPU, CUDA and NPU kernels), the isolation mask in every form and attention under
it, slot mapping into paged caches, the writers that put a stored chunk into one, and the
byte layout of an entry. Pure functions over token lists and tensors, shared by the daemon,
the client, the connector, tests and benches. It imports nothing of the project but
``chunkstore.errors``, and does no I/O but reading a model folder to fingerprint it and load
its tokenizer (``fingerprint``, ``KeySpace.for_model``)."""
