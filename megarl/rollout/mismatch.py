"""Moved: the mismatch formulas are `megarl.algorithms.mismatch` (the check that runs them,
`megarl.stages.mismatch`). This module re-exports them for old imports and is removed in megarl 0.3."""

from megarl.algorithms.mismatch import REST_RESOLUTION, WORST, full_mismatch, topk_mismatch

__all__ = ["REST_RESOLUTION", "WORST", "full_mismatch", "topk_mismatch"]
