"""Configuration: defaults < file < environment < flags; the stubs match the proto."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from chunkstore.daemon.config import ServeConfig, load
from chunkstore.daemon.disk import MARKER
from chunkstore.errors import InvalidRequest
from chunkstore.protocol.generate import stale_outputs


def test_each_layer_overrides_the_one_before(tmp_path: Path) -> None:
    file = tmp_path / "chunkstore.toml"
    file.write_text('block_size = 4096\nlease_ttl_s = 5.0\ntcp = "127.0.0.1:7000"\n')
    env = {
        "CHUNKSTORE_LEASE_TTL_S": "7",
        "CHUNKSTORE_VERIFY_COMMITS": "false",
        "CHUNKSTORE_TCP": "127.0.0.1:7001",
    }
    config = load(str(file), environ=env, flags={"tcp": "127.0.0.1:7002", "token": None})
    assert config.block_size == 4096  # file
    assert config.lease_ttl_s == 7.0  # environment over file
    assert config.verify_commits is False
    assert config.tcp == "127.0.0.1:7002"  # flag over environment
    assert config.high_watermark == ServeConfig().high_watermark  # default


def test_the_config_file_can_come_from_the_environment(tmp_path: Path) -> None:
    file = tmp_path / "c.toml"
    file.write_text("pool_bytes = 1234\n")
    assert load(environ={"CHUNKSTORE_CONFIG": str(file)}).pool_bytes == 1234


def test_bad_settings_are_refused_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="unknown setting 'pool_size'"):
        load(environ={}, flags={"pool_size": 1})
    with pytest.raises(InvalidRequest, match="not a whole number or size"):
        load(environ={"CHUNKSTORE_BLOCK_SIZE": "big"})
    sizes = load(environ={"CHUNKSTORE_POOL_BYTES": "2G"}, flags={"block_size": "512KiB"})
    assert (sizes.pool_bytes, sizes.block_size) == (2 << 30, 512 << 10)
    with pytest.raises(InvalidRequest, match="set --disk-dir too"):
        load(environ={}, flags={"disk_size": "10G"})
    with pytest.raises(InvalidRequest, match="--spill: one of commit, read-again"):
        load(environ={"CHUNKSTORE_SPILL": "sometimes"})
    assert load(environ={}, flags={"spill": "read-again"}).spill == "read-again"
    with pytest.raises(InvalidRequest, match="host memory"):
        load(environ={}, flags={"disk_dir": str(tmp_path), "device": "fake:0"})
    with pytest.raises(InvalidRequest, match="without a token"):
        load(environ={}, flags={"tcp": "10.1.2.3:50551"})
    assert load(environ={}, flags={"tcp": "10.1.2.3:50551", "token": "t"}).token == "t"
    with pytest.raises(InvalidRequest, match="TLS"):
        load(environ={}, flags={"tls_cert": "c.pem"})
    # A cluster directory needs an address peers can dial.
    cluster = {
        "redis": "redis://10.0.0.5:6379/0",
        "token": "t",
        "peer_token": "p",
        "allow_insecure_peers": "true",
    }
    with pytest.raises(InvalidRequest, match="set --advertise"):
        load(environ={}, flags={**cluster, "tcp": "0.0.0.0:50551"})
    with pytest.raises(InvalidRequest, match="needs --tcp"):
        load(environ={}, flags={**cluster, "tcp": ""})
    advertised = {**cluster, "tcp": "0.0.0.0:50551", "advertise": "10.0.0.7:50551"}
    assert load(environ={}, flags=advertised).advertise == "10.0.0.7:50551"


def test_a_disk_dir_holding_what_the_tier_did_not_make_is_refused_unless_allowed(
    tmp_path: Path,
) -> None:
    """A new, empty or tier-made --disk-dir is taken; one holding anything else at its top
    level (most likely the wrong directory) needs --disk-dir-allow-foreign."""
    tier = tmp_path / "tier"
    for usable in (tmp_path / "new", tier):
        assert load(environ={}, flags={"disk_dir": str(usable)}).disk_dir == str(usable)
    (tier / "0a").mkdir(parents=True)
    (tier / MARKER).write_text("")
    assert load(environ={}, flags={"disk_dir": str(tier)}).disk_dir == str(tier)
    (tier / "ab").symlink_to(tmp_path)  # named as the tier's subdirectories are: not one
    with pytest.raises(InvalidRequest, match="e.g. ab.*--disk-dir-allow-foreign"):
        load(environ={}, flags={"disk_dir": str(tier)})
    (tier / "ab").unlink()
    (tier / "README").touch()
    with pytest.raises(InvalidRequest, match=r"did not make \(1 at its top level, e.g. README\)"):
        load(environ={}, flags={"disk_dir": str(tier)})
    allowed = {"CHUNKSTORE_DISK_DIR_ALLOW_FOREIGN": "true"}
    assert load(environ=allowed, flags={"disk_dir": str(tier)}).disk_dir_allow_foreign


def test_the_token_is_not_printed() -> None:
    assert "s3cret" not in load(environ={}, flags={"token": "s3cret"}).describe()


def test_generated_stubs_match_the_proto() -> None:
    assert stale_outputs() == []


def test_the_daemon_and_its_command_line_start_without_torch() -> None:
    """torch takes seconds to import: ``chunkstore serve`` on a CPU pool, the admin verbs'
    parser and ``--help`` never load it (a device pool and the benches do, when asked for)."""
    code = (
        "import sys\n"
        "import chunkstore.cli, chunkstore.daemon.server\n"
        "chunkstore.cli.build_parser(bench_arguments=False)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
