"""`blocktune worker`: serve the paged engine over HTTP, optionally reporting to a sidecar."""

from __future__ import annotations

import argparse
import sys

from blocktune.tuner.cli._common import (
    add_engine_arguments,
    engine_config_from_args,
    load_model_from_args,
    set_threads,
)
from blocktune.tuner.core.defaults import DEFAULT_CANDIDATES, DEFAULT_TOKEN_ENV

__all__ = ["register"]


def parse_bytes(text: str) -> int:
    """`64MiB`, `1GiB`, `500MB` or a plain byte count (pydantic's ByteSize rules)."""
    from pydantic import ByteSize, TypeAdapter, ValidationError

    try:
        value = TypeAdapter(ByteSize).validate_python(text)
    except ValidationError:
        raise argparse.ArgumentTypeError(f"expected a size such as 64MiB, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return int(value)


def candidates_and_token_env(args: argparse.Namespace) -> tuple[list[int], str]:
    """Flags first, then the policy's candidates and auth.token_env, then the defaults."""
    candidates, token_env = args.candidates, args.token_env
    if args.policy is not None:
        from blocktune.tuner.core.policy import load_policy

        policy = load_policy(args.policy)
        candidates = candidates or list(policy.candidates)
        token_env = token_env or policy.auth.token_env
    return candidates or list(DEFAULT_CANDIDATES), token_env or DEFAULT_TOKEN_ENV


def run_worker(args: argparse.Namespace) -> int:
    """Load the model, start the engine loop and serve until SIGINT/SIGTERM."""
    import logging

    from blocktune.runtime.engine import Engine
    from blocktune.runtime.engine_loop import EngineLoop
    from blocktune.runtime.model import ModelLoadError
    from blocktune.tuner.core.config_files import ConfigError
    from blocktune.tuner.core.policy import ServerSettings, load_policy
    from blocktune.tuner.operations import token_from_env
    from blocktune.tuner.serving.http import InsecureBind, check_bind
    from blocktune.tuner.serving.worker_app import LengthPusher, serve_worker

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        candidates, token_env = candidates_and_token_env(args)
        server = load_policy(args.policy).server if args.policy else ServerSettings()
    except ConfigError as error:
        print(f"blocktune worker: {error}", file=sys.stderr)
        return 2
    token = token_from_env(token_env)
    try:
        check_bind(args.host, token)
        set_threads(args.threads)
        loaded = load_model_from_args(args)
        config = engine_config_from_args(args, candidates, kv_bytes=args.kv_bytes)
        engine = Engine(loaded.model, config)
    except (InsecureBind, ModelLoadError, ValueError) as error:
        print(f"blocktune worker: {error}", file=sys.stderr)
        return 2
    logging.getLogger("blocktune.worker").info(
        "serving %s: at most %d tokens a request (max_model_len %d, a KV pool of %d tokens)",
        args.served_model_name or args.model,
        engine.max_request_tokens,
        engine.config.max_model_len,
        engine.kv.num_slots,
    )
    loop = EngineLoop(engine)
    pusher = None
    if args.sidecar:
        pusher = LengthPusher(args.sidecar, token_from_env(args.sidecar_token_env))
        engine.add_listener(pusher.observe)
        pusher.start()
    serve_worker(
        loop,
        model_name=args.served_model_name or args.model,
        tokenizer=loaded.tokenizer,
        host=args.host,
        port=args.port,
        token=token,
        pusher=pusher,
        server=server,
    )
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    """Add `worker` to the command line."""
    parser = commands.add_parser(
        "worker",
        help="serve completions on the paged engine, with live block-size swaps",
        description=(
            "An HTTP worker around blocktune's continuous-batching engine with an "
            "OpenAI-compatible API: GET /v1/models, POST /v1/completions and "
            "/v1/chat/completions (streaming with stream: true); POST /admin/block-size "
            "(bearer token), GET /admin/state, /metrics (Prometheus) and /healthz. With "
            "--sidecar, finished request lengths are pushed to a blocktune sidecar."
        ),
    )
    add_engine_arguments(parser, max_num_seqs=64)
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model's id in the API, which requests' model field must match "
        "(default: the --model value)",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: %(default)s)"
    )
    parser.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    parser.add_argument(
        "--policy",
        default=None,
        help="a deployment policy: its candidates and auth.token_env are the defaults here, "
        "and its server section's read_timeout, keep_alive and max_connections apply",
    )
    parser.add_argument(
        "--candidates",
        type=int,
        nargs="+",
        default=None,
        metavar="B",
        help="block sizes a swap may choose; kernels for all are compiled at start "
        "(default: the policy's, else 8 16 32 64 128)",
    )
    parser.add_argument(
        "--kv-bytes",
        type=parse_bytes,
        default=64 * 2**20,
        help="KV pool size, e.g. 64MiB or 1GiB (default: 64MiB)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="torch intra-op threads of the model step (default: torch's choice, one per "
        "physical core, or OMP_NUM_THREADS)",
    )
    parser.add_argument("--sidecar", default=None, help="sidecar URL to push lengths to")
    parser.add_argument(
        "--token-env",
        default=None,
        help="environment variable holding the admin bearer token "
        "(default: the policy's auth.token_env, else BLOCKTUNE_TOKEN)",
    )
    parser.add_argument(
        "--sidecar-token-env",
        default=DEFAULT_TOKEN_ENV,
        help="environment variable holding the sidecar's bearer token (default: %(default)s)",
    )
    parser.set_defaults(handler=run_worker)
