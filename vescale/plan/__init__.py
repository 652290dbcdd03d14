"""The plan path: a plain single-device model + placements for a few tensors -> every node
placed by a global cost-based choice over the joint forward+backward graph, explained."""

from vescale.plan.api import PlanError, PlannedModule, parallelize
from vescale.plan.batch import Batch
from vescale.plan.cost import AlphaBeta, calibrate
from vescale.plan.explain import Explanation, explain

__all__ = [
    "AlphaBeta",
    "Batch",
    "Explanation",
    "PlanError",
    "PlannedModule",
    "calibrate",
    "explain",
    "parallelize",
]
