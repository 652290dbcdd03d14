"""The cost model (:mod:`vescale.cost.model`) and its calibration on the actual machine
(:mod:`vescale.cost.calibration`): one set of constants for the plan path's solver, the
``schedule.json`` timeline and the benchmarks."""

from vescale.cost.calibration import calibrate
from vescale.cost.model import CommStep, CostModel, default_cost_model

__all__ = ["CommStep", "CostModel", "calibrate", "default_cost_model"]
