"""Where `serve` and `worker` listen: `--allowed-host` (the Host names served beside the
loopback ones), the `--port` type, and the check that the address is free before anything
is loaded."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from blocktune.tuner.config.policy import ServerSettings

__all__ = [
    "PortUnavailable",
    "add_allowed_hosts_argument",
    "check_port_free",
    "port_number",
    "with_allowed_hosts",
]


class PortUnavailable(ValueError):
    """An address a command cannot listen on (names host:port and why)."""


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 1 to 65535."""
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 1..65535, got {text}")
    return value


def check_port_free(host: str, port: int) -> None:
    """Raise `PortUnavailable` where `host:port` cannot be bound now as uvicorn binds it
    (SO_REUSEADDR), so that a port in use ends a command before it loads anything."""
    import errno
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                hint = "another process listens there: stop it or choose another --port"
            else:
                hint = "choose another --host or --port"
            reason = error.strerror or str(error)
            raise PortUnavailable(f"cannot listen on {host}:{port}: {reason} ({hint})") from None


def _host_name(text: str) -> str:
    """An argparse type: a host name or address as `server.allowed_hosts` takes it."""
    from pydantic import TypeAdapter, ValidationError

    from blocktune.tuner.config.policy import HostName

    try:
        return TypeAdapter(HostName).validate_python(text)
    except ValidationError as error:
        raise argparse.ArgumentTypeError(error.errors()[0]["msg"]) from None


def add_allowed_hosts_argument(parser: argparse.ArgumentParser) -> None:
    """`--allowed-host NAME`, repeatable: the Host names served beside the loopback ones."""
    parser.add_argument(
        "--allowed-host",
        dest="allowed_hosts",
        action="append",
        type=_host_name,
        default=None,
        metavar="NAME",
        help="a host name or address clients send in the Host header (a proxy's name, this "
        "machine's address), served beside the loopback ones; repeat for several; any other "
        "Host is refused with 421, against DNS rebinding (default: the policy's "
        "server.allowed_hosts, else none)",
    )


def with_allowed_hosts(server: ServerSettings, args: argparse.Namespace) -> ServerSettings:
    """`server` with `--allowed-host`'s names, when any were given."""
    if args.allowed_hosts is None:
        return server
    return server.model_copy(update={"allowed_hosts": tuple(args.allowed_hosts)})
