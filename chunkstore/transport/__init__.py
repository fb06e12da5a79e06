"""What lies under ``chunkstore.client``: how its calls reach the daemon (``calls``: gRPC, and
the fast path), the session they go under (``session``: opened, kept alive, reopened), and the
transport an entry's bytes move over, chosen when the session opens (``factory``). Each
transport implements one interface (``base.Transport``) in a module of its own:
``shared_memory`` (the daemon's pool mapped here), ``device`` (its device pool opened by IPC),
``stream`` (the gRPC Write and Read streams). The client never asks which one it has."""
