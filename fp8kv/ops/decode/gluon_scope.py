"""What the Gluon decode kernel (:mod:`.gluon_kernel`) covers and how it cuts a head, as plain facts: its
warps, tile widths, head dims and the query heads one program holds. Read by the kernel's layouts, its
launch (:mod:`.gluon_launcher`) and the choice of kernel (:mod:`.planning`); importing it needs no Gluon."""

from ...formats import is_fp8

__all__ = ["NUM_WARPS", "HEAD_PADS", "MIN_HEAD_DIM", "MAX_HEAD_DIM", "MAX_ROWS", "GLUON_GRANULARITIES",
           "GLUON_QUANTIZED_FORMATS", "PACKED_CODES", "PACKED_HEAD_DIM", "head_parts", "head_pad", "max_rows", "mma_rows",
           "reads_pages", "READS_PAGES"]

NUM_WARPS = 4
HEAD_PADS = (64, 128)  # register tile widths; a head_dim runs in the smallest that holds it
MIN_HEAD_DIM = 48  # the smallest head_dim its GPU tests cover
MAX_HEAD_DIM = 256  # two parts of 128
# MMA rows (query heads) one program holds at most, per tile width: a warp's fp32 output is rows x width,
# so 32 rows of 64 columns take the registers that 16 of 128 take (sm90: 168 a thread, no spills). Two
# parts hold the query twice as wide: 16 rows.
MAX_ROWS = {64: 32, 128: 16}
# The scales of FP8 pages it reads, and the quantized formats (fp8kv.kv_formats) whose codes it reads, with the codes
# each holds: INT8 and INT4 per token and head, one scale per token and head as FP8's per-token ones
GLUON_GRANULARITIES = ("tensor", "token_head")
GLUON_QUANTIZED_FORMATS = {"int8_token_head": "int8", "int4_token_head": "int4"}
# Codes two a byte (fp8kv.kv_formats.packing), and the head dims it reads of them: a multiple of 32, so that a head's
# row of codes is whole 16-byte chunks (the cp.async copies' unit)
PACKED_CODES = ("int4",)
PACKED_HEAD_DIM = 32
READS_PAGES = (f"FP8 pages with {GLUON_GRANULARITIES} scales and {tuple(GLUON_QUANTIZED_FORMATS)} (INT4 at head dims "
               f"that are multiples of {PACKED_HEAD_DIM})")  # what reads_pages says, in words


def reads_pages(kv_dtype: str, granularity: str, head_dim: int) -> bool:
    """Whether the kernel reads pages of ``kv_dtype`` with ``granularity`` scales at ``head_dim``, by these facts alone
    (:func:`fp8kv.ops.decode.planning.codes_refusal` checks a cache itself, its scales' strides too)."""
    if kv_dtype in GLUON_QUANTIZED_FORMATS:
        return not (GLUON_QUANTIZED_FORMATS[kv_dtype] in PACKED_CODES and head_dim % PACKED_HEAD_DIM)
    return is_fp8(kv_dtype) and granularity in GLUON_GRANULARITIES


def head_parts(head_dim: int) -> int:
    """Programs per (KV head, head tile): 1 up to 128 columns, 2 above (each takes 128 output columns)."""
    return 1 if head_dim <= max(HEAD_PADS) else 2


def head_pad(head_dim: int) -> int:
    """The tile width of one part of a head_dim (a multiple of 16, at most 256)."""
    return next(p for p in HEAD_PADS if head_dim <= p) if head_parts(head_dim) == 1 else max(HEAD_PADS)


def max_rows(head_dim: int) -> int:
    """The most MMA rows (query heads) one program holds at ``head_dim``."""
    return MAX_ROWS[head_pad(head_dim)] if head_parts(head_dim) == 1 else 16


def mma_rows(heads_per_program: int) -> int:
    """The MMA rows (ROWS) of a program of ``heads_per_program`` query heads: 16 or 32."""
    return 16 if heads_per_program <= 16 else 32
