"""``chunkstore bench NAME``: each module measures one thing against its baseline, side by
side in one run, and yields one JSON-able dict per figure. A face: it may import any part of
chunkstore but the test helpers (``chunkstore.testing``); the real processes it runs start
through ``chunkstore.processes``, its models come from ``chunkstore.models``."""
