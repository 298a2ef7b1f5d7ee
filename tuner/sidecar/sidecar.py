"""The sidecar: the tuning loop as a long-running service next to an inference worker.

`Sidecar` owns the loop; `build_sidecar` (in `assembly`) makes the parts it runs
from the policy. Its sources (pushed observations, a vLLM `/metrics`
scraper, a JSONL log follower, or the finished requests of an in-process
engine) fill the length window; its `DecisionScheduler` runs one decision
every policy interval: the selector decides against the block size the sidecar
knows to be in force (the engine's, the worker's, vLLM's `cache_config_info`);
in `mode: enforce` an actuator (a blocktune worker over HTTP, the in-process
engine, a vLLM server run as a child and restarted with the new size, or a
user's command; see `vllm_process` and `command_actuator`) applies a switch,
and the selector records the switch (`min_dwell` starts) only once the swap is
done. Without an actuator, or in `mode: recommend`, a switch is a
recommendation ("restart vLLM with --block-size 8"), logged once per change.
After every decision and at shutdown the window and the decision are saved to
the state file, and restored at the next start.

`create_sidecar_app` (in `blocktune.tuner.serving.sidecar_app`) serves a `Sidecar`
over HTTP; library use needs no HTTP at all::

    sidecar = build_sidecar(policy, engine=engine)  # from blocktune.tuner.sidecar.assembly
    sidecar.start()                                 # decide every policy.interval ...
    sidecar.decide()                                # ... or now
    sidecar.stop()
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

import numpy as np

from blocktune.kernels import is_power_of_two
from blocktune.tuner.config.calibration import Calibration, device_mismatch
from blocktune.tuner.config.engine_settings import engine_settings
from blocktune.tuner.config.jsonable import to_jsonable
from blocktune.tuner.config.policy import MAX_BLOCK_SIZE, Policy
from blocktune.tuner.core.selector import Decision, Selector
from blocktune.tuner.operations import log_event
from blocktune.tuner.sidecar.actuators import SWAP_STATUSES, Actuation, Actuator
from blocktune.tuner.sidecar.scheduler import DecisionScheduler
from blocktune.tuner.sidecar.sources import (
    Observations,
    PollingSource,
    SourceRunner,
    SourceStatus,
    parse_observations,
)
from blocktune.tuner.sidecar.state import SavedState, SavedWindow, StateFile
from blocktune.tuner.sidecar.stats import SidecarStats
from blocktune.tuner.sim.window import LengthWindow, WindowSnapshot

if TYPE_CHECKING:
    from blocktune.runtime.engine import Engine
    from blocktune.runtime.requests import FinishedRequest

__all__ = ["PushDisabled", "Sidecar"]

log = logging.getLogger("blocktune.sidecar")

MAX_WARNED_VALUES = 64
"""Distinct engine values (block sizes, backends, platforms) warned about once each; the
set of them stays this small whatever a server reports."""


class PushDisabled(ValueError):
    """Observations were pushed to a sidecar whose policy turns push off."""


class Sidecar:
    """Sources -> length window -> scheduled selector decision -> actuator, state on disk.

    It runs the parts it is given (`blocktune.tuner.sidecar.assembly.build_sidecar`
    makes them from the policy): the `actuator` that applies switches (with
    `restarts_engine`, each switch restarts the engine, and the median of the measured
    restarts prices the next ones), the polled `sources`, the in-process `engine` it
    listens to, the `state_file` it restores from and saves to.
    """

    def __init__(
        self,
        policy: Policy,
        calibration: Calibration,
        *,
        actuator: Actuator | None = None,
        restarts_engine: bool = False,
        sources: Sequence[PollingSource] = (),
        engine: Engine | None = None,
        state_file: StateFile | None = None,
    ) -> None:
        self.policy = policy
        self.calibration = calibration
        self.actuator = actuator
        self.sources = list(sources)
        self.engine = engine
        self.state_file = state_file
        self.window = LengthWindow(policy.window.capacity)
        self.selector = Selector(policy, calibration, clock=time.time)
        self.scheduler = DecisionScheduler(self._run_decision, policy.interval)
        self._restarting = restarts_engine
        self._runner = SourceRunner(self.sources)
        self.statuses = {s.name: s.status for s in self.sources}
        if policy.sources.push:
            self.statuses["push"] = SourceStatus("push")
        if engine is not None:
            self.statuses["engine"] = SourceStatus("engine")
        self._lock = threading.Lock()
        swaps = None if actuator is None else dict.fromkeys(SWAP_STATUSES, 0)
        self._stats = SidecarStats(swaps=swaps)
        self._warned: set[tuple[str, object]] = set()
        self._current = engine_settings(policy).block_size
        self._decision: Decision | None = None
        self._body: dict | None = None  # the last decision as JSON, less the live fields
        self._actuation: dict | None = None
        self._recommended: int | None = None
        self._logged_recommendation: int | None = None
        self._started = False
        self._stopped = False
        self._early = False  # whether the first decision at min_samples was asked for
        self._restore()
        if engine is not None:
            self._current = engine.block_size
            engine.add_listener(self._on_finished)

    def _measured_restart(self, seconds: float) -> None:
        """A restart took `seconds`: the decisions from now on pay back the median of the
        last few measured restarts instead of the policy's `restart`."""
        with self._lock:
            self._stats.restarts_s.append(seconds)
        cost = self._price_measured_restarts()
        log_event(log, "restart_cost_measured", restart_s=round(seconds, 3), cost_s=round(cost, 3))

    def _price_measured_restarts(self) -> float:
        """Decide from now on with the median of the measured restarts as the restart cost
        (the last switch's time kept for min_dwell); that median."""
        with self._lock:
            cost = statistics.median(self._stats.restarts_s)
        measured = self.policy.model_copy(update={"restart": timedelta(seconds=cost)})
        selector = Selector(measured, self.calibration, clock=time.time)
        if self.selector.last_switch is not None:
            selector.record_switch(self.selector.last_switch)
        self.selector = selector
        return cost

    # ------------------------------------------------------------------ properties
    @property
    def enforcing(self) -> bool:
        """True when switches are applied (mode: enforce with an actuator), not only advised."""
        return self.actuator is not None and self.policy.mode == "enforce"

    @property
    def current_block_size(self) -> int:
        with self._lock:
            return self._current

    @property
    def last_actuation(self) -> dict | None:
        with self._lock:
            return self._actuation

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        """Start deciding every policy interval and polling the sources."""
        if self._started:
            return
        self._started = True
        if self.actuator is not None:
            self.actuator.start()
        self._refresh_current()
        self.scheduler.start()
        self._runner.start()
        log_event(
            log,
            "sidecar_started",
            deployment=self.policy.deployment,
            mode=self.policy.mode,
            enforcing=self.enforcing,
            sources=sorted(self.statuses),
            block_size=self.current_block_size,
            interval_s=self.policy.interval.total_seconds(),
        )
        mismatch = device_mismatch(self.policy, self.calibration)
        if mismatch is not None:
            log_event(log, "calibration_for_another_device", warning=mismatch)

    def stop(self) -> None:
        """Stop the sources and the scheduler (a run in progress finishes), save, and close
        the actuator. An actuator that restarts the engine is closed first: it cuts a
        restart in progress short (minutes of a model load) and stops its server."""
        if self._stopped:
            return
        self._stopped = True
        self._runner.stop()
        if self._restarting:
            self.actuator.close()
        self.scheduler.stop(wait=True)
        self.save_state()
        if self.actuator is not None and not self._restarting:
            self.actuator.close()
        log_event(log, "sidecar_stopped", deployment=self.policy.deployment)

    # ------------------------------------------------------------------ observations
    def observe(self, batch: Observations) -> None:
        """Write a validated batch to the window (the sink of every source)."""
        self.window.observe_many(
            batch.prompt_tokens,
            batch.output_tokens,
            timestamps=batch.timestamps,
            prefix_groups=batch.prefix_groups,
        )
        with self._lock:
            self._stats.observations += len(batch)
        self._first_decision_when_ready()

    def _first_decision_when_ready(self) -> None:
        """Decide as soon as the window first holds `window.min_samples` requests (then every
        interval from then), rather than a whole interval after the start."""
        with self._lock:
            if self._early or self._body is not None:
                return
            if len(self.window) < self.policy.window.min_samples:
                return
            self._early = True
        self.scheduler.run_soon()

    def push(self, payload: object) -> int:
        """Validate a decoded `POST /v1/observations` body and observe it, all or nothing."""
        status = self.statuses.get("push")
        if status is None:
            raise PushDisabled("push is off in this policy (sources.push: false)")
        try:
            batch = parse_observations(payload, now=time.time())
        except ValueError as error:
            status.bad_items(1, str(error))
            raise
        self.observe(batch)
        status.succeeded(len(batch))
        return len(batch)

    def _on_finished(self, record: FinishedRequest) -> None:
        self.window.observe(record.prompt_tokens, record.output_tokens)
        with self._lock:
            self._stats.observations += 1
        self.statuses["engine"].succeeded(1)
        self._first_decision_when_ready()

    def report_block_size(self, block_size: int, source: str = "vllm_metrics") -> None:
        """The block size in use, as the vLLM metrics source reads it (cache_config_info)
        or as the actuator started or adopted its server (`source="actuator"`)."""
        if not (is_power_of_two(block_size) and block_size <= MAX_BLOCK_SIZE):
            problem = f"block_size {block_size} is not a power of two up to {MAX_BLOCK_SIZE}"
            if source in self.statuses:
                self.statuses[source].bad_items(1, f"cache_config_info {problem}")
            else:
                log_event(log, "block_size_unusable", source=source, problem=problem)
            return
        with self._lock:
            changed, self._current = self._current != block_size, block_size
        if changed:
            log_event(log, "block_size_in_use", block_size=block_size, source=source)
        if self.policy.engine == "vllm" and not self.policy.backend.accepts(block_size):
            self._mismatch(
                "block_size",
                block_size,
                f"vLLM runs block size {block_size}, which the policy's backend refuses "
                f"({self.policy.backend.rule()}): the policy names the wrong vllm_backend",
            )
        elif block_size not in self.policy.candidates:
            self._mismatch(
                "block_size",
                block_size,
                f"the engine runs block size {block_size}, which is not among the policy's "
                f"candidates {list(self.policy.candidates)}",
            )

    def report_engine(self, platform: str | None, backend: str | None) -> None:
        """The vLLM server's log names its platform or attention backend."""
        if backend is not None and backend != self.policy.vllm_backend:
            self._mismatch(
                "backend",
                backend,
                f"vLLM runs the {backend} attention backend, but the policy names "
                f"vllm_backend {self.policy.vllm_backend}: set it to {backend}, whose block "
                "sizes the candidates must fit",
            )
        if platform is not None:
            warning = device_mismatch(self.policy, self.calibration, engine_device=platform)
            if warning is not None:
                self._mismatch("device", platform, warning)

    def _mismatch(self, kind: str, value: object, warning: str) -> None:
        """Count a disagreement between the policy and the engine; log it once per value
        (the first `MAX_WARNED_VALUES` values; later ones are only counted)."""
        with self._lock:
            self._stats.engine_mismatches[kind] += 1
            first = (kind, value) not in self._warned and len(self._warned) < MAX_WARNED_VALUES
            if first:
                self._warned.add((kind, value))
        if first:
            log_event(log, "engine_mismatch", kind=kind, value=value, warning=warning)

    # ------------------------------------------------------------------ decisions
    def decide(self) -> Decision | None:
        """One decision run now: the decision, or None when the run failed."""
        return self.scheduler.run_now()

    def _refresh_current(self) -> int:
        if self.actuator is not None:
            size = self.actuator.block_size()
            if size is not None:
                with self._lock:
                    self._current = size
        with self._lock:
            return self._current

    def _run_decision(self) -> Decision:
        """Snapshot, decide against the size in force, apply (enforce mode), record, save.

        The selector records an applied switch before the state is saved, so a
        restart sees its time for min_dwell.
        """
        snapshot = self.window.snapshot()
        actuation: Actuation | None = None

        def apply(decision: Decision) -> int:
            nonlocal actuation
            if not self.enforcing:
                return decision.current_block_size
            actuation = self.actuator.apply(decision.block_size, decision.current_block_size)
            done = actuation.status == "done"
            return actuation.new_block_size if done else decision.current_block_size

        decision, in_force = self.selector.step(snapshot, self._refresh_current(), apply)
        recommended = decision.block_size if decision.switch else decision.current_block_size
        with self._lock:
            self._decision = decision
            self._stats.decisions[str(decision.switch).lower()] += 1
            if actuation is not None:
                self._actuation = actuation.to_dict()
                self._stats.swaps[actuation.status] += 1
                if actuation.status == "done":
                    self._current = in_force
            self._recommended = recommended
            current = self._current
            self._body = self._decision_body(decision, snapshot, recommended)
        if actuation is not None and actuation.status == "done" and self._restarting:
            self._measured_restart(actuation.pause_s)
        fields = {"block_size": decision.block_size, "current_block_size": current}
        if actuation is not None:
            fields.update(swap=actuation.status, swap_reason=actuation.reason)
        log_event(log, "decision", switch=decision.switch, reason=decision.reason, **fields)
        self._log_recommendation(recommended, current)
        self.save_state()
        return decision

    def _action(self, recommended: int, current: int) -> str | None:
        if recommended == current:
            return None
        if self.enforcing:
            return f"swap the block size to {recommended}"
        if self.policy.sources.vllm_metrics is not None:
            return f"restart vLLM with --block-size {recommended}"
        return f"set the block size to {recommended} (recommendation; no actuator applies it)"

    def _log_recommendation(self, recommended: int, current: int) -> None:
        if recommended == current:
            self._logged_recommendation = None
            return
        if recommended == self._logged_recommendation:
            return
        self._logged_recommendation = recommended
        log_event(
            log,
            "recommendation",
            block_size=recommended,
            current_block_size=current,
            action=self._action(recommended, current),
        )

    @staticmethod
    def _decision_body(decision: Decision, snapshot: WindowSnapshot, recommended: int) -> dict:
        """The decision's JSON; its `current_block_size` (the size it was decided against)
        becomes `decided_current_block_size`, since the live one is reported beside it."""
        body = decision.to_dict()
        body["decided_current_block_size"] = body.pop("current_block_size")
        body["recommended_block_size"] = recommended
        body["window"] = to_jsonable(snapshot.summary())
        return body

    # ------------------------------------------------------------------ reports
    def recommendation(self) -> dict:
        """The last decision with the live block size in force and the next run's time."""
        with self._lock:
            body = self._body
            current = self._current
            actuation = self._actuation
        job = self.scheduler.job
        next_run = None if job is None or job.next_run_time is None else job.next_run_time
        out = {
            "deployment": self.policy.deployment,
            "mode": self.policy.mode,
            "enforcing": self.enforcing,
            "current_block_size": current,
        }
        if body is None:
            out.update(block_size=None, switch=False, reason="no decision yet", candidates=[])
        else:
            out.update(body)
            recommended = body.get("recommended_block_size")
            out["action"] = None if recommended is None else self._action(recommended, current)
        out["next_run_at"] = None if next_run is None else next_run.timestamp()
        if self.actuator is not None:
            out["actuation"] = actuation
        return out

    def window_stats(self) -> dict:
        """The window now: capacity, counts, length statistics and histogram."""
        return to_jsonable({"capacity": self.window.capacity, **self.window.snapshot().summary()})

    def readiness(self) -> dict:
        """Ready when the scheduler runs, lengths can arrive (push or engine on, or every
        polled source's last poll succeeded) and, when enforcing, the actuator's target
        answers now (this asks it: a blocking call of up to a few seconds)."""
        scheduler = self.scheduler.running
        statuses = {name: status.to_dict() for name, status in self.statuses.items()}
        listening = self.policy.sources.push or self.engine is not None
        polled_ok = bool(self.sources) and all(s.status.last_ok for s in self.sources)
        out = {
            "ready": scheduler and (listening or polled_ok),
            "scheduler_running": scheduler,
            "sources": statuses,
        }
        if self.enforcing:
            answers = self.actuator.block_size() is not None
            last = self.last_actuation
            out["actuator"] = {
                "target": self.actuator.target,
                "answers": answers,
                "last_swap": None if last is None else last["status"],
                "last_reason": None if last is None else last["reason"],
            }
            out["ready"] = out["ready"] and answers
        return out

    def stats(self) -> SidecarStats:
        """The counts and the readings of now, for the Prometheus exposition (a copy)."""
        with self._lock:
            decision = self._decision
            stats = self._stats.copy(
                current_block_size=self._current,
                recommended_block_size=self._recommended,
                switch_cost_s=self.selector.policy.switch_cost_s,
            )
        candidates = () if decision is None else decision.candidates
        stats.padding_ratio = {c.block_size: c.padding_ratio for c in candidates}
        stats.window_requests = len(self.window)
        stats.decision_failures = self.scheduler.failures
        stats.source_errors = {name: s.errors for name, s in self.statuses.items()}
        stats.source_unobserved_polls = {
            name: s.unobserved_polls for name, s in self.statuses.items()
        }
        return stats

    # ------------------------------------------------------------------ state
    def save_state(self) -> None:
        """Write the window and the last decision to the state file (if one is set); a
        failure (a state too large to load back included: the last good file stays) is
        logged and counted (`state_save_failures`), never raised."""
        if self.state_file is None:
            return
        try:
            self.state_file.save(self._saved_state(), self.policy)
        except (OSError, ValueError) as error:
            with self._lock:
                self._stats.state_save_failures += 1
            log_event(log, "state_save_failed", file=str(self.state_file.path), error=str(error))

    def _saved_state(self) -> SavedState:
        snapshot = self.window.snapshot()
        with self._lock:
            return SavedState(
                saved_at=time.time(),
                deployment=self.policy.deployment,
                current_block_size=self._current,
                last_switch_at=self.selector.last_switch,
                recommended_block_size=self._recommended,
                window=SavedWindow(
                    timestamps=snapshot.timestamps.tolist(),
                    prompt_tokens=snapshot.prompt_tokens.tolist(),
                    output_tokens=snapshot.output_tokens.tolist(),
                    prefix_keys=snapshot.prefix_keys.tolist(),
                    has_prefix=snapshot.has_prefix.tolist(),
                    observed_total=snapshot.observed_total,
                ),
                recommendation=self._body,
                actuation=self._actuation,
                restarts_s=list(self._stats.restarts_s),
            )

    def _restore(self) -> None:
        if self.state_file is None:
            return
        saved = self.state_file.load(self.policy)
        if saved is None:
            return
        rows = saved.window
        groups = [k if h else None for k, h in zip(rows.prefix_keys, rows.has_prefix, strict=True)]
        self.window.observe_many(
            np.asarray(rows.prompt_tokens, dtype=np.int64),
            np.asarray(rows.output_tokens, dtype=np.int64),
            timestamps=rows.timestamps,
            prefix_groups=groups,
            earlier=rows.lifetime_total - len(rows.prompt_tokens),
        )
        self._current = saved.current_block_size
        self._recommended = saved.recommended_block_size
        self._body = saved.recommendation
        self._actuation = saved.actuation
        if saved.restarts_s and self._restarting:
            self._stats.restarts_s.extend(saved.restarts_s)
            self._price_measured_restarts()
        if saved.last_switch_at is not None:
            self.selector.record_switch(saved.last_switch_at)
        log_event(
            log,
            "state_restored",
            file=str(self.state_file.path),
            requests=len(rows.prompt_tokens),
            block_size=saved.current_block_size,
            saved_at=saved.saved_at,
            restart_cost_s=self.selector.policy.switch_cost_s if self._stats.restarts_s else None,
        )
