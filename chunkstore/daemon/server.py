"""``chunkstore serve``: the daemon process. Its pool, index, gRPC server (the service in
``service``, the interceptors in ``auth``), fast path, metrics endpoint, health, workers
and signals; the socket checks."""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import socket
import stat
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from chunkstore.daemon.auth import SERVICE, DecodeInHandler, TokenCheck
from chunkstore.daemon.config import ServeConfig
from chunkstore.daemon.disk import DiskTier
from chunkstore.daemon.fastpath import FastPath
from chunkstore.daemon.index import Index
from chunkstore.daemon.metrics import Metrics
from chunkstore.daemon.peers import EnginePeers, PeerSource, PeerTLS, StreamPeers
from chunkstore.daemon.pool import reclaim_stale_pools
from chunkstore.daemon.pool_factory import create_pool
from chunkstore.daemon.records import Budget
from chunkstore.daemon.service import ChunkStoreService, drain
from chunkstore.daemon.signals import Signalled
from chunkstore.daemon.spill import SpillWhen
from chunkstore.daemon.tenants import (
    Tenant,
    Tenants,
    load_tenants,
    namespace_secret,
)
from chunkstore.daemon.transfer import MooncakeEngine
from chunkstore.daemon.workers import Workers
from chunkstore.errors import (
    InvalidRequest,
    Unavailable,
)
from chunkstore.protocol import chunkstore_pb2_grpc as pb_grpc
from chunkstore.protocol.fast import fast_socket_path
from chunkstore.protocol.wire import MAX_MESSAGE

if TYPE_CHECKING:
    from chunkstore.daemon.directory import Directory

log = logging.getLogger("chunkstore.serve")


def check_socket_directory(directory: Path, group_access: bool) -> None:
    """Refuse a socket directory another user could swap the socket in: it must be the
    daemon user's and writable by nobody else (by its group only with group access)."""
    st = directory.stat()
    writable_by = stat.S_IWOTH | (0 if group_access else stat.S_IWGRP)
    if st.st_uid != os.getuid() or st.st_mode & writable_by:
        raise InvalidRequest(
            f"socket directory {directory} is owned by uid {st.st_uid} with mode "
            f"{stat.S_IMODE(st.st_mode):o}: it must be this user's (uid {os.getuid()}) and "
            "writable by nobody else; remove it or choose another --socket"
        )


def remove_stale_socket(path: Path) -> None:
    """Remove the socket a dead daemon left; refuse a live one (another daemon answers on it)
    and anything that is not a socket."""
    if not path.exists() and not path.is_symlink():
        return
    if path.is_symlink() or not stat.S_ISSOCK(path.lstat().st_mode):
        raise InvalidRequest(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(2.0)
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink(missing_ok=True)  # nobody listens: a daemon that died left it
        log.info("removed the stale socket %s", path)
        return
    except OSError as exc:  # it will not say: never delete what may be a live daemon's
        raise InvalidRequest(
            f"cannot tell whether a daemon serves on {path} ({exc}); refusing to replace it"
        ) from None
    finally:
        probe.close()
    raise InvalidRequest(
        f"another daemon is serving on {path}: stop it first, or choose another --socket"
    )


class LiveHealth(health.HealthServicer):
    """The standard health service, its status computed when asked: SERVING only while
    ``unready()`` finds nothing wrong (started, not draining, no background thread dead)."""

    def __init__(self, unready: Callable[[], str]) -> None:
        super().__init__()
        self.unready = unready
        self._said = ""

    def refresh(self) -> None:
        reason = self.unready()
        if reason and reason != self._said:
            log.warning("health: NOT_SERVING: %s", reason)
        self._said = reason
        status = (
            health_pb2.HealthCheckResponse.NOT_SERVING
            if reason
            else health_pb2.HealthCheckResponse.SERVING
        )
        for service in ("", SERVICE):
            self.set(service, status)

    def Check(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.refresh()
        return super().Check(request, context)


# (request streaming, response streaming) -> grpc's factory for such a handler, and the
# attribute of a handler that serves that kind of call.


def _peer_tls(config: ServeConfig) -> PeerTLS | None:
    if not config.peer_ca:
        return None
    return PeerTLS(
        Path(config.peer_ca).read_bytes(),
        Path(config.tls_cert).read_bytes(),
        Path(config.tls_key).read_bytes(),
    )


def _budgets(tenants: dict[str, Tenant]) -> dict[str, Budget]:
    return {t.name: Budget(t.quota, t.reserved, t.sessions, t.disk_quota) for t in tenants.values()}


class Daemon:
    """The running daemon: pool, index, gRPC server, metrics endpoint, reaper."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        pool_bytes = config.resolved_pool_bytes()
        num_blocks = max(1, pool_bytes // config.block_size)
        # Checked before anything is created: a bad file leaves nothing behind.
        service_tokens = [config.token, config.admin_token, config.peer_token]
        self.tenants = (
            Tenants(load_tenants(config.tenants, num_blocks * config.block_size), service_tokens)
            if config.tenants
            else None
        )
        if config.device == "cpu":
            for path, size in reclaim_stale_pools(config.shm_dir):
                log.warning("removed %s (%d bytes): its daemon died, leaving it", path, size)
        self.pool = create_pool(
            config.device, config.block_size, num_blocks, config.shm_dir, config.group_access
        )
        self.disk = self._open_disk() if config.disk_dir else None
        if self.tenants is not None:
            self.tenants.secret = namespace_secret(config.peer_token, config.disk_dir)
        self.index = self._index()
        self.metrics = Metrics(self.index, config.node)
        if self.tenants is not None:
            self.index.set_budgets(_budgets(self.tenants.by_name))
        guarded = config.token or config.admin_token or self.tenants
        self.token_check = (
            TokenCheck(config.token, config.admin_token, config.peer_token, self.tenants)
            if guarded
            else None
        )
        self.server = self._grpc_server()
        self.workers = Workers(self.metrics.background_errors)
        self.health = LiveHealth(self._unready)
        service = ChunkStoreService(
            config, self.index, self.pool, self.metrics, on_drain=lambda d: self._set_health(not d)
        )
        service.tenants = self.tenants
        service.token_check = self.token_check
        self.service = service
        self.directory: Directory | None = None
        self.engine: MooncakeEngine | None = None
        self.fast: FastPath | None = None
        pb_grpc.add_ChunkStoreServicer_to_server(service, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.addresses: dict[str, str] = {}
        self._serving = False

    def _index(self) -> Index:
        """The index over the pool (and the disk tier), as the configuration says."""
        config = self.config
        return Index(
            self.pool,
            lease_ttl=config.lease_ttl_s,
            high_watermark=config.high_watermark,
            low_watermark=config.low_watermark,
            verify_commits=config.verify_commits,
            max_sessions=config.max_sessions,
            disk=self.disk,
            spill_queue_bytes=config.resolved_spill_queue_bytes(self.pool.capacity),
            spill_when=SpillWhen(config.spill),
            eviction=config.eviction,
        )

    def _grpc_server(self) -> grpc.Server:
        """The gRPC server, its token check (if any) before every call."""
        config = self.config
        interceptors: list[grpc.ServerInterceptor] = [self.token_check] if self.token_check else []
        interceptors.append(DecodeInHandler())
        return grpc.server(
            # A thread per heartbeat stream and per transfer stream, both bounded, and 32 more
            # that only short calls (and health checks) take.
            futures.ThreadPoolExecutor(
                max_workers=config.max_sessions + config.max_transfers + 32,
                thread_name_prefix="chunkstore-rpc",
            ),
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE),
                ("grpc.max_send_message_length", MAX_MESSAGE),
                ("grpc.so_reuseport", 0),
            ],
        )

    def reload_tenants(self) -> bool:
        """Read the tenants file again (SIGHUP): new tokens, quotas and shares from the next
        call on; sessions, leases and entries stay as they are. A file that does not load
        leaves the tenants in force as they were. Returns whether it loaded."""
        if self.tenants is None:
            log.warning("reload: the daemon was started without --tenants; nothing to reload")
            return False
        try:
            tenants = load_tenants(self.config.tenants, self.pool.capacity)
            self.tenants.replace(tenants)
        except InvalidRequest as err:
            self.metrics.tenant_reloads.labels("failed").inc()
            log.error("reload: %s; the tenants in force stay as they were", err)
            return False
        self.index.set_budgets(_budgets(tenants))
        self.metrics.tenant_reloads.labels("ok").inc()
        log.warning("reload: %d tenants from %s", len(tenants), self.config.tenants)
        return True

    def _open_disk(self) -> DiskTier:
        """The disk tier, with what a previous daemon left in it found again."""
        began = time.monotonic()
        config = self.config
        disk = DiskTier(
            config.disk_dir,
            config.resolved_disk_size(),
            config.high_watermark,
            config.low_watermark,
        )
        log.info(
            "disk tier %s: %d entries, %d of %d bytes, found in %.2f s",
            disk.directory,
            len(disk),
            disk.used,
            disk.capacity,
            time.monotonic() - began,
        )
        if disk.removed_at_start:
            log.warning(
                "disk tier: removed %d torn or stray files a previous daemon left (e.g. %s)",
                len(disk.removed_at_start),
                disk.removed_at_start[0],
            )
        return disk

    def start(self) -> dict[str, str]:
        config = self.config
        if config.socket:
            self._bind_socket(config.socket)
        if config.tcp:
            host = config.tcp.rsplit(":", 1)[0]
            if config.tls_cert:
                credentials = grpc.ssl_server_credentials(
                    [(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())],
                    root_certificates=(
                        Path(config.tls_client_ca).read_bytes() if config.tls_client_ca else None
                    ),
                    require_client_auth=bool(config.tls_client_ca),
                )
                port = self.server.add_secure_port(config.tcp, credentials)
            else:
                port = self.server.add_insecure_port(config.tcp)
            self.addresses["tcp"] = f"{host}:{port}"
        if config.metrics:
            host = config.metrics.rsplit(":", 1)[0]
            port = self.metrics.serve(config.metrics, config.metrics_token)
            self.addresses["metrics"] = f"{host}:{port}"
        self.server.start()
        if config.redis:
            # Imported only when asked for: a daemon without --redis runs without redis-py
            # (the GPU machine's device check has none).
            from chunkstore.daemon.directory import Directory

            self.directory = Directory(
                config.redis,
                config.advertise or self.addresses["tcp"],
                self._peers(),
                config.directory_ttl_s,
                self.index,
                self.metrics,
            )
            self.service.on_miss = self.directory.want
            self.directory.start(self.workers)
        reap_every = max(0.05, min(1.0, self.config.lease_ttl_s / 4))
        self.workers.start("reap", self.index.expire, interval=reap_every)
        if self.disk is not None:
            self.workers.start("spill", self.index.spill_one)
        self._set_health(True)
        self.addresses["shm_path"] = self.pool.shm_path
        return self.addresses

    def _peers(self) -> PeerSource:
        """How this daemon pulls from peers: the gRPC stream, or the transfer engine with the
        stream behind it. An engine that cannot start is said loudly, and the daemon serves
        on without it (its pulls counted as "engine_unavailable" fallbacks)."""
        config, tls = self.config, _peer_tls(self.config)
        if config.transfer_engine == "none":
            return StreamPeers(config.peer_token or None, tls=tls)
        try:
            self.engine = MooncakeEngine(
                config.transfer_listen_host(),
                config.transfer_protocol,
                config.transfer_devices,
                self.pool.region(),
            )
        except Unavailable as err:
            log.error("%s: peers pull over the gRPC stream instead", err)
        else:
            self.service.transfer = self.engine.endpoint
            self.addresses["transfer"] = self.engine.endpoint.session
            log.warning(
                "transfer engine %s/%s on %s: whoever reaches it can read the pool",
                self.engine.endpoint.engine,
                self.engine.endpoint.protocol,
                self.engine.endpoint.session,
            )
        fell_back = self.metrics.peer_pull_fallbacks.labels
        return EnginePeers(
            self.engine,
            lambda reason: fell_back(reason).inc(),
            config.peer_token or None,
            tls=tls,
        )

    def _set_health(self, serving: bool) -> None:
        self._serving = serving
        self.health.refresh()

    def _unready(self) -> str:
        """Why the daemon cannot serve now ("" when it can)."""
        if not self._serving:
            return "starting, draining or stopped"
        dead = self.workers.dead()
        if dead:
            return f"background thread(s) {', '.join(dead)} died"
        return ""

    def _bind_socket(self, path: str) -> None:
        socket_path = Path(path)
        socket_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        check_socket_directory(socket_path.parent, self.config.group_access)
        remove_stale_socket(socket_path)
        previous = os.umask(0o007 if self.config.group_access else 0o077)
        try:
            self.server.add_insecure_port(f"unix:{socket_path}")
        finally:
            os.umask(previous)
        self.addresses["socket"] = str(socket_path)
        check = self.token_check
        self.fast = FastPath(
            fast_socket_path(str(socket_path)),
            self.service,
            (lambda bearer, name: check.refusal(bearer, f"/{SERVICE}/{name}")) if check else None,
            self.config.max_sessions,
            self.config.group_access,
        )
        self.service.fast_socket = self.fast.path
        self.addresses["fast"] = self.fast.path

    def stop(self, drain_timeout: float | None = None) -> int:
        """Drain (bounded), stop serving, free the pool. Returns the leases left behind."""
        self._set_health(False)
        timeout = self.config.drain_timeout_s if drain_timeout is None else drain_timeout
        persist = self.disk is not None and self.config.persist_on_stop
        if persist:
            self.index.persist(0)  # queued now, written while leases drain
        left = drain(self.index, timeout)
        if persist:
            unwritten = self.index.persist(timeout)
            log.log(
                logging.WARNING if unwritten else logging.INFO,
                "disk tier: %d entries on disk, %d memory entries left unwritten at stop",
                len(self.disk) if self.disk else 0,
                unwritten,
            )
        log.debug("drained (%d leases left); stopping the workers and the servers", left)
        self.workers.join()
        if self.fast is not None:
            self.fast.stop()
        if self.directory is not None:
            self.directory.stop()
        if self.engine is not None:
            self.engine.close()
        if not self.server.stop(grace=1.0).wait(timeout=10.0):
            log.warning("the gRPC server did not stop within 10 s of its 1 s grace; going on")
        self.metrics.close()
        # A device pool waits (as long as the drain) for the processes that imported it.
        self.pool.close(
            grace=self.config.drain_timeout_s if drain_timeout is None else drain_timeout
        )
        if "socket" in self.addresses:
            Path(self.addresses["socket"]).unlink(missing_ok=True)
        return left


def serve(config: ServeConfig) -> int:
    """Run until SIGTERM / SIGINT, then drain and exit 0. SIGUSR1 writes every thread's
    stack to stderr (the log) and goes on."""
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    log.info("config: %s", config.describe())
    # Before anything is created: a SIGTERM during start-up still drains and cleans up.
    stop = Signalled(signal.SIGTERM, signal.SIGINT)
    reload = Signalled(signal.SIGHUP)  # read the tenants file again
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    daemon = Daemon(config)
    try:
        addresses = daemon.start()
    except BaseException:
        daemon.stop(drain_timeout=0)  # removes the pool file and the socket
        raise
    daemon.pool.loaded()
    ready = {
        "event": "ready",
        "pid": os.getpid(),
        "pool_bytes": daemon.pool.capacity,
        "node": config.node,
        "block_size": config.block_size,
        **addresses,
    }
    print(json.dumps(ready), flush=True)
    log.info("serving %s", ", ".join(f"{k}={v}" for k, v in addresses.items()))
    reloaded = 0
    while not stop.wait(0.1):
        if reload.count != reloaded:  # here, not in the handler: it reads a file, takes locks
            reloaded = reload.count
            daemon.reload_tenants()
    assert stop.last is not None
    log.info("got %s: draining leases for up to %.0f s", stop.last.name, config.drain_timeout_s)
    # A stop that hangs says where, in the log, while it still can (a supervisor's SIGKILL
    # comes next): every thread's stack once it has taken the drain timeout and 10 s more.
    # faulthandler's own C thread writes them: a thread that holds the GIL, or a logging
    # lock, cannot keep them from the log.
    for handler in logging.getLogger().handlers:
        handler.flush()
    faulthandler.dump_traceback_later(config.drain_timeout_s + 10.0)
    left = daemon.stop()
    faulthandler.cancel_dump_traceback_later()
    if left:
        log.warning("stopped with %d leases still held after the drain timeout", left)
    log.info("stopped")
    return 0
