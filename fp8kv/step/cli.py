"""``fp8kv step`` / ``python -m fp8kv.step``: the argument parser and :func:`main`."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence

from .. import checks
from ..cache import check_block_size
from ..capability import interpreter_on, use_interpreter
from ..capacity import (
    GPUS,
    MAX_MEMORY_GIB,
    MAX_MODEL_LEN,
    MODEL_SHAPES,
    CapacityError,
    get_gpu,
    get_model,
    gib_text,
)
from ..device import resolve_device
from ..interrupts import signals_ignored, stop_signals_as_keyboard_interrupt
from ..results import save_or_fallback
from .measure import check_host_memory, check_weights, save, sweep
from .model import STEP_BACKENDS
from .multi_report import prefill_summary, verify_summary
from .plan import checked_kv_dtypes, plan_sweep
from .prefill import prefill_sweep
from .quantized import STEP_KV_DTYPES, check_one_token, step_kv_dtype
from .report import summary
from .speculative import check_drafts_fit, draft_len_arg, verify_sweep

# Where each kind of run saves its rows by default (their columns differ: one folder each).
OUT_DIRS = {"decode": "results/step", "verify": "results/step-verify", "prefill": "results/step-prefill"}


# ---------------------------------------------------------------------------------------------- CLI
def _gpu_memory_arg(s: str):
    try:
        v = float(s)
    except ValueError:
        try:
            get_gpu(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not a known GPU; expected a number of GiB or one of "
                                             f"{sorted(GPUS)}") from None
        return s
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"{s!r}: expected a positive number of GiB or a GPU name such as H200")
    if v > MAX_MEMORY_GIB:
        raise argparse.ArgumentTypeError(f"{s!r} GiB is over the planner's bound of {MAX_MEMORY_GIB:g} GiB (about a "
                                         "pebibyte, more than any GPU holds); give GiB, e.g. 80, or a GPU name")
    return v


def _model_arg(s: str) -> str:
    """A model of the registry (fp8kv.capacity.get_model's names: case and an ``org/`` prefix ignored), kept as given."""
    try:
        get_model(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: not a model of fp8kv's registry; expected one of "
                                         f"{sorted(MODEL_SHAPES)}") from None
    return s


def _positive_int_arg(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: expected a positive int") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{s!r}: expected a positive int")
    return v


def _tokens_arg(s: str) -> int:
    """A sequence length: a positive int up to the planner's :data:`~fp8kv.capacity.MAX_MODEL_LEN`."""
    v = _positive_int_arg(s)
    if v > MAX_MODEL_LEN:
        raise argparse.ArgumentTypeError(f"{s!r}: expected a positive int of tokens, at most {MAX_MODEL_LEN}")
    return v


def _nonnegative_int_arg(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: expected an int >= 0") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{s!r}: expected an int >= 0")
    return v


def _number_arg(s: str, lo: float, hi: float | None, what: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: expected {what}") from None
    if not math.isfinite(v) or v < lo or (hi is not None and v > hi):
        raise argparse.ArgumentTypeError(f"{s!r}: expected {what}")
    return v


def _draft_len_arg(s: str) -> int:
    """A draft length by the sweep's rule (fp8kv.step.speculative.draft_len_arg: an int in [0, MAX_DRAFT_LEN])."""
    try:
        return draft_len_arg(_nonnegative_int_arg(s), "--draft-lens")
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{s!r}: {e}") from None


def _acceptance_arg(s: str) -> float:
    return _number_arg(s, 0.0, 1.0, "a per-token acceptance rate in [0, 1]")


def _draft_us_arg(s: str) -> float:
    return _number_arg(s, 0.0, None, "the draft's microseconds per step, a finite number >= 0")


def _rep_ms(s: str) -> int:
    """Milliseconds per timing by the sweep's rule (fp8kv.checks.rep_ms: an int in [1, MAX_REP_MS])."""
    try:
        return checks.rep_ms(_positive_int_arg(s), "--rep")
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{s!r}: {e}") from None


def _block_size_arg(s: str) -> int:
    """Tokens per page by the cache's own rule (fp8kv.cache.check_block_size)."""
    try:
        return check_block_size(_positive_int_arg(s), "--block-size")
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{s!r}: {e}") from None


def _kv_dtype_arg(s: str) -> str:
    """A KV dtype or quantized format by its canonical name (fp8kv.step.quantized.step_kv_dtype, aliases read)."""
    try:
        return step_kv_dtype(s, "--kv-dtypes")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = checks.ArgumentParser(prog="fp8kv step", description="Time a model's whole decode step (CUDA graph) "
                                "from batch 1 to each KV dtype's memory ceiling; write "
                                "results/step/<gpu-slug>/<timestamp>.csv. With --draft-lens: the speculative "
                                "verification step and accepted tokens/s (results/step-verify); with "
                                "--prompt-lens and --chunks: chunked prefill's time to first token "
                                "(results/step-prefill).")
    p.add_argument("--model", type=_model_arg, nargs="+", required=True, metavar="NAME",
                   help="registry model name(s) (fp8kv.capacity.MODELS), e.g. Qwen3-0.6B Llama-3.1-8B")
    p.add_argument("--contexts", type=_tokens_arg, nargs="+", metavar="TOKENS",
                   help="tokens per sequence (the new tokens included), e.g. 4096 16384; required but with "
                        "--prompt-lens")
    p.add_argument("--draft-lens", type=_draft_len_arg, nargs="+", metavar="K",
                   help="speculative decoding: draft tokens verified per step, e.g. 0 2 4 8 (0: the decode step)")
    p.add_argument("--acceptance", type=_acceptance_arg, nargs="+", metavar="A",
                   help="with --draft-lens: per-token acceptance rate(s) in [0, 1] (i.i.d.; default 0.7)")
    p.add_argument("--draft-us", type=_draft_us_arg, metavar="US",
                   help="with --draft-lens: the draft's cost per step in microseconds (default 0: MTP heads or "
                        "n-gram drafts)")
    p.add_argument("--draft-model", metavar="NAME",
                   help="with --draft-lens: a separate draft model (registry name, e.g. Qwen3-0.6B) on the same GPU: "
                        "its weights and KV come off the ceiling and, unless --draft-us is given, k of its decode "
                        "steps are timed as the draft's cost")
    p.add_argument("--prompt-lens", type=_tokens_arg, nargs="+", metavar="N",
                   help="chunked prefill: prompt lengths in tokens (with --chunks), e.g. 4096 16384")
    p.add_argument("--chunks", type=_positive_int_arg, nargs="+", metavar="C",
                   help="with --prompt-lens: chunk sizes in tokens, e.g. 512 2048 (one at least the prompt: the "
                        "full prefill)")
    p.add_argument("--batches", type=_positive_int_arg, nargs="+", metavar="B",
                   help="batch sizes to time (each must fit every KV dtype's ceiling); default: powers of 4, "
                        "both ceilings")
    p.add_argument("--kv-dtypes", nargs="+", type=_kv_dtype_arg, default=["bf16", "fp8_e4m3"], metavar="KV",
                   help="KV-cache dtypes or quantized formats, each timed to its own ceiling (default: bf16 "
                        f"fp8_e4m3); one of {' '.join(STEP_KV_DTYPES)}")
    p.add_argument("--backend", choices=STEP_BACKENDS, default="auto",
                   help="attention backend of fp8kv.decode (auto: Triton on a GPU, else the reference)")
    p.add_argument("--mode", choices=("auto", "dequant", "fp8"), default="auto", help="attention mode (default %(default)s)")
    p.add_argument("--gpu-memory", type=_gpu_memory_arg, metavar="GIB|GPU",
                   help="GPU memory to plan against, in GiB or a GPU name (default: this GPU's total; required "
                        "on CPU)")
    p.add_argument("--utilization", type=float, default=0.9,
                   help="fraction of GPU memory the engine may use, in (0, 1] (vLLM's gpu_memory_utilization)")
    p.add_argument("--block-size", type=_block_size_arg, default=16,
                   help="tokens per KV block, a positive int (default 16)")
    p.add_argument("--weights", choices=("auto", "real", "random"), default="auto",
                   help="auto: real weights where fp8kv loads them offline (SmolLM2-135M), random otherwise")
    p.add_argument("--rep", type=_rep_ms, default=50,
                   help=f"ms of CUDA-graph replays per timing, 1-{checks.MAX_REP_MS} (default %(default)s)")
    p.add_argument("--out", help="results folder (a sub-folder per GPU; default results/step, results/step-verify "
                                 "with --draft-lens, results/step-prefill with --prompt-lens)")
    p.add_argument("--no-save", action="store_true", help="print only")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: the GPU if there is one, else the CPU)")
    p.add_argument("--interpret", action="store_true",
                   help="CPU: run Triton under its interpreter (sets TRITON_INTERPRET=1; implies --device cpu)")
    p.add_argument("--dry-run", action="store_true", help="print the ceilings and batches; build and time nothing")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``fp8kv step`` / ``python -m fp8kv.step``; returns the exit status.

    0: every point ran, or was refused by its backend (``unsupported``, the reason in its row). 1: a point
    failed (``error``: out of memory, or anything else it raised; the sweep goes on and its row says why), or
    ``--out`` could not be written (the rows then go to a temporary folder, named on stderr). 2: bad input,
    nothing fits, or no point ran (one line on stderr; in the last case after the summary, the rows saved).
    130: stopped by SIGINT, SIGTERM, SIGHUP or another signal that would end it
    (:func:`fp8kv.interrupts.stop_signals`; the points measured so far are saved).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)

    def refuse(msg: str):
        parser.exit(2, f"{parser.prog}: error: {msg}\n")

    if args.interpret:
        if "triton" in sys.modules and not interpreter_on():
            print("warning: triton is already imported; --interpret has no effect", file=sys.stderr)
        use_interpreter(os.environ)  # set even where too late for triton: the capability checks read it
        if args.device not in (None, "cpu"):
            refuse(f"--interpret runs on CPU tensors; drop --device {args.device}")
        args.device = "cpu"
    if not 0 < args.utilization <= 1:
        refuse(f"--utilization {args.utilization}: expected a number in (0, 1]")
    if args.out is not None and not args.no_save:  # before the sweep, not after it (its rows then went elsewhere)
        try:
            checks.output_folder(args.out, "--out")
        except (TypeError, ValueError) as e:
            refuse(str(e))
    kind = _kind(args, refuse)
    try:
        _check_steps(kind, args)
    except ValueError as e:
        refuse(str(e))
    if kind != "decode":
        return _main_multi(kind, args, argv, refuse)
    try:
        plans = plan_sweep(args.model, args.contexts, args.kv_dtypes, batches=args.batches,
                           gpu_memory_gib=args.gpu_memory, utilization=args.utilization,
                           block_size=args.block_size, device=args.device, backend=args.backend, mode=args.mode)
        check_weights(list(dict.fromkeys(p["shape"] for p in plans)), args.weights)  # the dry run refuses as the run
        if not args.dry_run:
            check_host_memory(plans, resolve_device(args.device))
    except CapacityError as e:  # not one sequence (or not the weights) fits: name what to change, and the sizes
        memory = ("now this GPU's total" if args.gpu_memory is None else
                  f"now {args.gpu_memory:g}" if isinstance(args.gpu_memory, float) else f"now {args.gpu_memory}")
        refuse(f"{e}; pass shorter contexts (--contexts, now {' '.join(map(str, args.contexts))}) or more GPU "
               f"memory (--gpu-memory, {memory})".replace("\n", " "))
    except ValueError as e:  # unknown model, batch over the ceiling, no memory given, no host room, a format
        # the backend does not read or whose block does not fit the model
        refuse(str(e).replace("\n", " "))
    if args.dry_run:
        for p in plans:
            plan = p["plan"]
            print(f"{p['shape'].name:<16} {p['kv_dtype']:<15} ctx={p['context']:<6} "
                  f"bytes/token={plan['bytes_per_token']:<8} ceiling={plan['ceiling']:<5} "
                  f"KV {gib_text(plan['kv_memory_bytes'])}  batches={p['batches']}")
        print(f"{sum(len(p['batches']) for p in plans)} points")
        return 0
    return _run_and_save(lambda: sweep(args.model, args.contexts, args.kv_dtypes, batches=args.batches,
                                       backend=args.backend, mode=args.mode, gpu_memory_gib=args.gpu_memory,
                                       utilization=args.utilization, block_size=args.block_size,
                                       weights=args.weights, device=args.device, rep=args.rep,
                                       progress=not args.quiet, keep_partial=True),
                         summary, args, argv, kind)


def _run_and_save(run, summarize, args, argv, kind: str) -> int:
    """``run()`` (a sweep with ``keep_partial``) with every stop signal (SIGTERM, SIGHUP, ...) as Ctrl-C, then
    its summary and its rows saved, which no signal can cut short; the exit status (130: a signal stopped the
    sweep; the points measured before it are saved)."""
    t0 = time.perf_counter()
    with stop_signals_as_keyboard_interrupt():
        df = run()
        if df.attrs["step"]["interrupted"] and df.empty:
            print("interrupted before a point was measured: nothing to save", file=sys.stderr)
            return 130
        with signals_ignored():  # a signal now must not cut the save short
            print(summarize(df))
            print(f"{len(df)} rows in {time.perf_counter() - t0:.0f} s")
            saved_where_asked = True
            if not args.no_save:
                path, saved_where_asked = save_or_fallback(save, df, args.out or OUT_DIRS[kind], {"argv": argv})
                print(f"wrote {path}")
    if df.attrs["step"]["interrupted"]:
        print("interrupted: the rows above are what was measured; the other points did not run", file=sys.stderr)
        return 130
    return _exit_status(df, saved_where_asked)


def _exit_status(df, saved_where_asked: bool) -> int:
    if not (df["status"] == "ok").any():  # each point refused or failed as it was built: no success
        print(f"error: none of the {len(df)} points ran here (see the reasons above)", file=sys.stderr)
        return 2
    return 1 if (df["status"] == "error").any() or not saved_where_asked else 0


def _kind(args, refuse) -> str:
    """Which run the arguments ask for (``decode``, ``verify`` or ``prefill``); the options of another refused."""
    verify, prefill = args.draft_lens is not None, args.prompt_lens is not None or args.chunks is not None
    if verify and prefill:
        refuse("--draft-lens and --prompt-lens/--chunks ask for two runs; give one of them per command")
    if not verify:
        for name, value in (("--acceptance", args.acceptance), ("--draft-us", args.draft_us),
                            ("--draft-model", args.draft_model)):
            if value is not None:
                refuse(f"{name} {value if not isinstance(value, list) else ' '.join(map(str, value))}: applies to "
                       "the verification run; add --draft-lens")
    if prefill:
        if args.prompt_lens is None or args.chunks is None:
            refuse("--prompt-lens and --chunks go together: give the prompt lengths and the chunk sizes")
        for name, value in (("--contexts", args.contexts), ("--batches", args.batches)):
            if value is not None:
                refuse(f"{name} {' '.join(map(str, value))}: a prefill runs one prompt of each --prompt-lens; "
                       f"drop {name}")
        return "prefill"
    if args.contexts is None:
        refuse("--contexts is required (tokens per sequence, e.g. 4096), but with --prompt-lens")
    return "verify" if verify else "decode"


def _check_steps(kind: str, args) -> None:
    """The planner's refusals of the steps asked for, by the library's own checks but naming the flags (the planner
    names its arguments: q_len = k + 1 for --draft-lens k): the formats among --kv-dtypes against each model's
    head_dim, --backend, --mode and the new tokens per step, and the draft lengths against --contexts."""
    flags = {"kv_dtype": "--kv-dtypes", "backend": "--backend", "mode": "--mode"}
    checked_kv_dtypes(args.kv_dtypes, [get_model(m) for m in args.model], 1, args.backend, args.mode, names=flags)
    if kind == "verify":
        drafts = [(f"--draft-lens={k}", k) for k in args.draft_lens]
        check_drafts_fit(drafts, args.contexts, "--contexts")
        check_one_token(args.kv_dtypes, [(g, k + 1) for g, k in drafts], "--draft-lens=0", "--kv-dtypes")
    elif kind == "prefill":
        check_one_token(args.kv_dtypes, [(f"--chunks={c}", min(c, n)) for c in args.chunks for n in args.prompt_lens],
                        "--chunks=1", "--kv-dtypes")


def _main_multi(kind: str, args, argv, refuse) -> int:
    """The verification (``--draft-lens``) or chunked-prefill (``--prompt-lens``) run of :func:`main`."""
    common = dict(backend=args.backend, mode=args.mode, gpu_memory_gib=args.gpu_memory, utilization=args.utilization,
                  block_size=args.block_size, weights=args.weights, device=args.device, rep=args.rep,
                  progress=not args.quiet)
    try:
        if args.dry_run:
            plans = _plans(kind, args)
            check_weights(list(dict.fromkeys(p["shape"] for p in plans)), args.weights)  # refused as the run refuses
            for p in plans:
                print(f"{p['shape'].name:<16} {p['kv_dtype']:<9} context={p['context']:<6} q_len={p['plan']['q_len']:<5} "
                      f"ceiling={p['plan']['ceiling']:<5} batches={p['batches']}")
            return 0
        check_host_memory(_plans(kind, args), resolve_device(args.device))
    except CapacityError as e:
        refuse(f"{e}; pass shorter contexts or prompts, or more GPU memory (--gpu-memory)".replace("\n", " "))
    except ValueError as e:
        refuse(str(e).replace("\n", " "))
    if kind == "verify":
        return _run_and_save(lambda: verify_sweep(args.model, args.contexts, args.draft_lens, args.acceptance or [0.7],
                                                  args.kv_dtypes, batches=args.batches, draft_us=args.draft_us,
                                                  draft_model=args.draft_model, keep_partial=True, **common),
                             verify_summary, args, argv, kind)
    return _run_and_save(lambda: prefill_sweep(args.model, args.prompt_lens, args.chunks, args.kv_dtypes,
                                               keep_partial=True, **common),
                         prefill_summary, args, argv, kind)


def _plans(kind: str, args) -> list[dict]:
    """What the run will measure: :func:`plan_sweep` of each draft length, or of each prompt and chunk (batch 1)."""
    common = dict(gpu_memory_gib=args.gpu_memory, utilization=args.utilization, block_size=args.block_size,
                  device=args.device, backend=args.backend, mode=args.mode)
    if kind == "verify":
        return [p for k in dict.fromkeys(args.draft_lens)
                for p in plan_sweep(args.model, args.contexts, args.kv_dtypes, batches=args.batches, q_len=k + 1,
                                    draft_model=args.draft_model, **common)]
    return [p for n in dict.fromkeys(args.prompt_lens) for c in dict.fromkeys(args.chunks)
            for p in plan_sweep(args.model, [n], args.kv_dtypes, batches=[1], q_len=min(c, n), **common)]
