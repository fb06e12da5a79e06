"""Tenants (``serve --tenants FILE``): who a client's bearer token says it is, and what it may
hold.

Every entry belongs to the namespace of the tenant that stored it. A tenant's keys are
mapped into its own namespace before the index sees them (``tenant_key``, a hash keyed with
the daemon's namespace secret, so nobody outside can compute another tenant's keys), and
the index answers a key only in the namespace its entry is in: another tenant's entries are
not hidden from it, they are simply under other keys, so a lookup, an acquire or a reserve
of them behaves exactly as for a key nobody stored (no "forbidden" to tell apart from
"absent"). The shared namespace ("", clients of ``--token`` or the admin token,
and every client when there is no tenants file) keeps the keys clients send; a tenant with
``shared = true`` reads it after its own.

The file (TOML), one table per tenant::

    [tenants.alice]
    token_sha256 = "9f86d0..."   # sha256 of alice's bearer token: chunkstore tenants hash-token
    quota = "4G"                 # pool bytes alice's entries and writes may hold (default and
                                 # 0: no limit but the pool)
    reserved = "25%"             # never evicted for another tenant (default: 0)
    shared = true                # also read the shared namespace (default: true)
    sessions = 64                # sessions alice may have open at once (default and 0: no
                                 # limit but --max-sessions, which one tenant could fill)
    disk_quota = "20G"           # disk tier bytes alice's entries may hold (default and 0:
                                 # no limit but --disk-size; a share is of the pool's size)

Sizes take units (512M, 4G) or a share of the pool ("25%").
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chunkstore.daemon.config import parse_size
from chunkstore.daemon.disk import NAMESPACE_SECRET
from chunkstore.errors import InvalidRequest
from chunkstore.kv.keys import KEY_BYTES

SHARED = ""  # the shared namespace's tenant name
SHARED_LABEL = "shared"  # its name in metrics and stats: no tenant may take it
PEER = "*peer"  # owner of the sessions a pulling peer opens (its token reads any namespace)
_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
_FIELDS = {"token_sha256", "quota", "reserved", "shared", "sessions", "disk_quota"}


@dataclass(frozen=True)
class Tenant:
    name: str
    token_sha256: str
    quota: int  # pool bytes its entries and reservations may hold (0: no limit)
    reserved: int  # of those, bytes never evicted for another tenant
    shared: bool  # also reads the shared namespace
    sessions: int = 0  # sessions it may have open at once (0: no limit of its own)
    disk_quota: int = 0  # bytes of the disk tier its entries may hold (0: no limit)


@dataclass(frozen=True)
class Caller:
    """Who made a call, from its bearer token, resolved once per call: ``owner`` is whose
    sessions it may use (a tenant's name, ``SHARED``, or ``PEER``), ``tenant`` the namespace
    its keys live in (None: the shared one), ``secret`` the namespace hash's key, ``admin``
    whether it holds the admin token."""

    owner: str
    tenant: Tenant | None = None
    secret: bytes = b""
    admin: bool = False

    @property
    def namespace(self) -> str:
        return self.tenant.name if self.tenant else SHARED

    def own_keys(self, keys: list[bytes]) -> list[bytes]:
        return [tenant_key(self.namespace, k, self.secret) for k in keys]

    @property
    def reads_shared(self) -> bool:
        return self.tenant is not None and self.tenant.shared


SHARED_CALLER = Caller(SHARED)
ADMIN_CALLER = Caller(SHARED, admin=True)
PEER_CALLER = Caller(PEER)


def tenant_key(tenant: str, key: bytes, secret: bytes) -> bytes:
    """The key ``key`` has in ``tenant``'s namespace: itself in the shared one, else a hash of
    both keyed with the daemon's namespace secret (``namespace_secret``): no two tenants'
    entries share a key, and only the daemon can compute a tenant's (an unkeyed hash let
    anyone who knew a tenant's name name its entries)."""
    if not tenant:
        return key
    if not secret:
        raise InvalidRequest("a tenant's namespace needs the daemon's namespace secret")
    return hashlib.blake2b(
        b"tenant\0" + tenant.encode() + b"\0" + key, digest_size=KEY_BYTES, key=secret
    ).digest()


SECRET_BYTES = 32


def namespace_secret(peer_token: str, disk_dir: str) -> bytes:
    """The key of tenants' namespaces: derived from ``--peer-token`` where one is set (every
    node of a cluster derives the same, so a peer pull names a tenant's entry as its holder
    does); else kept in the disk tier's folder (0600), so entries on disk keep their keys
    across restarts; else new at each start (the pool does not outlive the daemon)."""
    if peer_token:
        return hashlib.blake2b(
            peer_token.encode(), digest_size=SECRET_BYTES, person=b"cs-namespaces"
        ).digest()
    if not disk_dir:
        return secrets.token_bytes(SECRET_BYTES)
    path = Path(disk_dir) / NAMESPACE_SECRET
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        secret = path.read_bytes()
        if len(secret) != SECRET_BYTES:
            raise InvalidRequest(
                f"{path} holds {len(secret)} bytes, not a namespace secret of {SECRET_BYTES}: "
                "remove it only with the disk tier's tenant entries (their keys die with it)"
            ) from None
        return secret
    secret = secrets.token_bytes(SECRET_BYTES)
    with os.fdopen(fd, "wb") as f:
        f.write(secret)
    return secret


def hash_token(token: str) -> str:
    """What the tenants file holds for a bearer token: its sha256, in hex."""
    return hashlib.sha256(token.encode()).hexdigest()


def _size(value: Any, pool_bytes: int, what: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and value.strip().endswith("%"):
        try:
            share = float(value.strip()[:-1])
        except ValueError:
            raise InvalidRequest(f"{what}: not a share of the pool: {value!r}") from None
        if not 0 <= share <= 100:
            raise InvalidRequest(f"{what}: {value!r} is not between 0% and 100%")
        size = int(pool_bytes * share / 100)
    elif isinstance(value, str):
        size = parse_size(value)
    else:
        raise InvalidRequest(f"{what}: a size (4G), a share (25%) or bytes, not {value!r}")
    if size < 0:
        raise InvalidRequest(f"{what}: {value!r} is negative")
    return size


def parse_tenants(text: str, pool_bytes: int, source: str = "tenants file") -> dict[str, Tenant]:
    """The tenants ``text`` (TOML) declares, checked: names, unique tokens, reserved shares
    within the pool and each within its quota."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise InvalidRequest(f"{source}: not TOML: {err}") from None
    unknown = set(data) - {"tenants"}
    if unknown:
        raise InvalidRequest(f"{source}: unknown section(s) {sorted(unknown)}; want [tenants.NAME]")
    tables = data.get("tenants", {})
    tenants: dict[str, Tenant] = {}
    tokens: dict[str, str] = {}
    for name, table in tables.items():
        what = f"{source}: tenant {name!r}"
        if not _NAME.fullmatch(name) or name == SHARED_LABEL:
            raise InvalidRequest(
                f"{what}: a name is 1-63 of a-z 0-9 _ - (starting with a letter or digit), "
                f"and not {SHARED_LABEL!r} (the shared namespace's)"
            )
        if not isinstance(table, dict):
            raise InvalidRequest(f"{what}: a table ([tenants.{name}]), not a value")
        extra = set(table) - _FIELDS
        if extra:
            raise InvalidRequest(
                f"{what}: unknown field(s) {sorted(extra)}; known: {sorted(_FIELDS)}"
            )
        token = str(table.get("token_sha256", "")).lower()
        if not re.fullmatch(r"[0-9a-f]{64}", token):
            raise InvalidRequest(
                f"{what}: token_sha256 must be the 64 hex digits of the token's sha256 "
                "(chunkstore tenants hash-token)"
            )
        if token in tokens:
            raise InvalidRequest(f"{what}: the same token as tenant {tokens[token]!r}")
        tokens[token] = name
        quota = _size(table.get("quota", 0), pool_bytes, f"{what}: quota")
        reserved = _size(table.get("reserved", 0), pool_bytes, f"{what}: reserved")
        if quota and reserved > quota:
            raise InvalidRequest(
                f"{what}: reserved {reserved} bytes is more than its quota {quota}"
            )
        shared = table.get("shared", True)
        if not isinstance(shared, bool):
            raise InvalidRequest(f"{what}: shared is true or false, not {shared!r}")
        sessions = table.get("sessions", 0)
        if isinstance(sessions, bool) or not isinstance(sessions, int) or sessions < 0:
            raise InvalidRequest(f"{what}: sessions is a count (0: no limit), not {sessions!r}")
        disk_quota = _size(table.get("disk_quota", 0), pool_bytes, f"{what}: disk_quota")
        tenants[name] = Tenant(name, token, quota, reserved, shared, sessions, disk_quota)
    total = sum(t.reserved for t in tenants.values())
    if total > pool_bytes:
        raise InvalidRequest(
            f"{source}: the tenants reserve {total} bytes together, more than the pool's "
            f"{pool_bytes}"
        )
    return tenants


def load_tenants(path: str, pool_bytes: int) -> dict[str, Tenant]:
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise InvalidRequest(f"cannot read the tenants file {path}: {err.strerror}") from None
    return parse_tenants(text, pool_bytes, source=path)


class Tenants:
    """The tenants in force: swapped whole by ``replace`` (a reload), so a call sees either
    the old set or the new one, never a mix."""

    def __init__(self, tenants: dict[str, Tenant], service_tokens: list[str]) -> None:
        self._service = {hash_token(t) for t in service_tokens if t}
        self.secret = b""  # the namespace secret: set once the disk tier's folder exists
        self.replace(tenants)

    def replace(self, tenants: dict[str, Tenant]) -> None:
        clash = [t.name for t in tenants.values() if t.token_sha256 in self._service]
        if clash:
            raise InvalidRequest(
                f"tenant(s) {clash} use the daemon's --token, --admin-token or --peer-token: "
                "give each tenant a token of its own"
            )
        # One reference, swapped at once: by token hash, and by name.
        self._current = ({t.token_sha256: t for t in tenants.values()}, dict(tenants))

    @property
    def by_name(self) -> dict[str, Tenant]:
        return self._current[1]

    def of(self, bearer: str | None) -> Tenant | None:
        """The tenant whose token ``bearer`` ("Bearer <token>") carries, or None."""
        if not bearer or not bearer.startswith("Bearer "):
            return None
        digest = hash_token(bearer[len("Bearer ") :])
        # Looked up by the token's hash, never compared with the token: nothing to time.
        return self._current[0].get(digest)

    def knows(self, name: str) -> bool:
        return name == SHARED or name in self.by_name
