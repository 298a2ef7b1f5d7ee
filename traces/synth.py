"""Seeded synthetic workloads: a customer-service day, the embedded default workload.

The day is a set of phases, each a Poisson arrival process over a window of
the day with its own length distributions (times in hours of a 24-hour day;
`duration_s` compresses or stretches the timeline, `rate_scale` multiplies
every rate). A phase's rate can follow the daily cycle: proportional to
1 + a*cos(2*pi*(h - peak_h)/24), scaled so its mean over the window is
`rate_per_s`. The default day (`CUSTOMER_SERVICE_PHASES`):

- ``night``    00:00-08:00 and 23:00-24:00, quiet: the daytime mix at a low rate;
- ``day``      08:00-20:00, the daytime mix, peaking at 14:00: prompts 60-90 tokens;
- ``promo``    20:00-23:00, the night promotion burst: very short queries
  (15-25 tokens) at three times the daytime rate;
- ``document`` 08:00-20:00, document-style requests (a question about one of
  a few reference texts): a shared 256-token prefix plus a 30-54 token
  question, 450-520 tokens in total with the answer.

Document requests carry ``prefix_group`` (which reference text) and
``prefix_hashes`` (one hash for the shared 256-token block, see
`blocktune.traces.schema`); every other request has no group and no hashes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from blocktune.traces.schema import PREFIX_BLOCK_TOKENS

__all__ = [
    "CUSTOMER_SERVICE_PHASES",
    "DAY_S",
    "Phase",
    "WorkloadError",
    "customer_service_day",
]

DAY_S = 86_400.0
_HOUR_S = 3600.0


class WorkloadError(ValueError):
    """A synthetic workload parameter that cannot be used; the message names it."""


@dataclass(frozen=True)
class Phase:
    """One arrival process of the day: a window, a rate and uniform length ranges (inclusive).

    Give either `output_tokens` or `total_tokens` (prompt + output, the output
    being the rest). `diurnal` is the amplitude a in [0, 1] of the daily rate
    cycle peaking at `peak_h` (0: a constant rate). With `shared_prefix_tokens`
    > 0 every prompt starts with one of `prefix_groups` shared prefixes of that
    length (a multiple of `PREFIX_BLOCK_TOKENS`), chosen uniformly.
    """

    name: str
    start_h: float
    end_h: float
    rate_per_s: float
    prompt_tokens: tuple[int, int]
    output_tokens: tuple[int, int] | None
    total_tokens: tuple[int, int] | None = None
    diurnal: float = 0.0
    peak_h: float = 14.0
    shared_prefix_tokens: int = 0
    prefix_groups: int = 0

    def __post_init__(self) -> None:
        problems = []
        if not 0 <= self.start_h < self.end_h <= 24:
            problems.append(f"window {self.start_h}-{self.end_h} h is not inside 0-24 h")
        if not (math.isfinite(self.rate_per_s) and self.rate_per_s >= 0):
            problems.append(f"rate_per_s {self.rate_per_s} is not a rate >= 0")
        if not 0 <= self.diurnal <= 1:
            problems.append(f"diurnal {self.diurnal} is not in [0, 1]")
        if (self.output_tokens is None) == (self.total_tokens is None):
            problems.append("give exactly one of output_tokens and total_tokens")
        for field, bounds in (
            ("prompt_tokens", self.prompt_tokens),
            ("output_tokens", self.output_tokens),
            ("total_tokens", self.total_tokens),
        ):
            if bounds is not None and not 1 <= bounds[0] <= bounds[1]:
                problems.append(f"{field} {bounds} is not a range 1 <= low <= high")
        if self.total_tokens and self.total_tokens[0] <= self.prompt_tokens[1]:
            problems.append(
                f"total_tokens {self.total_tokens} leaves no output after prompts up to "
                f"{self.prompt_tokens[1]}"
            )
        if self.shared_prefix_tokens:
            if self.shared_prefix_tokens % PREFIX_BLOCK_TOKENS:
                problems.append(
                    f"shared_prefix_tokens {self.shared_prefix_tokens} is not a multiple of "
                    f"{PREFIX_BLOCK_TOKENS}"
                )
            if self.shared_prefix_tokens >= self.prompt_tokens[0]:
                problems.append(
                    f"shared_prefix_tokens {self.shared_prefix_tokens} leaves no question in "
                    f"prompts from {self.prompt_tokens[0]} tokens"
                )
            if self.prefix_groups < 1:
                problems.append("prefix_groups must be >= 1 with a shared prefix")
        if problems:
            raise WorkloadError(f"phase {self.name!r}: " + "; ".join(problems))

    def rate_factor(self, hours: np.ndarray) -> np.ndarray:
        """The daily cycle at `hours`, relative to the mean rate over the window."""
        cycle = 1 + self.diurnal * np.cos(2 * np.pi * (hours - self.peak_h) / 24)
        return cycle / self._mean_cycle()

    def max_rate_factor(self) -> float:
        """The largest `rate_factor` over the window: at its ends or at the daily peak."""
        peaks = [self.peak_h + 24 * k for k in (-1, 0, 1)]
        hours = [self.start_h, self.end_h, *(h for h in peaks if self.start_h < h < self.end_h)]
        return float(self.rate_factor(np.asarray(hours)).max())

    def _mean_cycle(self) -> float:
        def integral(h: float) -> float:
            return h + self.diurnal * 24 / (2 * np.pi) * np.sin(2 * np.pi * (h - self.peak_h) / 24)

        return (integral(self.end_h) - integral(self.start_h)) / (self.end_h - self.start_h)


CUSTOMER_SERVICE_PHASES: tuple[Phase, ...] = (
    Phase("night", 0.0, 8.0, 0.3, (60, 90), (20, 60), diurnal=0.5),
    Phase("day", 8.0, 20.0, 2.0, (60, 90), (20, 60), diurnal=0.5),
    Phase(
        "document",
        8.0,
        20.0,
        0.05,
        (286, 310),
        None,
        total_tokens=(450, 520),
        diurnal=0.5,
        shared_prefix_tokens=256,
        prefix_groups=8,
    ),
    Phase("promo", 20.0, 23.0, 6.0, (15, 25), (8, 24)),
    Phase("night", 23.0, 24.0, 0.3, (60, 90), (20, 60), diurnal=0.5),
)


def customer_service_day(
    seed: int = 0,
    *,
    duration_s: float = DAY_S,
    rate_scale: float = 1.0,
    phases: tuple[Phase, ...] = CUSTOMER_SERVICE_PHASES,
) -> pd.DataFrame:
    """A day of customer-service requests, sorted by arrival.

    Columns: ``arrival_s`` (float, seconds from 0 to `duration_s`),
    ``prompt_tokens``, ``output_tokens`` (int64 >= 1), ``phase`` (the phase
    that produced the request), ``prefix_group`` (str or None) and
    ``prefix_hashes`` (list of ints). Each phase draws about
    ``rate_per_s * rate_scale * window seconds of a real day`` requests,
    whatever `duration_s`. The same seed and arguments always give the same table.
    """
    if not (math.isfinite(duration_s) and duration_s > 0):
        raise WorkloadError(f"duration_s must be a positive number of seconds, got {duration_s}")
    if not (math.isfinite(rate_scale) and rate_scale > 0):
        raise WorkloadError(f"rate_scale must be a positive number, got {rate_scale}")
    rng = np.random.default_rng(seed)
    group_hashes = rng.integers(1, 2**62, size=sum(p.prefix_groups for p in phases))
    frames, first_group = [], 0
    for phase in phases:
        frames.append(_phase_requests(phase, rng, rate_scale, first_group))
        first_group += phase.prefix_groups
    day = pd.concat(frames, ignore_index=True).sort_values("arrival_s", kind="stable")
    groups = day.pop("_group").tolist()
    day["arrival_s"] *= duration_s / DAY_S
    labels = [f"doc-{g}" if g >= 0 else None for g in groups]
    day["prefix_group"] = pd.Series(labels, index=day.index, dtype=object)
    hashes = [[int(group_hashes[g])] if g >= 0 else [] for g in groups]
    day["prefix_hashes"] = pd.Series(hashes, index=day.index, dtype=object)
    return day.reset_index(drop=True)


def _phase_requests(
    phase: Phase, rng: np.random.Generator, rate_scale: float, first_group: int
) -> pd.DataFrame:
    """One phase's requests on the 24-hour timeline (seconds), by thinning the peak rate."""
    factor_max = phase.max_rate_factor()
    window_s = (phase.end_h - phase.start_h) * _HOUR_S
    candidates = rng.poisson(phase.rate_per_s * rate_scale * factor_max * window_s)
    hours = rng.uniform(phase.start_h, phase.end_h, candidates)
    hours = hours[rng.uniform(0, factor_max, candidates) < phase.rate_factor(hours)]
    count = len(hours)
    prompts = rng.integers(*phase.prompt_tokens, count, endpoint=True)
    if phase.total_tokens is None:
        outputs = rng.integers(*phase.output_tokens, count, endpoint=True)
    else:
        outputs = rng.integers(*phase.total_tokens, count, endpoint=True) - prompts
    groups = (
        rng.integers(first_group, first_group + phase.prefix_groups, count)
        if phase.shared_prefix_tokens
        else np.full(count, -1)
    )
    return pd.DataFrame(
        {
            "arrival_s": hours * _HOUR_S,
            "prompt_tokens": prompts.astype(np.int64),
            "output_tokens": outputs.astype(np.int64),
            "phase": phase.name,
            "_group": groups,
        }
    )
