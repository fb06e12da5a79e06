"""``chunkstore doctor``: the connector judged on a model before chunk reuse is turned on.
``command`` is the command line (found by ``chunkstore`` through its ``chunkstore.commands``
entry point), ``stages`` the four stages it runs, ``inputs`` what it reads checked first."""
