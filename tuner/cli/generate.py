"""`blocktune generate`: serve a file of token-id prompts on the paged engine."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from blocktune.tuner.cli._common import add_engine_arguments, load_model_from_args
from blocktune.tuner.core.defaults import DEFAULT_CANDIDATES

__all__ = ["read_prompts", "register"]


class PromptFileError(ValueError):
    """A prompts file that cannot be read; the message names the file and line."""


def read_prompts(path: Path) -> list[dict]:
    """Read `{"prompt_ids": [...], "max_tokens": n, ...}` lines (JSONL), validating each."""
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise PromptFileError(f"{path}: cannot read ({error.strerror})") from None
    requests = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise PromptFileError(f"{path}:{number}: invalid JSON ({error.msg})") from None
        if not isinstance(item, dict):
            raise PromptFileError(f"{path}:{number}: expected an object, got {type(item).__name__}")
        ids = item.get("prompt_ids")
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise PromptFileError(f"{path}:{number}: 'prompt_ids' must be a list of integers")
        max_tokens = item.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
            raise PromptFileError(f"{path}:{number}: 'max_tokens' must be an integer")
        unknown = set(item) - {"prompt_ids", "max_tokens", "temperature", "top_p", "seed"}
        if unknown:
            raise PromptFileError(f"{path}:{number}: unknown keys {sorted(unknown)}")
        requests.append({**item, "line": number})
    if not requests:
        raise PromptFileError(f"{path}: no prompts")
    return requests


def parse_swap(text: str) -> tuple[int, int]:
    """`STEP:BLOCK_SIZE` -> (step, block size)."""
    step, sep, size = text.partition(":")
    if not sep or not step.isdigit() or not size.isdigit():
        raise argparse.ArgumentTypeError(f"expected STEP:BLOCK_SIZE such as 5:32, got {text!r}")
    return int(step), int(size)


def run_generate(args: argparse.Namespace) -> int:
    """Generate completions for every prompt in the file and print them."""
    import torch

    from blocktune.runtime.engine import Engine, EngineConfig, RequestError, SamplingParams
    from blocktune.runtime.model import ModelLoadError

    try:
        requests = read_prompts(args.prompts)
        model, _ = load_model_from_args(args, device=args.device)
        engine = Engine(
            model,
            EngineConfig(
                block_size=args.block_size,
                num_blocks=args.num_blocks,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len,
                attention_backend=args.backend,
                candidate_block_sizes=tuple(
                    sorted({args.block_size, *DEFAULT_CANDIDATES} | {b for _, b in args.swap_at})
                ),
            ),
        )
    except (PromptFileError, ModelLoadError, ValueError) as error:
        print(f"blocktune generate: {error}", file=sys.stderr)
        return 2
    ids = []
    for request in requests:
        params = SamplingParams(
            max_tokens=request.get("max_tokens", 16),
            temperature=request.get("temperature", 0.0),
            top_p=request.get("top_p", 1.0),
            seed=request.get("seed"),
        )
        try:
            ids.append(engine.add_request(request["prompt_ids"], params))
        except RequestError as error:
            print(f"blocktune generate: {args.prompts}:{request['line']}: {error}", file=sys.stderr)
            return 2
    final = {}
    swaps = sorted(args.swap_at)
    tickets = []
    with torch.inference_mode():
        while engine.has_unfinished():
            while swaps and swaps[0][0] <= engine.steps:
                tickets.append(engine.request_block_size(swaps.pop(0)[1]))
            for output in engine.step():
                if output.finished:
                    final[output.request_id] = output
    outputs = [
        {
            "prompt_ids": request["prompt_ids"],
            "token_ids": final[i].token_ids,
            "finish_reason": final[i].finish_reason,
        }
        for request, i in zip(requests, ids, strict=True)
    ]
    swap_results = [t.result(0).to_dict() for t in tickets if t.done()]
    if args.json:
        report = {"outputs": outputs, "stats": engine.stats()}
        if args.swap_at:
            report["swaps"] = swap_results
        print(json.dumps(report))
    else:
        for number, output in enumerate(outputs):
            print(
                f"[{number}] {len(output['prompt_ids'])} prompt tokens -> "
                f"{output['token_ids']} ({output['finish_reason']})"
            )
        for swap in swap_results:
            print(
                f"swap {swap['old_block_size']} -> {swap['new_block_size']}: {swap['status']}, "
                f"{swap['bytes_moved']} bytes moved, pause {swap['pause_s'] * 1e3:.2f} ms"
                + (f" ({swap['reason']})" if swap["reason"] else "")
            )
        print("stats:", ", ".join(f"{k}={v}" for k, v in engine.stats().items()))
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    """Add `generate` to the command line."""
    parser = commands.add_parser(
        "generate",
        help="generate completions for token-id prompts on the paged engine",
        description=(
            "Serve a JSONL file of prompts on blocktune's continuous-batching engine. Each "
            'line: {"prompt_ids": [...], "max_tokens": n} (optional temperature, top_p, seed).'
        ),
    )
    add_engine_arguments(parser, max_num_seqs=32)
    parser.add_argument("--prompts", type=Path, required=True, help="JSONL file of prompts")
    parser.add_argument("--num-blocks", type=int, default=1024, help="KV pool size in blocks")
    parser.add_argument(
        "--swap-at",
        type=parse_swap,
        action="append",
        default=[],
        metavar="STEP:BLOCK_SIZE",
        help="change the block size before engine step STEP (repeatable), e.g. 5:32",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run_generate)
