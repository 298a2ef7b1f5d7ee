"""A sidecar built from its policy: the actuator and the sources the policy names.

`build_sidecar` checks that the parts agree, makes the actuator of
`actuator.kind` (a row of `ACTUATORS`; an in-process engine is its own actuator)
and a polled source for each field of `sources` that is set (a row of
`SOURCES`), and hands them to the `Sidecar` that runs them. A new kind of
actuator or source is one row of its table.

The parts report to the sidecar (a scrape's observations and block size, the
platform and attention backend a vLLM server logs, the block size of the server an
actuator started or adopted) through `SidecarReports`, made before the sidecar they
report to and bound to it once it is built. The `vllm_process` actuator keeps its
record (the server it runs, the sizes vLLM refused) beside the state file
(`child_record`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from blocktune.tuner.config.calibration import Calibration, calibration_for
from blocktune.tuner.config.engine_settings import engine_settings
from blocktune.tuner.config.policy import ActuatorSettings, Policy
from blocktune.tuner.operations import token_from_env
from blocktune.tuner.sidecar.actuators import Actuator, EngineActuator, HttpActuator
from blocktune.tuner.sidecar.child_record import record_path
from blocktune.tuner.sidecar.command_actuator import CommandActuator
from blocktune.tuner.sidecar.jsonl_log import JsonlLogFollower
from blocktune.tuner.sidecar.sidecar import Sidecar
from blocktune.tuner.sidecar.sources import Observations, PollingSource
from blocktune.tuner.sidecar.state import StateFile
from blocktune.tuner.sidecar.vllm_metrics import VllmMetricsSource
from blocktune.tuner.sidecar.vllm_process import VllmProcessActuator

if TYPE_CHECKING:
    from blocktune.runtime.engine import Engine

__all__ = [
    "ACTUATORS",
    "SOURCES",
    "ActuatorKind",
    "Paths",
    "SidecarConfigError",
    "SidecarReports",
    "build_sidecar",
]


class SidecarConfigError(ValueError):
    """A sidecar set up with contradicting parts (the message says which)."""


class SidecarReports:
    """What the parts tell the sidecar, passed on to the sidecar `bind` names (the parts
    are made first, so that the sidecar is given them)."""

    def __init__(self) -> None:
        self._sidecar: Sidecar | None = None

    def bind(self, sidecar: Sidecar) -> None:
        self._sidecar = sidecar

    def observe(self, batch: Observations) -> None:
        self._sidecar.observe(batch)

    def block_size(self, block_size: int) -> None:
        self._sidecar.report_block_size(block_size)

    def started(self, block_size: int) -> None:
        self._sidecar.report_block_size(block_size, source="actuator")

    def engine(self, platform: str | None, backend: str | None) -> None:
        self._sidecar.report_engine(platform, backend)


@dataclass(frozen=True)
class Paths:
    """Where an actuator's files go: relative paths start at the policy's folder `base`;
    `state_file` is the sidecar's (None: it keeps none)."""

    base: Path
    state_file: Path | None = None


def _http(settings: ActuatorSettings, _policy: Policy, _reports: SidecarReports, _at: Paths):
    return HttpActuator(
        settings.url,
        token_from_env(settings.token_env),
        timeout_s=settings.timeout.total_seconds(),
        retries=settings.retries,
        backoff_s=settings.backoff.total_seconds(),
    )


def _vllm_process(settings: ActuatorSettings, policy: Policy, reports: SidecarReports, at: Paths):
    return VllmProcessActuator(
        settings.command,
        settings.url,
        initial_block_size=engine_settings(policy).block_size,
        drain_timeout_s=settings.drain_timeout.total_seconds(),
        start_timeout_s=settings.start_timeout.total_seconds(),
        stop_timeout_s=settings.stop_timeout.total_seconds(),
        log_file=None if settings.log_file is None else at.base / settings.log_file,
        on_engine_info=reports.engine,
        on_block_size=reports.started,
        record_file=None if at.state_file is None else record_path(at.state_file),
        refusal_ttl_s=settings.refusal_ttl.total_seconds(),
    )


def _command(settings: ActuatorSettings, _policy: Policy, _reports: SidecarReports, _at: Paths):
    return CommandActuator(
        settings.command,
        url=settings.url,
        timeout_s=settings.timeout.total_seconds(),
        start_timeout_s=settings.start_timeout.total_seconds(),
    )


@dataclass(frozen=True)
class ActuatorKind:
    """How one `actuator.kind` is made (from its settings, the policy, the reports and
    the paths), and whether its switches restart the engine (the measured restarts
    then price the next switches)."""

    build: Callable[[ActuatorSettings, Policy, SidecarReports, Paths], Actuator]
    restarts_engine: bool = False


ACTUATORS: dict[str, ActuatorKind] = {
    "http": ActuatorKind(_http),
    "vllm_process": ActuatorKind(_vllm_process, restarts_engine=True),
    "command": ActuatorKind(_command, restarts_engine=True),
}
"""Each `actuator.kind` but "none" (no actuator)."""

SourceFactory = Callable[[Any, SidecarReports, Path], PollingSource]
"""Makes a polled source from its `sources` settings, the reports and the policy's folder."""

SOURCES: dict[str, SourceFactory] = {
    "vllm_metrics": lambda settings, reports, _base: VllmMetricsSource(
        settings, reports.observe, reports.block_size
    ),
    "jsonl_log": lambda settings, reports, base: JsonlLogFollower(
        settings, reports.observe, base=base
    ),
}
"""Each polled source by its field of the policy's `sources` (push is the sidecar's own)."""


def build_sidecar(
    policy: Policy,
    *,
    engine: Engine | None = None,
    calibration: Calibration | None = None,
    state_file: Path | str | None = None,
    base_dir: Path | str = ".",
) -> Sidecar:
    """The sidecar of `policy`: listening to `engine` and applying switches to it when one is
    given, deciding with `calibration` (else the policy's, found from `base_dir`, the
    policy's folder, which relative paths in it start from too), keeping its state in
    `state_file` when one is given."""
    if engine is not None and policy.actuator.kind != "none":
        raise SidecarConfigError(
            "an in-process engine and actuator.kind "
            f"{policy.actuator.kind!r} both want to apply switches; use one of them"
        )
    base = Path(base_dir)
    calibration = calibration or calibration_for(policy, base)
    reports = SidecarReports()
    actuator, restarts_engine = None, False
    if engine is not None:
        actuator = EngineActuator(engine, timeout_s=policy.actuator.timeout.total_seconds())
    elif policy.actuator.kind != "none":
        kind = ACTUATORS[policy.actuator.kind]
        state = None if state_file is None else Path(state_file)
        actuator = kind.build(policy.actuator, policy, reports, Paths(base, state))
        restarts_engine = kind.restarts_engine
    sources = [
        make(settings, reports, base)
        for field, make in SOURCES.items()
        if (settings := getattr(policy.sources, field)) is not None
    ]
    sidecar = Sidecar(
        policy,
        calibration,
        actuator=actuator,
        restarts_engine=restarts_engine,
        sources=sources,
        engine=engine,
        state_file=None if state_file is None else StateFile(state_file),
    )
    reports.bind(sidecar)
    return sidecar
