"""What several commands share: the daemon's address and token flags, and the argparse types
of a listening address (a bad one is a usage error, exit 2, before anything starts)."""

from __future__ import annotations

import argparse
import errno
import ipaddress
import socket


def add_daemon_address(parser: argparse.ArgumentParser, token: bool = True) -> None:
    from chunkstore.protocol.endpoints import default_address

    parser.add_argument(
        "--address",
        default=default_address(),
        help="the daemon: unix:/path or host:port (default: the default socket)",
    )
    if token:
        parser.add_argument(
            "--token",
            default=None,
            help="bearer token, if the daemon has one (evict, clear, pin, unpin, drain and "
            "undrain need its admin token)",
        )


def port_number(text: str) -> int:
    """A TCP port to listen on: 0 (any free one) to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port: 0 (any) to 65535")
    return port


def host_address(text: str) -> str:
    """An address to listen on: an IPv4 or IPv6 address, or a name that resolves to one. Four
    dot-separated numbers are an IPv4 address or nothing (a resolver would try 256.1.1.1 as
    a name)."""
    literal = text.strip("[]")
    try:
        return str(ipaddress.ip_address(literal))
    except ValueError:
        pass
    if all(part.isdigit() for part in literal.split(".")):
        raise argparse.ArgumentTypeError(f"{text!r} is not an IPv4 address")
    try:
        socket.getaddrinfo(literal, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as err:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither an IPv4 / IPv6 address nor a name that resolves ({err})"
        ) from None
    return literal


def bind_problem(host: str, port: int) -> str:
    """Why nothing can listen on ``host``:``port`` here ('' where something can): the bind's
    own reason (in use, not an address of this machine, not permitted), over IPv4 or IPv6 as
    the address is."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        return f"{host} does not resolve ({err})"
    family, kind, proto, _, address = found[0]
    try:
        with socket.socket(family, kind, proto) as probe:
            probe.bind(address)
    except OSError as err:
        reason = _BIND_ERRORS.get(err.errno or 0, err.strerror or str(err))
        return f"{_where(host, port)}: {reason}"
    return ""


def _where(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


_BIND_ERRORS = {
    errno.EADDRINUSE: "in use: --port another (0: any)",
    errno.EADDRNOTAVAIL: "not an address of this machine: --host one it has",
    errno.EACCES: "not permitted: ports below 1024 need privileges; --port another",
}
