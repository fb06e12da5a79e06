"""The daemon's gRPC interceptors: bearer tokens resolved to a caller (tenants, the admin
token, the peer token), and requests decoded inside the handler (bytes that are not the
method's message answer INVALID_ARGUMENT)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc

from chunkstore.daemon.tenants import (
    ADMIN_CALLER,
    PEER_CALLER,
    SHARED_CALLER,
    Caller,
    Tenants,
)

SERVICE = "chunkstore.v1.ChunkStore"  # the gRPC service, as methods are named on the wire

_KINDS: dict[tuple[bool, bool], tuple[Callable[..., Any], str]] = {
    (False, False): (grpc.unary_unary_rpc_method_handler, "unary_unary"),
    (False, True): (grpc.unary_stream_rpc_method_handler, "unary_stream"),
    (True, False): (grpc.stream_unary_rpc_method_handler, "stream_unary"),
    (True, True): (grpc.stream_stream_rpc_method_handler, "stream_stream"),
}


class DecodeInHandler(grpc.ServerInterceptor):
    """Decode requests inside the handler, so that bytes that are not the method's message
    answer INVALID_ARGUMENT. grpcio's own decoding answers INTERNAL, logs a traceback, and
    keeps ~19 KB of the daemon's memory for good on each such request (grpcio 1.85; health
    checks included, which need no token)."""

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method, decode = details.method, handler.request_deserializer

        def decoded(raw: bytes, context: grpc.ServicerContext) -> Any:
            try:
                return decode(raw)
            except Exception:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a {method} message"
                )

        def each(raw: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[Any]:
            return (decoded(r, context) for r in raw)

        make, name = _KINDS[handler.request_streaming, handler.response_streaming]
        serve, convert = getattr(handler, name), each if handler.request_streaming else decoded
        return make(
            lambda r, c: serve(convert(r, c), c), response_serializer=handler.response_serializer
        )


PEER = frozenset(
    f"/{SERVICE}/{m}"
    for m in ("Hello", "Heartbeat", "Lookup", "Acquire", "Read", "Release", "Stats")
)
ADMIN = frozenset(f"/{SERVICE}/{m}" for m in ("Evict", "Clear", "Pin", "Unpin", "Drain", "Undrain"))


class TokenCheck(grpc.ServerInterceptor):
    """Every call but health checks must carry ``authorization: Bearer <token>`` (or the
    admin token); admin calls need the admin token, and are refused when there is none; the
    peer token admits the read calls a pulling peer makes (``PEER``), nothing else."""

    def __init__(
        self, token: str, admin_token: str, peer_token: str = "", tenants: Tenants | None = None
    ) -> None:
        self.client = {f"Bearer {t}" for t in (token, admin_token) if t}
        self.admin = f"Bearer {admin_token}" if admin_token else None
        self.peer = f"Bearer {peer_token}" if peer_token else None
        self.tenants = tenants  # a tenant's token is a client's (in its own namespace)

    def caller(self, bearer: str | None) -> Caller | None:
        """Whose ``bearer`` is (tenants.Caller), or None for no token of this daemon's."""
        if self.admin and bearer == self.admin:
            return ADMIN_CALLER
        if bearer in self.client:
            return SHARED_CALLER
        if self.tenants is None:
            return PEER_CALLER if self.peer and bearer == self.peer else None
        if self.peer and bearer == self.peer:
            return PEER_CALLER
        tenant = self.tenants.of(bearer)  # one lookup in the tenants in force: one answer
        return Caller(tenant.name, tenant, self.tenants.secret) if tenant is not None else None

    def check(self, bearer: str | None, method: str) -> Caller | tuple[grpc.StatusCode, str]:
        """The caller of a call of ``method`` with ``bearer``, or the status and reason it is
        refused with."""
        if method in ADMIN and (not self.admin or bearer != self.admin):
            why = (
                f"{method} is an admin call: it needs the admin token"
                if self.admin
                else f"{method} is an admin call, refused: the daemon has no --admin-token"
            )
            return grpc.StatusCode.PERMISSION_DENIED, why
        caller = self.caller(bearer)
        if caller is None or (caller == PEER_CALLER and method not in PEER):
            return grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token"
        if self.tenants is None and caller != ADMIN_CALLER:
            return SHARED_CALLER  # one namespace: a peer's reads are a client's
        return caller

    def refusal(self, bearer: str | None, method: str) -> tuple[grpc.StatusCode, str] | None:
        """The status and reason a call is refused with, or None (the fast path asks)."""
        checked = self.check(bearer, method)
        return None if isinstance(checked, Caller) else checked

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        method = details.method
        if method.startswith("/grpc.health.v1.Health/"):
            return continuation(details)
        bearer = dict(details.invocation_metadata or ()).get("authorization")
        checked = self.check(bearer, method)
        if isinstance(checked, Caller):
            return _with_caller(continuation(details), checked)
        return _refusal(continuation(details), *checked)


class _Resolved:
    """A call's context with its caller, as the token check resolved it (once: a reload
    between the check and the call cannot make it someone else)."""

    def __init__(self, context: grpc.ServicerContext, caller: Caller) -> None:
        self._context = context
        self.caller = caller

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


def _with_caller(handler: Any, caller: Caller) -> Any:
    """``handler`` served with its context carrying ``caller``."""
    if handler is None:
        return None
    make, name = _KINDS[handler.request_streaming, handler.response_streaming]
    serve = getattr(handler, name)
    return make(
        lambda r, c: serve(r, _Resolved(c, caller)),
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _refusal(handler: Any, code: grpc.StatusCode, message: str) -> Any:
    """A handler of ``handler``'s kind that answers ``code`` without reading the request."""
    if handler is None:
        return None

    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, message)

    make, _ = _KINDS[handler.request_streaming, handler.response_streaming]
    return make(refuse)
