"""`--allowed-host`, which `serve` and `worker` share: the Host names served beside the
loopback ones."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from blocktune.tuner.config.policy import ServerSettings

__all__ = ["add_allowed_hosts_argument", "with_allowed_hosts"]


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
