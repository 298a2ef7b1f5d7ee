"""Seeded synthetic workloads: a customer-service day.

The day is a sequence of phases, each a Poisson arrival process with its own
length distributions (times in seconds of a 24-hour day; `duration_s`
compresses or stretches the timeline, `rate_scale` multiplies every rate):

- ``day``    08:00-20:00, the daytime mix: prompts around 60-90 tokens;
- ``promo``  20:00-23:00, the night promotion burst: very short queries
  (15-25 tokens) at a much higher rate;
- ``night``  23:00-08:00, quiet: the daytime mix at a low rate;
- ``document`` 08:00-20:00, a few long document-style requests,
  450-520 tokens in total.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

__all__ = ["DAY_S", "Phase", "customer_service_day", "CUSTOMER_SERVICE_PHASES"]

DAY_S = 86_400.0


@dataclass(frozen=True)
class Phase:
    """One arrival process of the day: a window, a rate and uniform length ranges (inclusive)."""

    name: str
    start_h: float
    end_h: float
    rate_per_s: float
    prompt_tokens: tuple[int, int]
    output_tokens: tuple[int, int]


CUSTOMER_SERVICE_PHASES: tuple[Phase, ...] = (
    Phase("night", 0.0, 8.0, 0.3, (60, 90), (20, 60)),
    Phase("day", 8.0, 20.0, 2.0, (60, 90), (20, 60)),
    Phase("document", 8.0, 20.0, 0.05, (400, 460), (50, 60)),
    Phase("promo", 20.0, 23.0, 6.0, (15, 25), (8, 24)),
    Phase("night", 23.0, 24.0, 0.3, (60, 90), (20, 60)),
)


def customer_service_day(
    seed: int = 0,
    *,
    duration_s: float = DAY_S,
    rate_scale: float = 1.0,
    phases: tuple[Phase, ...] = CUSTOMER_SERVICE_PHASES,
) -> pd.DataFrame:
    """A day of customer-service requests, sorted by arrival.

    Columns: ``arrival_s`` (float, from 0), ``prompt_tokens``, ``output_tokens``
    (int >= 1) and ``phase`` (the phase that produced the request). The same
    seed and arguments always give the same table.
    """
    if duration_s <= 0 or rate_scale <= 0:
        raise ValueError(
            f"duration_s and rate_scale must be positive, got {duration_s}, {rate_scale}"
        )
    rng = np.random.default_rng(seed)
    time_scale = duration_s / DAY_S
    frames = []
    for phase in phases:
        start, end = phase.start_h * 3600 * time_scale, phase.end_h * 3600 * time_scale
        count = rng.poisson(phase.rate_per_s * rate_scale * (phase.end_h - phase.start_h) * 3600)
        frames.append(
            pd.DataFrame(
                {
                    "arrival_s": rng.uniform(start, end, count),
                    "prompt_tokens": rng.integers(*phase.prompt_tokens, count, endpoint=True),
                    "output_tokens": rng.integers(*phase.output_tokens, count, endpoint=True),
                    "phase": phase.name,
                }
            )
        )
    day = pd.concat(frames, ignore_index=True)
    return day.sort_values("arrival_s", kind="stable", ignore_index=True)
