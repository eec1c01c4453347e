"""The launch options of fp8kv's decode kernels: the one table of their names, what each takes, which
kernels and backends take it, and whether the bench CLI sets it and the launch table measures it.

Everything that lists these options derives the list from :data:`OPTIONS`: the options
``fp8kv.decode`` accepts per backend (``fp8kv.backends.LAUNCH_OPTIONS``), the ``--triton-opt`` keys of
``fp8kv bench`` (``fp8kv.bench.cli.TRITON_OPTIONS``), the keys of a launch-table entry
(``fp8kv.launch_table.LAUNCH_KEYS``), the options :func:`fp8kv.ops.paged_decode` takes, and those the
Gluon kernel takes when it is asked for (:func:`fp8kv.ops.gluon_refusal`). A new option is one row here,
plus the kernel and launcher that use it. Which values a Triton launch may take for ``num_warps`` and
``block_n`` lives here too (:data:`WARP_COUNTS`, :data:`MAX_BLOCK_N`), the one home that launch-table
entries and a caller's overrides are both checked against.

Plain Python: imported by ``fp8kv.backends`` (and so by ``import fp8kv``) without importing Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import checks
from .formats import UNQUANTIZED_DTYPES, is_fp8

__all__ = ["LaunchOption", "OPTIONS", "KERNELS", "WARP_COUNTS", "MAX_STAGES", "MAX_BLOCK_N", "check_range",
           "DOT_MIN_ROWS", "FP8_DOT_MIN_K", "least_block_n", "backend_options", "cli_options", "convert_refusal",
           "tuned_options", "kernel_options", "option_names"]

# The decode kernels of the Triton backend, by the names fp8kv.ops.decode_launch gives them.
KERNELS = ("triton", "triton-cuda-core", "gluon")
WARP_COUNTS = (1, 2, 4, 8, 16)  # the num_warps a Triton launch may ask for
MAX_STAGES = 8  # software-pipeline stages a Triton launch may ask for: each holds a tile in shared memory
MAX_BLOCK_N = 256  # tokens per tile, a power of two: a 256 x 256 tile already exceeds every GPU's registers


@dataclass(frozen=True)
class LaunchOption:
    """One launch option: its keyword ``name``, the ``kernels`` (of :data:`KERNELS`) that take it, the
    ``kind`` of value (``"int"``, ``"bool"``, ``"str"`` or ``"dtype"``), one line of ``help``, the
    ``fp8kv.decode`` ``backends`` that accept it, whether ``fp8kv bench --triton-opt KEY=INT`` sets it
    (``cli``) and whether a launch-table entry holds its measured value (``tuned``)."""
    name: str
    kernels: tuple[str, ...]
    kind: str
    help: str
    backends: tuple[str, ...] = ("triton",)
    cli: bool = False
    tuned: bool = False


_ALL = KERNELS
_TRITON = ("triton", "triton-cuda-core")
OPTIONS: tuple[LaunchOption, ...] = (
    LaunchOption("num_splits", _ALL, "int", "split-KV programs per sequence and KV head (default: by waves of SMs)",
                 cli=True),
    LaunchOption("block_n", _ALL, "int", "tokens per tile, a power of two (Gluon: 64 or 128)", cli=True, tuned=True),
    LaunchOption("num_warps", _ALL, "int",
                 f"warps per program, one of {WARP_COUNTS} (Gluon: 4)", cli=True,
                 tuned=True),
    LaunchOption("num_stages", _ALL, "int", f"software-pipeline stages, 1-{MAX_STAGES} (Gluon: its ring depth, 2-4)", cli=True,
                 tuned=True),
    LaunchOption("convert", _TRITON, "str", "how dequant mode converts FP8: 'software', 'cast', 'ptx' or 'K/V'"),
    LaunchOption("eviction_policy", _TRITON, "str", "cache hint of the K/V loads: '', 'evict_first' or 'evict_last'"),
    LaunchOption("out_dtype", _ALL, "dtype", "the output's dtype (default: the query's)"),
    LaunchOption("compute_dtype", _TRITON, "dtype", "16-bit type of the dequant-mode dots"),
    LaunchOption("use_tensor_cores", _TRITON, "bool", "False: the CUDA-core kernel (Triton); FlashInfer's "
                 "tensor-core or CUDA-core decode", backends=("triton", "flashinfer")),
    LaunchOption("heads_per_program", ("triton", "gluon"), "int", "at most this many query heads of a group per "
                 "program", cli=True),
    LaunchOption("gluon", _ALL, "bool", "the kernel: None picks, True the Gluon kernel, False the Triton kernel "
                 "(on the CLI 1 or 0)", cli=True),
)


def check_warps(value) -> int | None:
    """A num_warps option (None: the default) as an int of :data:`WARP_COUNTS`; TypeError / ValueError naming it."""
    return None if value is None else checks.one_of(checks.integer(value, "num_warps"), "num_warps", WARP_COUNTS)


def check_stages(value) -> int | None:
    """A num_stages option (None: the default) as an int from 1 to :data:`MAX_STAGES`."""
    if value is None:
        return None
    value = checks.integer(value, "num_stages")
    if not 1 <= value <= MAX_STAGES:
        checks.fail(f"num_stages={value}; expected 1 to {MAX_STAGES}")
    return value


DOT_MIN_ROWS = 16  # tl.dot's smallest tile side: a tensor-core kernel's smallest block_n
FP8_DOT_MIN_K = 32  # an FP8 dot's smallest K: fp8 mode's P·V contracts over block_n tokens


def least_block_n(mode: str, tensor_cores: bool = True) -> int:
    """The smallest block_n a decode or attend kernel takes in ``mode``: the FP8 dot's K in fp8 mode, tl.dot's 16
    on tensor cores, 1 on CUDA cores."""
    return FP8_DOT_MIN_K if mode == "fp8" else DOT_MIN_ROWS if tensor_cores else 1


def check_block_n(value, least: int = 1) -> int | None:
    """A block_n option (None: the default) as a power of two from ``least`` (a kernel's smallest tile: 16 for
    tl.dot) to :data:`MAX_BLOCK_N`."""
    if value is None:
        return None
    value = checks.integer(value, "block_n")
    if value < least or value > MAX_BLOCK_N or value & (value - 1):
        bound = f"up to {MAX_BLOCK_N}" if least == 1 else f"in [{least}, {MAX_BLOCK_N}]"
        checks.fail(f"block_n={value}; expected a power of two {bound}")
    return value


def check_range(name: str, value: int) -> int:
    """``value`` of the int option ``name`` if every kernel could take it (num_warps in :data:`WARP_COUNTS`,
    num_stages 1 to :data:`MAX_STAGES`, block_n a power of two up to :data:`MAX_BLOCK_N`; a kernel may ask more:
    the tensor-core ones a block_n of 16 or more); ValueError naming it otherwise. Where options enter as text
    (``fp8kv bench --triton-opt``), so that a dry run does not call ready what every run would refuse."""
    check = {"num_warps": check_warps, "num_stages": check_stages, "block_n": check_block_n}.get(name)
    return value if check is None else check(value)


def option_names() -> tuple[str, ...]:
    """Every option's name, in the table's order."""
    return tuple(o.name for o in OPTIONS)


def backend_options(backend: str) -> tuple[str, ...]:
    """The options ``fp8kv.decode`` accepts for ``backend`` (beyond q, cache, mode, sm_scale and the variants)."""
    return tuple(o.name for o in OPTIONS if backend in o.backends)


def cli_options() -> tuple[str, ...]:
    """The keys of ``fp8kv bench --triton-opt KEY=INT``."""
    return tuple(o.name for o in OPTIONS if o.cli)


def tuned_options() -> tuple[str, ...]:
    """The options a launch-table entry sets (measured per GPU by ``python -m fp8kv.bench.tune``)."""
    return tuple(o.name for o in OPTIONS if o.tuned)


def kernel_options(kernel: str) -> tuple[str, ...]:
    """The options ``kernel`` (one of :data:`KERNELS`) takes."""
    return tuple(o.name for o in OPTIONS if kernel in o.kernels)


def convert_refusal(kv_dtype: str, mode: str) -> str | None:
    """Why ``convert`` (how dequant mode turns FP8 codes into 16-bit values) does not apply to a decode of
    ``kv_dtype`` pages in ``mode``, or None where it does: the kernels refuse it there, and the benches skip it. A
    quantized format's kernel (:mod:`fp8kv.ops.quant_decode`) converts its codes itself: None."""
    if kv_dtype in UNQUANTIZED_DTYPES:
        return f"{kv_dtype} pages are read as they are"
    if mode == "fp8" and is_fp8(kv_dtype):
        return "mode='fp8' multiplies the FP8 tiles as they are"
    return None
