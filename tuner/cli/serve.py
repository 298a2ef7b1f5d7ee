"""`blocktune serve`: run the sidecar (HTTP API + scheduled decisions) until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from blocktune.tuner.cli.host_args import (
    PortUnavailable,
    add_allowed_hosts_argument,
    check_port_free,
    port_number,
    with_allowed_hosts,
)
from blocktune.tuner.cli.policy_args import add_policy_argument

__all__ = ["register"]


def run_serve(args: argparse.Namespace) -> int:
    """Load the policy, refuse unsafe binds, serve; on SIGTERM/SIGINT stop accepting, stop the
    scheduler, save the state and exit 0."""
    import logging

    from blocktune.tuner.config.calibration import CalibrationError
    from blocktune.tuner.config.config_files import ConfigError
    from blocktune.tuner.config.policy import load_policy, policy_path
    from blocktune.tuner.operations import log_event, token_from_env
    from blocktune.tuner.serving.http import InsecureBind, check_bind
    from blocktune.tuner.serving.sidecar_app import serve_sidecar
    from blocktune.tuner.sidecar.assembly import build_sidecar

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("apscheduler").setLevel(logging.WARNING)
    try:
        policy_file = policy_path(args.policy)
        policy = load_policy(policy_file)
    except ConfigError as error:
        for problem in error.problems:
            print(problem, file=sys.stderr)
        return 2
    server = with_allowed_hosts(policy.server, args)
    host = args.host or server.host
    port = args.port or server.port
    if args.state_file is not None:
        state_file = Path(args.state_file)
    elif server.state_file is not None:
        state_file = policy_file.parent / Path(server.state_file).expanduser()
    else:
        state_file = None
    token = token_from_env(policy.auth.token_env)
    try:
        check_bind(host, token)
        check_port_free(host, port)
        sidecar = build_sidecar(policy, state_file=state_file, base_dir=policy_file.parent)
    except (InsecureBind, PortUnavailable, ConfigError, CalibrationError, ValueError) as error:
        print(f"blocktune serve: {error}", file=sys.stderr)
        return 2
    log = logging.getLogger("blocktune.sidecar")
    log_event(
        log,
        "serving",
        host=host,
        port=port,
        state_file=state_file,
        auth=token is not None,
        allowed_hosts=["loopback", *server.allowed_hosts],
    )
    serve_sidecar(sidecar, host=host, port=port, token=token, server=server)
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    """Add `serve` to the command line."""
    parser = commands.add_parser(
        "serve",
        help="run the sidecar: watch request lengths, decide the block size every interval",
        description=(
            "The blocktune sidecar: an HTTP service (POST /v1/observations, GET "
            "/v1/recommendation, POST /v1/decide, GET /v1/window, /metrics, /healthz, "
            "/readyz, /openapi.json) with the policy's sources (push, vLLM metrics, JSONL "
            "log) and its decision every policy interval. Mutating endpoints need the bearer "
            "token from the environment variable named by the policy's auth.token_env; "
            "without one only a loopback address is served. Token or not, a request whose "
            "Host is neither loopback nor an allowed host (server.allowed_hosts, "
            "--allowed-host) is refused with 421. The policy's server section also sets the "
            "state file and the connection limits: read_timeout, keep_alive and "
            "max_connections."
        ),
    )
    add_policy_argument(parser, "the deployment's candidates, interval, mode and server")
    parser.add_argument(
        "--host", default=None, help="address to bind (default: the policy's, 127.0.0.1)"
    )
    parser.add_argument(
        "--port", type=port_number, default=None, help="port (default: the policy's, 8787)"
    )
    parser.add_argument(
        "--state-file",
        default=None,
        metavar="PATH",
        help="where to save and restore the window and last decision (default: the policy's)",
    )
    add_allowed_hosts_argument(parser)
    parser.set_defaults(handler=run_serve)
