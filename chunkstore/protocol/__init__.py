"""What the daemon and its clients share, and nothing else: the gRPC stubs generated from
``proto/chunkstore.proto`` (``make proto``; ``generate.py`` writes them, do not edit them by
hand), the conversions between their messages and chunkstore's types and errors (``wire``),
the shared-memory pool's block layout both sides copy through (``shm``), and the address a
node's daemon listens on by default (``endpoints``). It may import ``chunkstore.kv`` and
``chunkstore.errors``; the daemon and the client both import it, never each other."""
