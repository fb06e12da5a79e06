"""The daemon's configuration: one typed object, built once from
defaults < config file (TOML) < ``CHUNKSTORE_*`` environment < command-line flags,
printed on start-up and passed down. No other module reads the environment."""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from socket import gethostname
from typing import Any

from chunkstore.daemon.eviction import POLICIES
from chunkstore.daemon.spill import SpillWhen
from chunkstore.daemon.transfer import ENGINES, PROTOCOLS
from chunkstore.errors import InvalidRequest
from chunkstore.protocol.endpoints import default_socket

ENV_PREFIX = "CHUNKSTORE_"


@dataclass
class ServeConfig:
    device: str = "cpu"
    pool_bytes: int = 0  # 0: pool_fraction of the memory available at start
    pool_fraction: float = 0.25
    block_size: int = 1 << 20
    shm_dir: str = "/dev/shm"
    socket: str = dataclasses.field(default_factory=default_socket)  # "" disables
    tcp: str = "127.0.0.1:50551"  # "" disables
    metrics: str = "127.0.0.1:9477"  # "" disables
    metrics_token: str = ""  # set: /metrics answers only "Authorization: Bearer <it>"
    group_access: bool = False  # socket and pool readable by the daemon's group too
    token: str = ""  # bearer token every client must send
    admin_token: str = ""  # bearer token admin calls need (Evict, Clear, Pin, Drain, ...)
    tenants: str = ""  # tenants file (tenants.py): a token per tenant, quotas, reserved shares
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""  # set: clients must present a certificate it signed (mutual TLS)
    allow_insecure_remote: bool = False  # bind TCP beyond loopback without a token
    lease_ttl_s: float = 30.0
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    eviction: str = "worth"  # which entry goes first: worth, or lru (eviction.py)
    verify_commits: bool = False  # every read checks; this refuses a bad write earlier
    drain_timeout_s: float = 10.0
    disk_dir: str = ""  # the disk tier's directory ("" = memory only)
    disk_size: int = 0  # 0: half the free space of disk_dir's filesystem at start
    disk_dir_allow_foreign: bool = False  # use a disk_dir holding what the tier did not write
    spill_queue_bytes: int = 0  # 0: half the pool
    spill: str = "commit"  # when an entry goes to the disk tier (spill.SpillWhen)
    persist_on_stop: bool = True  # with a disk tier: write memory entries to it on a clean stop
    max_sessions: int = 1024  # clients at once (each holds a heartbeat stream)
    max_transfers: int = 64  # Read / Write streams at once (clients that cannot map the pool)
    node: str = dataclasses.field(default_factory=gethostname)
    redis: str = ""  # cluster directory, redis://host:port/db ("" = standalone)
    advertise: str = ""  # host:port peers dial for this daemon ("" = the tcp address)
    directory_ttl_s: float = 60.0
    peer_token: str = ""  # what this daemon sends to peers, and accepts from them (reads only)
    peer_ca: str = ""  # peers' server certificates must chain to it: pulls dial over TLS
    allow_insecure_peers: bool = False  # send peer_token to peers dialed without TLS
    transfer_engine: str = "none"  # "mooncake": peers read the pool one-sidedly (transfer.py)
    transfer_protocol: str = "tcp"  # the engine's fabric: tcp, rdma, ascend
    transfer_devices: str = ""  # the engine's devices (RDMA NICs), "" = its own choice
    transfer_host: str = ""  # the address the engine listens on ("" = the --advertise host)
    log_level: str = "INFO"

    def validate(self) -> None:
        self._validate_access()
        self._validate_sizes_and_cluster()
        from chunkstore.device.device_ipc import parse_device  # torch: not for --help

        parse_device(self.device)
        self._validate_transfer()
        self._validate_disk_dir()

    def _validate_access(self) -> None:
        """Who may connect, with what credentials, and what peers are sent."""
        remote = self.tcp and not _is_loopback(self.tcp)
        guarded = self.token or self.tenants
        if remote and not guarded and not self.allow_insecure_remote:
            raise InvalidRequest(
                f"refusing to listen on {self.tcp} without a token: anyone who reaches "
                "it could read and write KV. Set --token (and TLS), or pass "
                "--allow-insecure-remote if the network is yours alone."
            )
        if self.max_sessions < 1 or self.max_transfers < 1:
            raise InvalidRequest("--max-sessions and --max-transfers must be at least 1")
        if self.tenants and self.peer_token and self.peer_token in (self.token, self.admin_token):
            raise InvalidRequest(
                "with --tenants, --peer-token must differ from --token and --admin-token: a "
                "peer reads every tenant's namespace, a client only the shared one"
            )
        if self.redis and guarded and not self.peer_token:
            raise InvalidRequest(
                "the cluster directory (--redis) with --token or --tenants needs --peer-token: the "
                "credential daemons pull from each other with (read calls only). The client "
                "token is never sent to peers."
            )
        if self.peer_token and not self.peer_ca and not self.allow_insecure_peers:
            raise InvalidRequest(
                "--peer-token would go to whatever address Redis lists, unauthenticated: set "
                "--peer-ca (and --tls-cert / --tls-key) so peers are dialed over TLS, or pass "
                "--allow-insecure-peers if the network and the Redis are yours alone"
            )
        if self.peer_ca and not self.tls_cert:
            raise InvalidRequest("--peer-ca needs --tls-cert / --tls-key (shown to peers)")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise InvalidRequest("TLS needs both --tls-cert and --tls-key")
        if self.tls_client_ca and not self.tls_cert:
            raise InvalidRequest("mutual TLS (--tls-client-ca) needs --tls-cert and --tls-key")

    def _validate_sizes_and_cluster(self) -> None:
        """The pool, the cluster directory, the watermarks and the disk tier."""
        if self.block_size <= 0 or self.pool_bytes < 0:
            raise InvalidRequest("block size must be positive and pool bytes >= 0")
        if self.redis and not (self.advertise or self.tcp):
            raise InvalidRequest("a cluster directory (--redis) needs --tcp for peers to dial")
        wildcard = self.tcp.rsplit(":", 1)[0].strip("[]") in ("0.0.0.0", "::", "")
        if self.redis and not self.advertise and wildcard:
            raise InvalidRequest(
                f"peers cannot dial {self.tcp}: with --redis, set --advertise to this node's "
                "reachable host:port (in Kubernetes: $(POD_IP):50551)"
            )
        if self.redis and self.directory_ttl_s <= 0:
            raise InvalidRequest("--directory-ttl-s must be positive")
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise InvalidRequest("watermarks need 0 < low <= high <= 1")
        if self.disk_size < 0 or self.spill_queue_bytes < 0:
            raise InvalidRequest("--disk-size and --spill-queue-bytes must be >= 0")
        if self.disk_size and not self.disk_dir:
            raise InvalidRequest("--disk-size sizes the disk tier: set --disk-dir too")
        if self.disk_dir and self.device != "cpu":
            raise InvalidRequest(
                f"the disk tier reads and writes host memory; a --device {self.device} pool has "
                "none yet: leave --disk-dir unset (docs/whats-left.md, the disk tier)"
            )

    def _validate_disk_dir(self) -> None:
        """A --disk-dir that holds what the tier did not write is refused: most likely the
        wrong directory, and one the tier would share with whatever else writes there."""
        if not self.disk_dir or self.disk_dir_allow_foreign:
            return
        from chunkstore.daemon.disk import foreign_top_level  # numpy: not for --help

        foreign = foreign_top_level(Path(self.disk_dir))
        if foreign:
            raise InvalidRequest(
                f"--disk-dir {self.disk_dir} holds what the disk tier did not make ({len(foreign)} "
                f"at its top level, e.g. {foreign[0].name}): give it an empty or new directory "
                "of its own, or pass --disk-dir-allow-foreign to use this one, leaving them be"
            )

    def _validate_transfer(self) -> None:
        if self.eviction not in POLICIES:
            raise InvalidRequest(f"--eviction: one of {', '.join(POLICIES)}")
        if self.spill not in {s.value for s in SpillWhen}:
            raise InvalidRequest(f"--spill: one of {', '.join(SpillWhen)}")
        if self.transfer_engine not in ENGINES:
            raise InvalidRequest(f"--transfer-engine: one of {', '.join(ENGINES)}")
        if self.transfer_protocol not in PROTOCOLS:
            raise InvalidRequest(f"--transfer-protocol: one of {', '.join(PROTOCOLS)}")
        if self.transfer_engine == "none":
            return
        if self.device != "cpu":
            raise InvalidRequest(
                f"--transfer-engine registers host memory; a --device {self.device} pool is not "
                "registered yet: leave --transfer-engine none (peers pull over the gRPC stream)"
            )
        if not self.redis:
            raise InvalidRequest("--transfer-engine serves peer pulls: it needs --redis")
        if self.peer_token and not self.allow_insecure_peers:
            raise InvalidRequest(
                "the transfer engine lets whoever reaches its port read the pool, whatever "
                "--peer-token and --peer-ca say: pass --allow-insecure-peers if the fabric is "
                "the cluster's alone, or leave --transfer-engine none"
            )

    def transfer_listen_host(self) -> str:
        """Where the engine listens: --transfer-host, else the host peers dial."""
        return self.transfer_host or (self.advertise or self.tcp).rsplit(":", 1)[0].strip("[]")

    def resolved_pool_bytes(self) -> int:
        if self.pool_bytes:
            return self.pool_bytes
        return int(available_memory() * self.pool_fraction)

    def resolved_disk_size(self) -> int:
        if self.disk_size or not self.disk_dir:
            return self.disk_size
        probe = Path(self.disk_dir)
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        free = os.statvfs(probe)
        return free.f_bavail * free.f_frsize // 2

    def resolved_spill_queue_bytes(self, pool_bytes: int) -> int:
        return self.spill_queue_bytes or max(1, pool_bytes // 2)

    def describe(self) -> str:
        shown = dataclasses.asdict(self)
        for name in ("token", "admin_token", "peer_token", "metrics_token"):
            if shown[name]:
                shown[name] = "***"
        return " ".join(f"{k}={v}" for k, v in shown.items())


def available_memory() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """An integer, or a byte size with a binary unit: 4096, 512M, 64G, 2T (also 64GiB)."""
    raw = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = raw[-1:] if raw[-1:] in _UNITS else ""
    try:
        return int(raw[: len(raw) - len(unit)]) * _UNITS[unit]
    except ValueError:
        raise InvalidRequest(f"not a whole number or size (like 512M, 64G): {text!r}") from None


def _is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


def _coerce(value: Any, kind: Any) -> Any:
    if kind in (bool, "bool"):
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off", ""):
            return False
        raise InvalidRequest(f"not a boolean: {value!r}")
    if kind in (int, "int") and isinstance(value, str):
        return parse_size(value)
    caster = {"int": int, "float": float, "str": str}.get(kind, kind)
    try:
        return caster(value)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"not a {kind}: {value!r}") from exc


def load(
    config_file: str | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> ServeConfig:
    """Defaults < file < environment < flags (flags left at None do not count)."""
    environ = os.environ if environ is None else environ
    config = ServeConfig()
    types = {f.name: f.type for f in fields(ServeConfig)}
    layers: list[tuple[str, Mapping[str, Any]]] = []
    path = config_file or environ.get(ENV_PREFIX + "CONFIG")
    if path:
        with open(path, "rb") as f:
            layers.append((f"config file {path}", tomllib.load(f)))
    env = {
        name: environ[ENV_PREFIX + name.upper()]
        for name in types
        if ENV_PREFIX + name.upper() in environ
    }
    layers.append(("environment", env))
    layers.append(("flags", {k: v for k, v in (flags or {}).items() if v is not None}))
    for source, values in layers:
        for name, value in values.items():
            if name not in types:
                raise InvalidRequest(f"unknown setting {name!r} in {source}")
            setattr(config, name, _coerce(value, types[name]))
    config.validate()
    return config


# The --help of each setting's flag (add_flags).
FLAG_HELP = {
    "device": "pool device: cpu (a shared-memory file), cuda[:N] or npu[:N] (one device "
    "allocation same-node workers open by IPC), fake[:N] (a CPU stand-in for a device, "
    "for tests)",
    "pool_bytes": "pool size in bytes, e.g. 8G (default: pool_fraction of available memory)",
    "pool_fraction": "share of available memory for the pool when pool_bytes is 0 (0.25)",
    "block_size": "pool block size in bytes (default 1 MiB)",
    "shm_dir": "where the shared-memory pool file lives (default /dev/shm)",
    "socket": "unix socket path ('' disables; default $XDG_RUNTIME_DIR/chunkstore.sock)",
    "tcp": "TCP address ('' disables; default 127.0.0.1:50551; port 0 picks one)",
    "metrics": "Prometheus /metrics address ('' disables; default 127.0.0.1:9477)",
    "metrics_token": "bearer token /metrics requires (Prometheus: authorization.credentials); "
    "set it where /metrics is reachable by anyone who must not see each tenant's figures",
    "group_access": "let the daemon's group use the socket and the pool (default: user only)",
    "token": "bearer token clients must send (required beyond loopback, unless --tenants)",
    "tenants": "a TOML file of tenants: each one's token (sha256), byte quota, reserved "
    "share and access to the shared namespace (docs/tenants.md). A tenant's token reads and "
    "writes its own namespace only; --token's clients use the shared one. Reloaded on SIGHUP",
    "admin_token": "bearer token the admin calls (evict, clear, pin, unpin, drain, undrain) "
    "need; it is good for every other call too. With --token set and no admin token, admin "
    "calls are refused",
    "tls_cert": "TLS certificate (PEM) for the TCP port",
    "tls_key": "TLS private key (PEM)",
    "tls_client_ca": "CA (PEM) that client certificates must chain to: mutual TLS",
    "allow_insecure_remote": "allow a non-loopback TCP address without a token",
    "lease_ttl_s": "seconds a silent client keeps its leases and reservations (30)",
    "high_watermark": "evict LRU entries once the pool (or the disk tier) is this full (0.95)",
    "low_watermark": "... down to this fill (0.85)",
    "verify_commits": "also hash an entry's pool bytes at commit and refuse a mismatch "
    "(false: every read checks the bytes, and a bad entry is evicted at its first read; "
    "true catches a faulty writer before anyone reads, at ~30%% of a put's time; pulls "
    "from peers are always checked)",
    "drain_timeout_s": "on SIGTERM, how long to wait for leases to end (10); with a disk "
    "tier, as long again at most for memory entries to reach the disk",
    "disk_dir": "directory of the disk tier (default: none, memory only): committed "
    "entries are also written there in the background (when: --spill), a memory miss it "
    "holds is read back into the pool, and what it holds is served again after a restart "
    "or a crash. CPU pools only, for now",
    "disk_size": "bytes the disk tier may use, e.g. 500G (default: half the free space of "
    "--disk-dir's filesystem at start); its least recently used entries go first",
    "disk_dir_allow_foreign": "use a --disk-dir whose top level holds files or folders "
    "the disk tier did not make (default false: refused at start). The tier still touches "
    "only its own (<2 hex>/<32 hex>.entry files and its marker): the rest is left in "
    "place, symlinks unfollowed, and counted in one warning at start",
    "spill_queue_bytes": "bytes of committed entries waiting for the disk at most (default: "
    "half the pool); beyond it an entry stays in memory only (counted as dropped), so a "
    "put never waits for the disk",
    "spill": "with --disk-dir, when an entry is written there: commit (the default: every "
    "entry, as it is committed) or read-again (once its key is asked for a second time: "
    "what only one request uses is never written: for a small or wear-limited disk, "
    "which then takes fewer rewrites, at a few points of hit rate; a clean stop still "
    "writes every memory entry; docs/benchmarks.md 'What to spill')",
    "persist_on_stop": "with --disk-dir: on a clean stop, write the memory entries the disk "
    "lacks (default true)",
    "max_sessions": "client sessions served at once; Hello beyond it is refused with "
    "RESOURCE_EXHAUSTED (1024; each holds a heartbeat stream and one server thread)",
    "max_transfers": "Read / Write streams at once, beyond them refused with "
    "RESOURCE_EXHAUSTED (64; shared-memory clients do not use them)",
    "node": "node name reported to clients (default: hostname)",
    "redis": "Redis URL of the cluster directory, e.g. redis://10.0.0.5:6379/0 "
    "(default: none, standalone): misses are pulled from peers that hold the chunk",
    "advertise": "host:port other nodes dial for this daemon (default: the --tcp address)",
    "directory_ttl_s": "seconds a directory claim lives unless renewed (every ttl/3; 60)",
    "peer_token": "bearer token this daemon pulls from peers with, and accepts from them "
    "for read calls only (Hello, Heartbeat, Lookup, Acquire, Read, Release, Stats); needed "
    "with --redis and --token. The client --token is never sent to a peer",
    "peer_ca": "CA (PEM) peers' server certificates must chain to: pulls dial peers over "
    "TLS and show --tls-cert / --tls-key, so a peer that is only listed in Redis gets "
    "nothing and plants nothing",
    "allow_insecure_peers": "send --peer-token to peers dialed without TLS (a network and "
    "Redis that are yours alone)",
    "eviction": "which evictable entry goes first: worth (the default: recompute cost "
    "saved per byte x reads, aged: GreedyDual-Size-Frequency; a prefix block's tail "
    "before its head) or lru (least recently released)",
    "transfer_engine": "none (default: peers pull over the gRPC stream) or mooncake: "
    "Mooncake's Transfer Engine reads entries one-sidedly between pools (pip install "
    "'chunkstore[mooncake]'; Debian's libibverbs1 and libfabric1). It does not "
    "authenticate readers: use it on a fabric that is the cluster's alone. Needs --redis; "
    "any pull it cannot serve goes over the stream, counted by why",
    "transfer_protocol": "the engine's fabric: tcp (default; any network), rdma "
    "(RoCE / InfiniBand), ascend (HCCS / RoCE between Ascend NPUs)",
    "transfer_devices": "the engine's devices, e.g. RDMA NICs 'mlx5_0,mlx5_1' (default: "
    "its own choice)",
    "transfer_host": "address the engine listens on (default: the host of --advertise, "
    "else of --tcp)",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
}


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, each defaulting to None so that it overrides only when given."""
    for f in fields(ServeConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in (bool, "bool"):
            parser.add_argument(
                flag, nargs="?", const="true", default=None, metavar="BOOL", help=FLAG_HELP[f.name]
            )
        else:
            parser.add_argument(flag, default=None, help=FLAG_HELP[f.name])
