"""`blocktune worker`: serve the paged engine over HTTP, optionally reporting to a sidecar."""

from __future__ import annotations

import argparse
import sys
import threading

from blocktune.runtime.defaults import DEFAULT_GATHER_S, GATHER_LIMIT_S
from blocktune.tuner.cli.arguments import non_negative_float
from blocktune.tuner.cli.engine_args import (
    add_engine_arguments,
    engine_overrides,
    load_model_from_args,
)
from blocktune.tuner.cli.host_args import (
    PortUnavailable,
    add_allowed_hosts_argument,
    check_port_free,
    port_number,
)
from blocktune.tuner.cli.measure_args import set_threads
from blocktune.tuner.config.defaults import DEFAULT_TOKEN_ENV

__all__ = ["register"]

READY_POLL_S = 0.05  # how often the worker tries its own address until it answers


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


def config_from_args(args: argparse.Namespace):
    """The `WorkerConfig` of the flags and `--policy` (flags win). Raises `ConfigError`, or
    ValueError for an engine configuration the engine refuses."""
    from blocktune.tuner.config.policy import load_policy
    from blocktune.tuner.config.worker_config import worker_config

    return worker_config(
        load_policy(args.policy) if args.policy else None,
        token_env=args.token_env,
        allowed_hosts=args.allowed_hosts,
        kv_bytes=args.kv_bytes,
        candidates=args.candidates,
        **engine_overrides(args),
    )


def run_worker(args: argparse.Namespace) -> int:
    """Load the model, start the engine loop and serve until SIGINT/SIGTERM."""
    import logging

    from blocktune.runtime.engine import Engine
    from blocktune.runtime.engine_loop import EngineLoop
    from blocktune.runtime.load_errors import ModelLoadError
    from blocktune.tuner.operations import token_from_env
    from blocktune.tuner.serving.http import InsecureBind, check_bind
    from blocktune.tuner.serving.worker_app import LengthPusher, serve_worker

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        config = config_from_args(args)
    except ValueError as error:  # ConfigError among them
        print(f"blocktune worker: {error}", file=sys.stderr)
        return 2
    token = token_from_env(config.token_env)
    try:
        check_bind(args.host, token)
        check_port_free(args.host, args.port)
        set_threads(args.threads)
        loaded = load_model_from_args(args)
        _check_pool_holds_a_block(args, config.engine, loaded.model)
        engine = Engine(loaded.model, config.engine)
    except (InsecureBind, PortUnavailable, ModelLoadError, ValueError) as error:
        print(f"blocktune worker: {error}", file=sys.stderr)
        return 2
    if args.huge_pages and loaded.model.device.type == "cpu":
        _use_huge_pages(engine)
    loop = EngineLoop(engine, gather_s=args.gather_ms / 1000)
    pusher = None
    if args.sidecar:
        pusher = LengthPusher(args.sidecar, token_from_env(args.sidecar_token_env))
        engine.add_listener(pusher.observe)
        pusher.start()
    stopped = threading.Event()
    _announce_when_listening(args.host, args.port, _ready_line(args, engine), stopped)
    try:
        serve_worker(
            loop,
            model_name=args.served_model_name or args.model,
            tokenizer=loaded.tokenizer,
            host=args.host,
            port=args.port,
            token=token,
            pusher=pusher,
            server=config.server,
        )
    finally:
        stopped.set()
    return 0


def _check_pool_holds_a_block(args: argparse.Namespace, engine_config, model) -> None:
    """Raise ValueError, naming the flag or policy field that sized it, where the KV pool
    holds not one block of the largest candidate (the engine's pool is whole such blocks)."""
    from pydantic import ByteSize

    from blocktune.runtime.kv_cache import kv_bytes

    mc = model.config
    per_token = kv_bytes(mc.num_layers, mc.num_kv_heads, mc.head_dim, model.dtype.itemsize, 1)
    largest = max(engine_config.candidate_block_sizes)
    block = per_token * largest
    if engine_config.kv_bytes >= block:
        return
    budget = ByteSize(engine_config.kv_bytes).human_readable()
    if args.kv_bytes is not None:
        given = f"--kv-bytes {budget}"
    elif args.policy:
        given = f"the policy's kv_budget {budget}"
    else:
        given = f"the default KV pool {budget}"
    raise ValueError(
        f"{given} holds no block: one token needs {per_token} bytes, one block of {largest} "
        f"tokens (the largest candidate) {block} ({ByteSize(block).human_readable()})"
    )


def _ready_line(args: argparse.Namespace, engine) -> str:
    """The line that tells an operator the worker serves: where, what, and the one
    max_model_len the API states (`Engine.max_request_tokens`) with what sets it."""
    host = f"[{args.host}]" if ":" in args.host else args.host
    asked = engine.config.max_model_len
    if args.max_model_len is None:
        asked_by, of_asked = "the model's positions", f"the model's {asked} positions"
    else:
        asked_by, of_asked = "--max-model-len", f"--max-model-len {asked}"
    pool = engine.kv.num_slots
    if engine.max_request_tokens < asked:
        limit = (
            f"max_model_len {engine.max_request_tokens}: {of_asked}, but the KV pool holds "
            f"{pool} tokens"
        )
    else:
        limit = f"max_model_len {asked} ({asked_by}), a KV pool of {pool} tokens"
    return (
        f"blocktune worker ready: http://{host}:{args.port} (model "
        f"{args.served_model_name or args.model}, block size {engine.block_size}, {limit})"
    )


def _announce_when_listening(
    host: str, port: int, line: str, stopped: threading.Event
) -> threading.Thread:
    """Log `line` once `host:port` accepts a connection (uvicorn listens only once it can
    answer), unless `stopped` is set first."""
    import logging
    import socket

    def announce() -> None:
        while not stopped.wait(READY_POLL_S):
            try:
                socket.create_connection((host, port), timeout=READY_POLL_S).close()
            except OSError:
                continue
            logging.getLogger("blocktune.worker").info(line)
            return

    thread = threading.Thread(target=announce, name="ready-announcer", daemon=True)
    thread.start()
    return thread


def _use_huge_pages(engine) -> None:
    """Pack the weights and fault the KV pool in, then move both into huge pages; log what
    moved."""
    import logging

    from blocktune.runtime.huge_pages import collapse_resident_memory

    engine.model.pack_weights()
    engine.kv.fault_in()
    collapsed = collapse_resident_memory()
    log = logging.getLogger("blocktune.worker")
    log.info("%d MiB of weights and KV pool in 2 MiB pages", collapsed.bytes >> 20)
    if collapsed.refused_bytes or collapsed.reason:
        log.info(
            "huge pages refused for %d MiB: %s", collapsed.refused_bytes >> 20, collapsed.reason
        )


def register(commands: argparse._SubParsersAction) -> None:
    """Add `worker` to the command line."""
    parser = commands.add_parser(
        "worker",
        help="serve completions on the paged engine, with live block-size swaps",
        description=(
            "An HTTP worker around blocktune's continuous-batching engine with an "
            "OpenAI-compatible API: GET /v1/models, POST /v1/completions and "
            "/v1/chat/completions (streaming with stream: true); POST /admin/block-size "
            "(bearer token), GET /admin/state, /metrics (Prometheus: vLLM's metric names "
            "and blocktune's own), /health (as vLLM answers it) and /healthz. With "
            "--sidecar, finished request lengths are pushed to a blocktune sidecar. "
            "docs/serving.md lists what the API accepts."
        ),
    )
    add_engine_arguments(parser, from_policy=True)
    _add_policy_arguments(parser)
    _add_serving_arguments(parser)
    parser.set_defaults(handler=run_worker)


def _add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    """--policy and the flags that replace its settings: candidates, pool, token, hosts."""
    from blocktune.tuner.config.defaults import DEFAULT_CANDIDATES, DEFAULT_KV_BYTES

    parser.add_argument(
        "--policy",
        default=None,
        help="a deployment policy: its engine settings (kv_budget, server.initial_block_size, "
        "candidates and the batch section: those the sidecar simulates) and auth.token_env "
        "are the defaults here, and its server section's read_timeout, keep_alive, "
        "max_connections and allowed_hosts apply",
    )
    add_allowed_hosts_argument(parser)
    parser.add_argument(
        "--candidates",
        type=int,
        nargs="+",
        default=None,
        metavar="B",
        help="block sizes a swap may choose; kernels for all are compiled at start "
        f"(default: the policy's, else {' '.join(map(str, DEFAULT_CANDIDATES))})",
    )
    parser.add_argument(
        "--kv-bytes",
        type=parse_bytes,
        default=None,
        help="KV pool size, e.g. 64MiB or 1GiB (default: the policy's kv_budget, else "
        f"{DEFAULT_KV_BYTES >> 20}MiB)",
    )
    parser.add_argument(
        "--token-env",
        default=None,
        help="environment variable holding the admin bearer token "
        f"(default: the policy's auth.token_env, else {DEFAULT_TOKEN_ENV})",
    )


def _add_serving_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the worker listens, what it calls its model, its threads and its sidecar."""
    parser.add_argument(
        "--huge-pages",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on a CPU, once loaded, move the weights and the KV pool into 2 MiB pages "
        "(Linux 6.1+; fewer page-table walks per step, a few seconds at start; default: on)",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model's id in the API, which requests' model field must match "
        "(default: the --model value)",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: %(default)s)"
    )
    parser.add_argument(
        "--port", type=port_number, default=8000, help="port (default: %(default)s)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="torch intra-op threads of the model step (default: torch's choice, one per "
        "physical core, or OMP_NUM_THREADS)",
    )
    parser.add_argument(
        "--gather-ms",
        type=non_negative_float,
        default=DEFAULT_GATHER_S * 1000,
        metavar="MS",
        help="when requests reach an idle engine, start its first step once none has arrived "
        f"for this long (at most {GATHER_LIMIT_S * 1000:g} ms), so that a burst is prefilled "
        "in one step: a shorter time to first token for bursts, but requests then tend to "
        "arrive in waves; 0 starts at once (default: %(default)g)",
    )
    parser.add_argument("--sidecar", default=None, help="sidecar URL to push lengths to")
    parser.add_argument(
        "--sidecar-token-env",
        default=DEFAULT_TOKEN_ENV,
        help="environment variable holding the sidecar's bearer token (default: %(default)s)",
    )
