"""Attention of several new tokens per sequence over the paged cache (speculative-decode verification,
chunked-prefill append): :func:`plan` an attention once (the launch, grid and constants: host work, reading
the new-token counts), :func:`run` the plan many times (device work only, CUDA-graph capturable), or
:func:`attend` for checks, plan and run in one call. :func:`fp8kv.reference.attend` is its oracle.

Modules: :mod:`.planning` (the launch and the plan), :mod:`.launcher` (the run and the checked call),
:mod:`.kernel` (the Triton kernel; the split combine and the helpers are the decode's).
"""

from .launcher import attend, run_attend
from .launcher import run_attend as run
from .planning import BLOCK_M_CHOICES, AttendConfig, AttendPlan, attend_launch, plan_attend
from .planning import plan_attend as plan

__all__ = ["attend", "plan", "run", "plan_attend", "run_attend", "attend_launch", "AttendPlan", "AttendConfig",
           "BLOCK_M_CHOICES"]
