"""The wire's limits and its errors: typed errors to gRPC status codes and back, shared by the
server and its clients (the client library, and daemons pulling from their peers). The
messages' conversions to chunkstore's own types are ``convert``'s."""

from __future__ import annotations

import grpc

from chunkstore.errors import (
    AlreadyExists,
    ChecksumMismatch,
    Exhausted,
    Forbidden,
    InvalidRequest,
    LeaseLapsed,
    NotFound,
    PoolFull,
    SessionLost,
    StoreError,
    Unauthenticated,
    Unavailable,
    WrongState,
)

MAX_MESSAGE = 64 << 20  # bytes in one gRPC message, both ways
MAX_BATCH = 4096  # keys in one lookup / acquire / admin call
# Runs in one run read (``ReadRequest.run_starts``): twice a DCP 2 rank's part of a 4,096-token
# entry of 32 layers (keys and values: 2 x 32 x 2,048 rows, one run a row); a client splits
# more over several Reads. Bytes alone bounded them: 16M one-byte runs took the daemon 4.8 s
# and 664 MiB.
MAX_RUNS = 1 << 18


_ERRORS: dict[grpc.StatusCode, type[StoreError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Exhausted,
    grpc.StatusCode.FAILED_PRECONDITION: WrongState,
    grpc.StatusCode.DATA_LOSS: ChecksumMismatch,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: Forbidden,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: Unavailable,
}


# Subclasses their status code alone would not bring back (SessionLost and LeaseLapsed are
# NOT_FOUNDs, as an unknown key is; PoolFull a RESOURCE_EXHAUSTED, as Busy is): their details
# start with their name, "SessionLost: no session ...".
_NAMED: dict[str, type[StoreError]] = {
    kind.__name__: kind for kind in (SessionLost, LeaseLapsed, PoolFull)
}


def status_of(err: StoreError) -> tuple[grpc.StatusCode, str]:
    """The status code and details ``err`` travels as (gRPC, or the fast path)."""
    name = type(err).__name__
    return grpc.StatusCode[err.code], f"{name}: {err}" if name in _NAMED else str(err)


def error_of(code: str, details: str) -> StoreError:
    """The typed error a status code names (``grpc.StatusCode`` member name), or the subclass
    the details name (``status_of``)."""
    name, _, rest = (details or "").partition(": ")
    named = _NAMED.get(name)
    if named is not None and named.code == code:
        return named(f"{code}: {rest}")
    status = grpc.StatusCode[code] if code in grpc.StatusCode.__members__ else None
    kind = _ERRORS.get(status, StoreError) if status is not None else StoreError
    return kind(f"{code}: {details}")


def typed_error(err: grpc.RpcError) -> StoreError:
    return error_of(err.code().name, err.details())
