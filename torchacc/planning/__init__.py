"""Planning a run before launching it: per-rank memory (``estimate_memory``) and the best layout (``plan_layouts``,
the engine of ``torchacc plan``).

Everything here runs in one process on the CPU, under a fake process group, on models that hold no weights. The
modules, in the order a plan uses them: models (the model on the meta device), trace (one fake step), estimate
(``estimate_memory``), candidates (the layouts tried), scaling (from 3- and 4-block fake steps to the full depth),
costs (the step time), plan (``plan_layouts``), command (``torchacc plan``).
"""

from .candidates import AXES, Candidate, Choice, Cluster
from .costs import Hardware
from .estimate import MemoryEstimate, estimate_memory
from .plan import Plan, PlannedLayout, plan_layouts

__all__ = [
    "MemoryEstimate",
    "estimate_memory",
    "plan_layouts",
    "Plan",
    "PlannedLayout",
    "Cluster",
    "Hardware",
    "AXES",
    "Candidate",
    "Choice",
]
