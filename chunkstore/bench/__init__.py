"""``chunkstore bench NAME``: each module measures one thing against its baseline, side by
side in one run, and yields one JSON-able dict per figure. A face: it may import any part of
chunkstore, and the test helpers (``chunkstore.testing``) that start real processes."""
