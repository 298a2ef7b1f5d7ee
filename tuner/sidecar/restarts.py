"""What both restart actuators share (`vllm_process`, `command_actuator`).

vLLM fixes its block size at start-up, so a switch is a restart. Both actuators
replace `{block_size}` in their command with the size to start, and both fall
back to the size that was running when the new one does not come up. The time
from the stop to a healthy server with the new size is the switch's `pause_s`:
what the restart cost, which the sidecar feeds back into the cost the decision
pays back against.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client.parser import text_string_to_metric_families

from blocktune.tuner.config.policy import BLOCK_SIZE_PLACEHOLDER
from blocktune.tuner.sidecar.vllm_output import exception_message

__all__ = ["HEALTH_POLL_S", "fill_block_size", "reason_from", "requests_in_flight"]

HEALTH_POLL_S = 0.2
IN_FLIGHT = ("vllm:num_requests_running", "vllm:num_requests_waiting")
MAX_REASON_LINE = 300


def fill_block_size(command: Sequence[str], block_size: int) -> list[str]:
    """The command with every `{block_size}` replaced by the size."""
    return [part.replace(BLOCK_SIZE_PLACEHOLDER, str(block_size)) for part in command]


def requests_in_flight(exposition: str) -> int:
    """Running plus waiting requests in a vLLM `/metrics` text (all engines summed)."""
    total = 0.0
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name in IN_FLIGHT:
                total += sample.value
    return int(round(total))


def reason_from(error: str, output: Sequence[str]) -> str:
    """`error` with the first exception the server's output shows at a traceback's end (its
    root cause; `vllm_output` says which lines count), else its last line."""
    for line in output:
        if (exception := exception_message(line)) is not None:
            return f"{error}: {exception[:MAX_REASON_LINE]}"
    return f"{error}; its last output: {output[-1].strip()[:MAX_REASON_LINE]}" if output else error
