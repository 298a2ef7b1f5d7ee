"""The simulated server: KV pool size and engine step time per block size, from the calibration.

One engine step generates one token for every running request. Its time, in
seconds, with L layers and the calibrated coefficients of `CostModel.kernel(B)`
(already scaled to the policy's K/V bytes per token and layer):

    step_s = W / bw + L * launch_B                       weights read once, kernel launches
           + L * per_block_B * sum_j ceil(ctx_j / B)      block-table translation
           + L * per_token_B * sum_j ctx_j                K/V bytes read
           + host_B * n                                   BlockManager work per token
           + prefill_tokens * 2 N / flops                 prompts computed in this step

with W the weight bytes, N the parameters, bw the memory bandwidth and flops
the matmul throughput of the calibration, ctx_j the tokens request j holds, n
the running requests. The pool holds `CostModel.capacity_slots(B)` token slots
in whole blocks, as the engine sizes it from the KV budget.

A calibration with an engine section (`blocktune calibrate --engine`) has
these coefficients measured, and two more that the derived model leaves at 0
(`calibration.STEP_FORM`): the batch padded to its longest context (a decode
attention that gathers the batch into one padded tensor, as the torch backend
does), the prompt's attention pairs (quadratic in a prompt's length) and a cost
per prompt chunk (each admitted request). Whole engine steps of the policy's
model are timed on the device and fitted jointly across block sizes; they
replace the derived coefficients, and their spread (`step_spread`) is sampled
per step by the simulator. `step_scale` multiplies every step's time (how far a
prediction moves when the steps cost more, see `tuner.fidelity.validation`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from blocktune.tuner.config.calibration import Calibration, StepCoefficients
from blocktune.tuner.config.policy import Policy
from blocktune.tuner.sim.cost_model import CostModel

__all__ = ["StepCostModel"]


@dataclass(frozen=True)
class StepCostModel:
    """The pool and step costs of a deployment (`policy`) on a device (`calibration`).

    `fixed_step_s` replaces the calibrated step time by a constant (every other
    term zero), to compare with a stepped replay such as `blocktune demo`;
    `sample_spread` False prices every step at its fitted time (no factor drawn from
    the calibration's `step_spread`).
    """

    policy: Policy
    calibration: Calibration
    fixed_step_s: float | None = None
    step_scale: float = 1.0
    sample_spread: bool = True

    def __post_init__(self) -> None:
        if self.fixed_step_s is not None and not self.fixed_step_s > 0:
            raise ValueError(f"fixed_step_s must be a positive number, got {self.fixed_step_s}")
        if not self.step_scale > 0:
            raise ValueError(f"step_scale must be a positive number, got {self.step_scale}")
        if self.calibration.engine is not None:
            self.calibration.engine.require_model(self.policy.model)

    @cached_property
    def cost_model(self) -> CostModel:
        return CostModel(self.policy, self.calibration)

    @property
    def kv_bytes_per_slot(self) -> int:
        """Bytes of K and V of one token across all layers."""
        return self.policy.model.kv_bytes_per_token

    def capacity_slots(self, block_size: int) -> int:
        """Token slots of the KV budget in whole blocks of `block_size`."""
        return self.cost_model.capacity_slots(block_size)

    def num_blocks(self, block_size: int) -> int:
        """Blocks of `block_size` tokens in the KV budget."""
        return self.capacity_slots(block_size) // block_size

    def step_cost(self, block_size: int) -> StepCoefficients:
        """The step-time coefficients at `block_size` (see the module docstring) [s], times
        `step_scale`."""
        coefficients = self._step_cost(block_size)
        return coefficients if self.step_scale == 1 else coefficients.scaled(self.step_scale)

    def _step_cost(self, block_size: int) -> StepCoefficients:
        if self.fixed_step_s is not None:
            return StepCoefficients(
                fixed_s=self.fixed_step_s,
                per_block_s=0.0,
                per_token_s=0.0,
                per_sequence_s=0.0,
                prefill_s_per_token=0.0,
            )
        if self.calibration.engine is not None:
            self.calibration.require([block_size])
            return self.calibration.engine.steps[block_size]
        costs = self.cost_model
        kernel = costs.kernel(block_size)
        layers = self.policy.model.num_layers
        return StepCoefficients(
            fixed_s=costs.weights_read_s + layers * kernel.launch_s,
            per_block_s=layers * kernel.per_block_s,
            per_token_s=layers * kernel.per_token_s,
            per_sequence_s=self.calibration.host_s_per_token[block_size],
            prefill_s_per_token=costs.prefill_s_per_token,
        )

    @property
    def step_spread(self) -> tuple[float, ...]:
        """Quantiles of measured / fitted step time (mean 1), of which the simulator draws one
        per step as a factor: the engine calibration's, none for a derived or fixed step or
        without `sample_spread`."""
        engine = self.calibration.engine
        if self.fixed_step_s is not None or engine is None or not self.sample_spread:
            return ()
        return engine.step_spread

    def swap_pause_s(self, bytes_moved: int = 0) -> float:
        """Modelled pause of a block-size change, priced as the selector prices it."""
        return self.cost_model.switch_cost_s(bytes_moved)
