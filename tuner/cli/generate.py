"""`blocktune generate`: serve a file of text or token-id prompts on the paged engine."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from blocktune.tuner.cli.engine_args import (
    add_engine_arguments,
    engine_overrides,
    load_model_from_args,
)
from blocktune.tuner.config.defaults import DEFAULT_CANDIDATES

__all__ = ["register"]


def parse_swap(text: str) -> tuple[int, int]:
    """`STEP:BLOCK_SIZE` -> (step, block size)."""
    step, sep, size = text.partition(":")
    if not sep or not step.isdigit() or not size.isdigit():
        raise argparse.ArgumentTypeError(f"expected STEP:BLOCK_SIZE such as 5:32, got {text!r}")
    return int(step), int(size)


def run_generate(args: argparse.Namespace) -> int:
    """Generate completions for every prompt in the file and print them."""
    from blocktune.runtime.engine import Engine
    from blocktune.runtime.load_errors import ModelLoadError
    from blocktune.runtime.requests import RequestError
    from blocktune.runtime.sampling import SamplingParams
    from blocktune.tuner.cli.prompt_file import PromptFileError, read_prompts
    from blocktune.tuner.config.engine_settings import engine_settings

    try:
        lines = read_prompts(args.prompts)
        loaded = load_model_from_args(args)
        swaps = {b for _, b in args.swap_at}
        settings = engine_settings(
            None,
            candidates=(*DEFAULT_CANDIDATES, *swaps),
            num_blocks=args.num_blocks,
            **engine_overrides(args),
        )
        engine = Engine(loaded.model, settings.engine_config())
    except (PromptFileError, ModelLoadError, ValueError) as error:
        print(f"blocktune generate: {error}", file=sys.stderr)
        return 2
    ids = []
    for number, line in lines:
        params = SamplingParams(
            max_tokens=line.max_tokens,
            temperature=line.temperature,
            top_p=line.top_p,
            seed=line.seed,
        )
        try:
            ids.append(engine.add_request(line.token_ids(loaded.tokenizer), params))
        except (RequestError, ValueError) as error:
            print(f"blocktune generate: {args.prompts}:{number}: {error}", file=sys.stderr)
            return 2
    final, swaps = _serve(engine, args.swap_at)
    outputs = []
    for (_, line), request_id in zip(lines, ids, strict=True):
        output = final[request_id]
        if line.prompt_ids is not None:
            item = {"prompt_ids": line.prompt_ids}
        else:
            text = loaded.tokenizer.decode(output.token_ids, skip_special_tokens=True)
            item = {"prompt": line.prompt or line.messages[-1].text(), "text": text}
        outputs.append(
            {**item, "token_ids": output.token_ids, "finish_reason": output.finish_reason}
        )
    _print(args, outputs, swaps, engine.stats())
    return 0


def _serve(engine, swap_at: list[tuple[int, int]]) -> tuple[dict, list[dict]]:
    """Step the engine to the end, asking for each swap before its step; the final output
    of every request and the swaps' results."""
    import torch

    final, swaps, tickets = {}, sorted(swap_at), []
    with torch.inference_mode():
        while engine.has_unfinished():
            while swaps and swaps[0][0] <= engine.steps:
                tickets.append(engine.request_block_size(swaps.pop(0)[1]))
            for output in engine.step():
                if output.finished:
                    final[output.request_id] = output
    return final, [t.result(0).to_dict() for t in tickets if t.done()]


def _print(args: argparse.Namespace, outputs: list[dict], swaps: list[dict], stats: dict) -> None:
    if args.json:
        report = {"outputs": outputs, "stats": stats}
        if args.swap_at:
            report["swaps"] = swaps
        print(json.dumps(report))
        return
    for number, output in enumerate(outputs):
        if "text" in output:
            print(
                f"[{number}] {output['prompt']!r} -> {output['text']!r} ({output['finish_reason']})"
            )
        else:
            print(
                f"[{number}] {len(output['prompt_ids'])} prompt tokens -> "
                f"{output['token_ids']} ({output['finish_reason']})"
            )
    for swap in swaps:
        print(
            f"swap {swap['old_block_size']} -> {swap['new_block_size']}: {swap['status']}, "
            f"{swap['bytes_moved']} bytes moved, pause {swap['pause_s'] * 1e3:.2f} ms"
            + (f" ({swap['reason']})" if swap["reason"] else "")
        )
    print("stats:", ", ".join(f"{k}={v}" for k, v in stats.items()))


def register(commands: argparse._SubParsersAction) -> None:
    """Add `generate` to the command line."""
    parser = commands.add_parser(
        "generate",
        help="generate completions for text or token-id prompts on the paged engine",
        description=(
            "Serve a JSONL file of prompts on blocktune's continuous-batching engine. Each "
            'line: {"prompt": "text"} (encoded with the model\'s tokenizer), {"messages": '
            '[{"role": "user", "content": "..."}]} (in the model\'s chat template) or '
            '{"prompt_ids": [...]}, with optional max_tokens (default 16), temperature '
            "(default 0: greedy), top_p and seed. Text prompts print text. Generation stops "
            "at the model's EOS tokens or after max_tokens."
        ),
    )
    add_engine_arguments(parser, from_policy=False, max_num_seqs=32)
    parser.add_argument("--prompts", type=Path, required=True, help="JSONL file of prompts")
    parser.add_argument(
        "--num-blocks",
        type=int,
        default=1024,
        help="KV pool size in blocks of --block-size (default: %(default)s)",
    )
    parser.add_argument(
        "--swap-at",
        type=parse_swap,
        action="append",
        default=[],
        metavar="STEP:BLOCK_SIZE",
        help="change the block size before engine step STEP (repeatable), e.g. 5:32",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help='print one JSON object: {"outputs": [...], "stats": {...}} (and "swaps")',
    )
    parser.set_defaults(handler=run_generate)
