"""The serving mode: aggregated (no prefill pool) or disaggregated, chosen by the GPUs each needs.

Aggregated serving is a prefill pool of 0: the frontend finds no prefill worker and each decode
worker computes its own prompts in its decode steps. Which mode needs fewer GPUs depends on the
load: short prompts with long outputs stretch a decode worker's steps little, so one pool serves
them with fewer GPUs than two; long prompts with short outputs would slow every decode behind
their chunks, so a prefill pool of its own is cheaper. The core sizes both (planner/sizing.py) at
each decision and hands this chooser their GPUs; with `--planner-mode auto` it keeps or switches
the mode by one rule:

- The first decision with requests to size takes the cheaper mode; a tie goes to the mode that
  needs fewer GPUs at the load times (1 + hysteresis), the one with room to spare for the GPUs both
  need now (a tie there too: disaggregated).
- After that the other mode wins a decision when it needs fewer GPUs at the planned load times
  (1 + hysteresis) than the mode in force needs at the planned load: the scale-down margin of the
  pools (PlannerConfig.hysteresis), so that a load sitting where the two cost the same keeps its
  mode. The mode switches when the other has won `mode_switch_intervals` decisions in a row
  (default 3: one more than the decisions a new worker's start-up spans at the defaults, so the
  saving has outlasted what a switch takes to carry out); any decision it does not win starts the
  count again. A single interval's swing never switches.

The switch itself is the pools' ordinary resizing (planner/core.py): to aggregated, the decode
pool grows to its aggregated size at once and the prefill pool drains to 0 once those decode
workers are ready; to disaggregated, the prefill pool grows at once and the decode pool shrinks
after its down delay. Draining workers finish what they hold: no request is cut.

Plain state and integers: it knows nothing of how either mode is sized.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.decision import ModeDecision, ModeReason
from runtime.config_planner import ServingMode


@dataclass(frozen=True, slots=True)
class ModeCosts:
    """GPUs each mode needs at the planned load, and at that load times (1 + hysteresis)."""
    disaggregated: int
    aggregated: int
    disaggregated_margin: int
    aggregated_margin: int

    def at_load(self, mode: ServingMode) -> int:
        return self.aggregated if mode is ServingMode.AGGREGATED else self.disaggregated

    def with_margin(self, mode: ServingMode) -> int:
        return self.aggregated_margin if mode is ServingMode.AGGREGATED else self.disaggregated_margin


def other(mode: ServingMode) -> ServingMode:
    return ServingMode.DISAGGREGATED if mode is ServingMode.AGGREGATED else ServingMode.AGGREGATED


class ModeChooser:
    """The mode in force and the count of decisions the other has won in a row."""

    def __init__(self, configured: ServingMode, switch_intervals: int) -> None:
        assert switch_intervals >= 1
        self.configured = configured
        self.switch_intervals = switch_intervals
        self.mode: ServingMode | None = None if configured is ServingMode.AUTO else configured
        self.streak = 0

    @property
    def current(self) -> ServingMode:
        """The mode the pools are sized for now (auto before its first choice: disaggregated)."""
        return self.mode or ServingMode.DISAGGREGATED

    def choose(self, costs: ModeCosts) -> ModeDecision:
        """One decision's mode, from the GPUs each mode needs at this decision."""
        def decision(reason: ModeReason) -> ModeDecision:
            return ModeDecision(self.current, reason, costs.disaggregated, costs.aggregated, self.streak)

        if self.configured is not ServingMode.AUTO:
            return decision(ModeReason.FIXED)
        if self.mode is None:
            agg, disagg = costs.aggregated, costs.disaggregated
            if agg == disagg:           # a tie at the load: the mode with room to spare at the margin
                agg, disagg = costs.aggregated_margin, costs.disaggregated_margin
            self.mode = ServingMode.AGGREGATED if agg < disagg else ServingMode.DISAGGREGATED
            return decision(ModeReason.FIRST)
        challenger = other(self.mode)
        won = costs.with_margin(challenger) < costs.at_load(self.mode)
        self.streak = self.streak + 1 if won else 0
        if self.streak < self.switch_intervals:
            return decision(ModeReason.HOLD)
        self.mode, self.streak = challenger, 0
        return decision(ModeReason.SWITCH)

    def hold(self) -> ModeDecision:
        """A decision with nothing to size: the mode stays as it is."""
        return ModeDecision(self.current, ModeReason.FIXED if self.configured is not ServingMode.AUTO
                            else ModeReason.NO_DATA, streak=self.streak)
