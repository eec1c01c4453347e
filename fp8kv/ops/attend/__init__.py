"""Attention of several new tokens per sequence over the paged cache (speculative-decode verification,
chunked-prefill append): :func:`attend` validates, picks the launch (:func:`attend_launch`) and runs
:mod:`.kernel`; :func:`fp8kv.reference.attend` is its oracle."""

from .launcher import BLOCK_M_CHOICES, MODES, AttendConfig, attend, attend_launch

__all__ = ["attend", "attend_launch", "AttendConfig", "MODES", "BLOCK_M_CHOICES"]
