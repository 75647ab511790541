"""Planning a run before launching it: per-rank memory (``estimate_memory``) and the best layout (``plan``).

Everything here runs in one process on the CPU, under a fake process group, on models that hold no weights.
"""

from .estimate import MemoryEstimate, estimate_memory

__all__ = ["MemoryEstimate", "estimate_memory"]
