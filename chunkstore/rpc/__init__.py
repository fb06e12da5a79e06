"""Generated gRPC stubs of proto/chunkstore.proto (``make proto``); do not edit by hand."""
