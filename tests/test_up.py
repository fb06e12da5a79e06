"""`chunkstore up` refuses what it cannot run before it starts anything: a flag that is not
an address or a port (argparse: exit 2), an address nothing can listen on (the bind's own
reason, IPv4 or IPv6), a pool /dev/shm cannot hold. What it runs, and that it leaves nothing:
tests/test_quickstart.py."""

from __future__ import annotations

import os
import socket
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from chunkstore.cli.common import bind_problem
from chunkstore.processes.daemon import SHM
from chunkstore.processes.router import RunningRouter
from chunkstore.testing.cli import chunkstore


def refused(*flags: str) -> str:
    """``chunkstore up FLAGS``'s standard error, once it has exited 2 with no traceback and
    no folder of its own left (it started nothing)."""
    before = set(Path(tempfile.gettempdir()).glob("chunkstore-up-*"))
    run = chunkstore("up", *flags, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert set(Path(tempfile.gettempdir()).glob("chunkstore-up-*")) <= before
    return run.stderr


def test_a_port_out_of_range_is_a_usage_error() -> None:
    for port in ("70000", "-1", "http"):
        err = refused("--port", port)
        assert "argument --port:" in err and port in err, err


def test_a_host_that_is_no_address_is_a_usage_error() -> None:
    err = refused("--host", "256.1.1.1")
    assert "argument --host: '256.1.1.1' is not an IPv4 address" in err, err
    err = refused("--host", "no-such-host.invalid")
    assert "argument --host:" in err and "resolves" in err, err


def test_an_address_of_no_interface_is_said_so_not_in_use() -> None:
    """2001:db8::/32 is for documentation: no machine has it. IPv6 is probed as IPv6."""
    err = refused("--host", "2001:db8::1", "--port", "8080")
    assert "cannot listen on [2001:db8::1]:8080:" in err and "in use" not in err, err


def test_a_port_in_use_is_said_so_over_ipv4_and_ipv6() -> None:
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        try:
            held = socket.socket(family)
            held.bind((host, 0))
        except OSError:
            pytest.skip(f"no {host} here")
        with held:
            held.listen()
            port = held.getsockname()[1]
            assert "in use" in bind_problem(host, port)
            err = refused("--host", host, "--port", str(port))
            where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            assert f"cannot listen on {where}: in use" in err, err
        assert bind_problem(host, port) == ""  # free again: up would go on


def test_a_pool_dev_shm_cannot_hold_is_refused_with_the_sizes() -> None:
    """The pool is in /dev/shm or nowhere. Larger than /dev/shm and the temporary folder
    together: a build that put it on a disk instead cannot place it either (and fails
    otherwise than with this refusal) rather than filling the disk."""
    shm = os.statvfs(SHM)
    tmp = os.statvfs(tempfile.gettempdir())
    pool = shm.f_bavail * shm.f_frsize + tmp.f_bavail * tmp.f_frsize + (1 << 30)
    err = refused("--pool-bytes", str(pool), "--port", "0")
    assert f"the pool needs {pool / (1 << 20):,.0f} MiB" in err, err
    assert "/dev/shm has" in err or "memory available" in err, err


def test_a_disk_size_without_a_disk_dir_is_a_usage_error() -> None:
    assert "set --disk-dir too" in refused("--disk-size", "1G", "--port", "0")


def test_the_router_listens_on_ipv6_as_up_starts_it(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`up --host ::1` passes its checks; the router it starts then listens there (any
    answer to /health: no instance behind it here)."""
    try:
        socket.socket(socket.AF_INET6).close()
    except OSError:
        pytest.skip("no IPv6 here")
    router = RunningRouter(
        tmp_path,
        *("--host", "::1", "--instance", "http://127.0.0.1:9", "--model", tiny_model_dir),
        *("--address", f"unix:{tmp_path}/none.sock", "--cold-chunks", "off"),
    )
    try:
        assert router.url.startswith("http://[::1]:"), router.url
        try:
            code = urllib.request.urlopen(f"{router.url}/health", timeout=10).status
        except urllib.error.HTTPError as err:
            code = err.code
        assert code in (200, 503), code
    finally:
        router.stop()
