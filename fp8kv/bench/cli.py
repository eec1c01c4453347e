"""``fp8kv bench`` / ``python -m fp8kv.bench``: the argument parser and :func:`main`; the named grids are
:mod:`.presets`'s."""

from __future__ import annotations

import argparse
import os
import re
import sys
import textwrap
from collections.abc import Sequence

import torch

from .. import checks
from ..cache import LAYOUTS
from ..capability import BACKEND_NAMES, KV_DTYPE_NAMES, MODES, interpreter_on, use_interpreter
from ..capability_formats import mode_refusal
from ..capacity import checked_memory_gib
from ..interrupts import signals_ignored, sigterm_as_keyboard_interrupt
from ..launch_options import OPTIONS, check_range, cli_options
from ..quant import GRANULARITIES
from ..results import save_or_fallback
from .attend import (
    ATTEND_PRESETS,
    attend_footprint,
    attend_run,
    attend_summary,
    attend_sweep,
)
from .cases import Q_DTYPES, Case, footprint_bytes, memory_budget, sweep
from .formats import QUANT_KV_DTYPES
from .measure import run
from .presets import PRESET_HELP, PRESETS
from .report import check_failed, preset_summary, save

# --------------------------------------------------------------------------------------------- CLI
# The --triton-opt keys, from the option table (fp8kv.launch_options): integers on the CLI, a switch 0 / 1 for
# a bool option (gluon=1: the Gluon kernel; gluon=0: the Triton kernel)
TRITON_OPTIONS = cli_options()
_SWITCHES = tuple(o.name for o in OPTIONS if o.cli and o.kind == "bool")
_OPTION_HELP = {o.name: o.help for o in OPTIONS}


def _heads(s: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+):(\d+)", s)
    if not m:
        raise argparse.ArgumentTypeError(f"{s!r}: expected Hq:Hkv such as 32:8")
    hq, hkv = int(m.group(1)), int(m.group(2))
    if hq < 1 or hkv < 1 or hq % hkv:
        raise argparse.ArgumentTypeError(f"{s!r}: expected positive Hq:Hkv with Hq a multiple of Hkv "
                                         "(grouped-query attention), such as 32:8")
    return hq, hkv


def _kv_opt(s: str) -> tuple[str, int]:
    m = re.fullmatch(rf"({'|'.join(TRITON_OPTIONS)})=(\d+)", s)
    if m and m.group(1) in _SWITCHES:  # a switch: gluon=1 the Gluon kernel, gluon=0 the Triton kernel
        key = m.group(1)
        if m.group(2) not in ("0", "1"):
            raise argparse.ArgumentTypeError(f"{s!r}: expected {key}=1 or {key}=0 ({_OPTION_HELP[key]})")
        return key, m.group(2) == "1"
    if not m or int(m.group(2)) < 1:
        raise argparse.ArgumentTypeError(f"{s!r}: expected KEY=INT with KEY in {', '.join(TRITON_OPTIONS)} "
                                         "and INT >= 1")
    try:
        return m.group(1), check_range(m.group(1), int(m.group(2)))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{s!r}: {e}") from None


def build_parser() -> argparse.ArgumentParser:
    """The ``fp8kv bench`` argument parser (errors: one line on stderr, exit status 2)."""
    width = max(map(len, PRESETS)) + 1
    presets = "\n".join(textwrap.fill(PRESET_HELP[name], 100, initial_indent=f"  {name:<{width}}",
                                       subsequent_indent=" " * (width + 2)) for name in PRESETS)
    p = checks.ArgumentParser(
        prog="fp8kv bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Time paged decode over a grid of cases; write results/bench/<gpu-slug>/<timestamp>.csv.",
        epilog=f"presets:\n{presets}\n\nExit status: 0 all ran and passed their checks, 1 a check failed, "
               "a case errored or --out could not be written (the rows then go to a temporary folder, named), "
               "2 bad arguments or nothing to run, 130 interrupted (SIGINT, SIGTERM, SIGHUP or another signal that would "
               "end it; the rows measured so far are saved).")
    p.add_argument("--preset", choices=sorted(PRESETS), help="a named grid (see below); grid options override it")
    p.add_argument("--batches", type=int, nargs="+", metavar="B", help="sequences per decode call")
    p.add_argument("--contexts", type=int, nargs="+", metavar="N", help="tokens per sequence")
    p.add_argument("--heads", type=_heads, nargs="+", metavar="HQ:HKV", help="query:KV head pairs (default 32:8)")
    p.add_argument("--head-dims", type=int, nargs="+", metavar="D", help="head dimension (default 128)")
    p.add_argument("--block-sizes", type=int, nargs="+", metavar="P", help="tokens per cache page (default 16)")
    p.add_argument("--page-layout", choices=LAYOUTS,
                   help="cache pages [blocks, block_size, Hkv, D] (NHD, the default) or [blocks, Hkv, block_size, D] (HND)")
    p.add_argument("--kv-dtypes", nargs="+", choices=(*KV_DTYPE_NAMES, *QUANT_KV_DTYPES),
                   help="cache element types, or quantized formats read by fp8kv's quantized-page kernel")
    p.add_argument("--modes", nargs="+", choices=MODES,
                   help="dequant: FP8 pages widened to the query's type; fp8: FP8 tensor-core dots")
    p.add_argument("--backends", nargs="+", choices=BACKEND_NAMES, help="decode implementations to time")
    p.add_argument("--granularities", nargs="+", choices=GRANULARITIES, help="FP8 scale granularities")
    p.add_argument("--q-dtype", choices=tuple(Q_DTYPES), help="query dtype (default: bf16 on a GPU, fp16 on CPU)")
    p.add_argument("--tensor-cores", choices=("both", "on", "off"), help="FlashInfer variants (default both)")
    p.add_argument("--triton-opt", type=_kv_opt, action="append", metavar="KEY=INT",
                   help="Triton launch override (repeatable, one key each), e.g. num_splits=8; KEY is one of: "
                        + "; ".join(f"{k}: {_OPTION_HELP[k]}" for k in TRITON_OPTIONS).replace("%", "%%"))
    counts = p.add_mutually_exclusive_group()
    counts.add_argument("--q-lens", type=int, nargs="+", metavar="N",
                        help="new tokens per sequence: time fp8kv.attend (speculative verification) instead of the "
                             "decode; --contexts then counts the cached tokens before them (0 allowed)")
    counts.add_argument("--chunks", type=int, nargs="+", metavar="N",
                        help="prefill chunk sizes: the same as --q-lens, named for chunked-prefill append")
    p.add_argument("--out", default="results/bench", help="results folder (a sub-folder per GPU)")
    p.add_argument("--no-save", action="store_true", help="print only")
    p.add_argument("--no-check", action="store_true", help="skip the comparison with the reference")
    p.add_argument("--no-rotate", action="store_true", help="time with the cache possibly L2-resident")
    p.add_argument("--rep", type=int, default=100, help=f"ms per case, 1-{checks.MAX_REP_MS} (CUDA; default 100)")
    p.add_argument("--memory-budget-gb", type=float, metavar="GIB",
                   help="skip cases needing more device memory, GiB (default 60%% of the free memory)")
    p.add_argument("--interpret", action="store_true",
                   help="CPU: run Triton under its interpreter (sets TRITON_INTERPRET=1; must precede importing "
                        "triton; implies --device cpu)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: the GPU if there is one, else the CPU)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--dry-run", action="store_true", help="list the cases and their status; run nothing")
    return p


def _check_args(args) -> torch.device:
    """Validate what argparse cannot (ranges, the device, the output folder); return the device.

    Raises ValueError / TypeError naming the flag and the value."""
    from ..device import resolve_device

    for flag in ("batches", "contexts", "head_dims", "block_sizes", "q_lens", "chunks"):
        for value in getattr(args, flag) or ():
            if flag == "contexts" and _attend(args):  # a prefill chunk may start a prompt: 0 cached tokens
                checks.integer(value, "--contexts", minimum=0)
            else:
                checks.positive_int(value, "--" + flag.replace("_", "-"))
    checks.rep_ms(args.rep, "--rep")
    if args.memory_budget_gb is not None:
        checked_memory_gib(args.memory_budget_gb, "--memory-budget-gb")
    if args.interpret and args.device not in (None, "cpu"):
        checks.fail(f"--interpret runs on CPU tensors; drop --device {args.device}")
    try:
        device = resolve_device("cpu" if args.interpret else args.device)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--device {args.device}: {exc}") from None
    if not args.no_save and not args.dry_run:
        checks.output_folder(args.out, "--out")
    return device


def preset_grid(name: str, device=None, **overrides) -> dict:
    """The :func:`sweep` arguments of preset ``name`` for ``device`` (None: this machine), with
    ``overrides`` applied. On a CPU the smoke presets' 16-bit cache is fp16: the Triton interpreter's
    bf16 arithmetic is wrong."""
    from ..device import resolve_device

    checks.one_of(name, "preset", tuple(PRESETS))
    grid = {**PRESETS[name], **overrides}
    if name in ("smoke", "layouts-smoke", "formats", "formats-smoke") and "kv_dtypes" not in overrides and resolve_device(device).type == "cpu":
        grid["kv_dtypes"] = ["fp16" if k == "bf16" else k for k in grid["kv_dtypes"]]
    return grid


def _attend(args) -> bool:
    """Whether the options ask for the multi-token benchmark (an attend preset, --q-lens or --chunks)."""
    return args.preset in ATTEND_PRESETS or args.q_lens is not None or args.chunks is not None


def _attend_grid_from_args(args, device: torch.device) -> dict:
    """The :func:`fp8kv.bench.attend.attend_sweep` arguments of parsed CLI options: an attend preset (default
    spec-verify's grid without its batches and contexts), overridden by the explicit options. On a CPU the
    presets' 16-bit cache is fp16, as the smoke presets' (the Triton interpreter's bf16 arithmetic is wrong)."""
    if args.preset and args.preset not in ATTEND_PRESETS:
        checks.fail(f"--preset {args.preset} is a decode grid; --q-lens / --chunks go with "
                    f"{', '.join(ATTEND_PRESETS)} or no preset")
    if args.tensor_cores:
        checks.fail(f"--tensor-cores {args.tensor_cores} picks FlashInfer's decode kernels; the attend runs its "
                    "prefill wrapper")
    grid = dict(ATTEND_PRESETS[args.preset]) if args.preset else \
        {**ATTEND_PRESETS["spec-verify"], "batches": None, "contexts": None}
    if device.type == "cpu":  # the interpreter's bf16 is wrong: the 16-bit cache pairs with fp16 queries there
        grid["kv_dtypes"] = ["fp16" if k == "bf16" else k for k in grid["kv_dtypes"]]
    for name in ("batches", "contexts", "block_sizes", "kv_dtypes", "modes", "backends", "granularities"):
        if getattr(args, name) is not None:
            grid[name] = getattr(args, name)
    if args.q_lens is not None or args.chunks is not None:
        grid["q_lens"] = args.q_lens if args.q_lens is not None else args.chunks
    formats = [kv for kv in grid["kv_dtypes"] if kv not in KV_DTYPE_NAMES]  # the attend's (AttendCase's) dtypes
    if formats:
        checks.fail(f"--kv-dtypes {' '.join(formats)}: the multi-token attention (--q-lens, --chunks) reads "
                    f"{', '.join(KV_DTYPE_NAMES)} pages; time quantized formats without --q-lens / --chunks")
    if (args.heads is None) != (args.head_dims is None):
        checks.fail("the attend grid sweeps whole head layouts; give both --heads and --head-dims to replace them, "
                    "or neither")
    if args.heads is not None:
        grid["shapes"] = [(hq, hkv, d) for hq, hkv in args.heads for d in args.head_dims]
    return _grid_tail(args, grid)


def _grid_from_args(args, device: torch.device) -> dict:
    """The :func:`sweep` arguments of parsed CLI options (a preset, overridden by explicit options) for
    the resolved ``device``. Raises ValueError when neither a preset nor batches and contexts are given."""
    if _attend(args):
        return _attend_grid_from_args(args, device)
    names = ("batches", "contexts", "heads", "head_dims", "block_sizes", "kv_dtypes", "modes", "backends",
             "granularities")
    given = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    grid = preset_grid(args.preset, device, **given) if args.preset else \
        {**PRESETS["target"], "batches": None, "contexts": None, **given}
    if "shapes" in grid and (args.heads is None) != (args.head_dims is None):
        checks.fail(f"--preset {args.preset} sweeps whole head layouts; give both --heads and --head-dims "
                    "to replace them, or neither")
    if args.heads is not None and args.head_dims is not None:
        grid.pop("shapes", None)  # explicit heads x head dims replace a preset's layouts
    if args.tensor_cores:
        grid["flashinfer_tensor_cores"] = {"both": [False, True], "on": [True], "off": [False]}[args.tensor_cores]
    return _grid_tail(args, grid)


def _grid_tail(args, grid: dict) -> dict:
    """What the decode's and the attend's grids take alike: batches and contexts required, the Triton options
    (each key once), the query dtype, the page layout and the memory budget."""
    if grid["batches"] is None or grid["contexts"] is None:
        checks.fail("give --preset, or --batches and --contexts")
    formats = [kv for kv in grid["kv_dtypes"] if kv in QUANT_KV_DTYPES] if args.granularities else []
    if formats:  # their cases would drop it (Case.granularity): a format's scales have a layout of their own
        checks.fail(f"--granularities {' '.join(args.granularities)}: the scale layout of FP8 pages; the quantized "
                    f"formats {' '.join(formats)} in the grid's KV dtypes store scales of their own layout, which "
                    "it does not change: drop --granularities, or give --kv-dtypes without them")
    for flag, given, backend in (("--triton-opt", args.triton_opt, "triton"), ("--tensor-cores", args.tensor_cores, "flashinfer")):
        if given and backend not in grid["backends"]:  # it would apply to no case
            checks.fail(f"{flag} applies to the {backend} backend only, and the grid's backends ({' '.join(grid['backends'])}) "
                        f"have none: add it to --backends, or drop {flag}")
    if args.triton_opt:
        seen = {}
        for key, value in args.triton_opt:  # dict() would keep the last of two values silently
            if key in seen:
                checks.fail(f"--triton-opt {key} is given twice ({key}={seen[key]}, {key}={value}); give each option "
                            "once (the options make one variant; fp8kv.bench.sweep(triton_options=[...]) times several)")
            seen[key] = value
        grid["triton_options"] = seen
    if args.q_dtype:
        grid["q_dtype"] = args.q_dtype
    if args.page_layout:
        grid["layout"] = args.page_layout
    if args.memory_budget_gb is not None:
        grid["memory_budget_bytes"] = int(args.memory_budget_gb * 2**30)
    return grid


def _name_the_interpret_flag(cases: list[Case]) -> None:
    """On a machine without a GPU, point the Triton rows' reason at the CLI flag (not the variable)."""
    if torch.cuda.is_available() or interpreter_on():
        return
    for c in cases:
        if c.backend == "triton" and c.status == "unsupported":
            c.reason = "no GPU: add --interpret to run the Triton kernels on CPU under the Triton interpreter"
        elif c.backend == "vllm" and c.status == "unsupported" and c.reason.endswith("TRITON_INTERPRET=1"):
            c.reason = "no GPU: add --interpret to run vLLM's Triton kernel on CPU under the Triton interpreter"


def _memory_refusal(cases: list[Case], budget: int, footprint=footprint_bytes) -> str | None:
    """The cases over the budget as one clause naming the flags that change it (None: all fit); ``footprint``: bytes."""
    from ..capacity import gib_text

    over = [c for c in cases if c.status == "skipped" and c.reason.startswith("does not fit")]
    if not over:
        return None
    least = min(over, key=footprint)
    sized = [("--batches", "batch"), ("--contexts", "context")] + [("--q-lens", "q_len")] * hasattr(least, "q_len") \
        + [("--block-sizes", "block_size")] * (least.block_size > least.context)  # pages longer than the sequence
    now = {f: " ".join(map(str, dict.fromkeys(getattr(c, a) for c in cases))) for f, a in sized}
    return (f"does not fit the memory budget of {gib_text(budget)} ({len(over)} of {len(cases)} cases; the least of "
            f"them, {' x '.join(f'{a} {getattr(least, a)}' for _, a in sized)}, needs ~{gib_text(footprint(least))}): pass smaller "
            + " or ".join(f"{flag} (now {v})" for flag, v in now.items()) + ", or a larger --memory-budget-gb")


def restart_interpreted(module: str) -> None:
    """``python -m <module> ... --interpret``: start the command again with TRITON_INTERPRET=1 set.

    Triton reads the variable once, when it is imported, and ``python -m fp8kv.bench...`` imports
    the package (and triton with it) before the command parses its options; so the flag can only
    take effect in a new process. Returns only when there is nothing to do."""
    if "--interpret" in sys.argv[1:] and not interpreter_on():
        env = dict(os.environ)
        use_interpreter(env)
        os.execve(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]], env)


def main(argv: Sequence[str] | None = None) -> int:
    """``fp8kv bench`` entry point; returns the exit status.

    0: every case that ran passed its check. 1: a check failed, a case errored, or ``--out`` could not be
    written (the rows are then saved under a temporary folder, named on stderr). 2: bad arguments,
    or nothing in the grid can run here (one line on stderr, as argparse reports errors; or, where the
    cases were refused only as they were launched, after the run's summary). 130:
    interrupted by SIGINT, SIGTERM, SIGHUP or another signal that would end it
    (:func:`fp8kv.interrupts.stop_signals`; the rows measured so far are saved, the rest marked skipped).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        device = _check_args(args)
        grid = _grid_from_args(args, device)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    if args.interpret and not interpreter_on():
        if "triton" in sys.modules:  # too late for this process (python -m fp8kv.bench restarts itself instead)
            parser.error("--interpret has to take effect before triton is imported: run `python -m fp8kv.bench "
                         "--interpret ...`, or set TRITON_INTERPRET=1 before starting Python")
        use_interpreter()
    attend = _attend(args)  # the multi-token benchmark (fp8kv.bench.attend): its own grid, rows and summary
    try:
        grid.setdefault("memory_budget_bytes", memory_budget(device))  # fixed now, so the refusal can name it
        cases = (attend_sweep if attend else sweep)(**grid, device=device)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    _name_the_interpret_flag(cases)
    ready = sum(c.status == "ready" for c in cases)
    if not cases:  # every combination dropped before a case was made (such as bf16 with only --modes fp8)
        why = dict.fromkeys(r for kv in grid["kv_dtypes"] for m in grid["modes"] if (r := mode_refusal(kv, m)))
        parser.error(f"the grid holds no case: no KV dtype of --kv-dtypes runs in a mode of --modes ({'; '.join(why)}); "
                     "widen them")
    if args.dry_run:
        for c in cases:
            print(f"{c.status:<11} {c.label:<40} B={c.batch:<4} ctx={c.context:<6} "
                  + (f"q_len={c.q_len:<5} " if attend else "") + f"Hq:Hkv={c.num_q_heads}:"
                  f"{c.num_kv_heads} D={c.head_dim} page={c.block_size} {c.layout}  {c.reason}")
        print(f"{ready} of {len(cases)} cases would run")
    memory = _memory_refusal(cases, grid["memory_budget_bytes"], attend_footprint if attend else footprint_bytes)
    if ready and memory:  # the run goes on without them: say which arguments would bring them in
        print(f"warning: {memory}", file=sys.stderr)
    if not ready:
        reasons = sorted({c.reason for c in cases if memory is None or not c.reason.startswith("does not fit")})
        parser.error(f"none of the {len(cases)} cases can run here: {'; '.join(([memory] if memory else []) + reasons)}")
    if args.dry_run:
        return 0
    with sigterm_as_keyboard_interrupt():
        df = (attend_run if attend else run)(cases, check=not args.no_check, rep=args.rep, progress=not args.quiet,
                                             rotate=not args.no_rotate, device=device, keep_partial=True)
        interrupted = df.attrs["bench"]["interrupted"]
        with signals_ignored():  # a signal now must not cut the save short
            print(attend_summary(df) if attend else preset_summary(df, args.preset))
            saved_where_asked = True
            if not args.no_save:
                path, saved_where_asked = save_or_fallback(save, df, args.out, {"argv": argv, "preset": args.preset})
                print(f"wrote {path}")
    if interrupted:
        print("interrupted: the rows above are what was measured; the rest are marked skipped", file=sys.stderr)
        return 130
    if not (df["status"] == "ok").any():  # each case refused only when launched (e.g. gluon=True outside its shapes)
        print(f"error: none of the {len(df)} cases ran here (see the reasons above)", file=sys.stderr)
        return 2
    bad = (df["status"] == "error") | df["check_passed"].map(check_failed)
    return 1 if bad.any() or not saved_where_asked else 0
