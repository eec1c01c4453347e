"""What a step needs and moves: parameter and activation bytes, the batch ceiling at a context,
the bytes one step reads and writes, and the batches a sweep measures (:func:`plan_sweep`)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

from .. import checks
from ..cache import check_block_size
from ..capability import ARCHS, AUTO_MODE, check
from ..capacity import GIB, MAX_MEMORY_GIB, CapacityError, ModelShape, get_model, gib_text, plan_capacity
from ..checks import fail as _fail
from .layers import STEP_DTYPES as RUN_DTYPES
from .layers import StepWeights, require_step_shape, step_shape
from .model import STEP_BACKENDS, STEP_MODES
from .quantized import check_format_shape, check_format_step, is_format, step_kv_dtype

# ---------------------------------------------------------------------------------- memory and bytes


def run_dtype_arg(dtype, name: str = "dtype") -> torch.dtype:
    """``dtype`` if it is one of :data:`RUN_DTYPES` (TypeError naming ``name`` otherwise)."""
    if dtype not in RUN_DTYPES:
        _fail(f"{name}={dtype!r}; expected one of {RUN_DTYPES}", TypeError)
    return dtype


def _elem(dtype: torch.dtype) -> int:
    return run_dtype_arg(dtype).itemsize


def param_count(shape: ModelShape) -> int:
    """Parameters of the step's weights for ``shape`` (tied embeddings once): what
    :func:`random_weights` allocates, and the planner's weight count where the shape has no ``num_params``."""
    s = require_step_shape(shape)
    h, d = s.hidden_size, s.head_dim
    per_layer = (2 * h + (s.num_q_heads + 2 * s.num_kv_heads) * d * h + (2 * d if s.qk_norm else 0)
                 + h * s.num_q_heads * d + 3 * h * s.intermediate_size)
    return s.vocab_size * h * (1 if s.tie_word_embeddings else 2) + s.num_layers * per_layer + h


def activation_bytes(shape: ModelShape, batch: int, dtype: torch.dtype = torch.bfloat16, num_sms: int = 132,
                     q_len: int = 1) -> int:
    """Upper bound of one step's transient device bytes at ``batch`` sequences of ``q_len`` new tokens (what an
    engine's profiling run reserves beside the KV cache), per token row: the residual stream and its norm (×3),
    the QKV output, the attention output (×2), the MLP's gate/up output and product (3 × I), the logits; and
    the split-KV partials of the Triton kernels (fp32). The decode's: at most ``8 × num_sms`` split programs
    beyond one per sequence-head. The multi-token kernel's: its splits fill at most ``num_sms`` programs of
    up to 128 rows (four waves of tiles of up to 32: the same bound) beyond one split per row and head
    (:func:`fp8kv.ops.attend.attend_launch`)."""
    s = require_step_shape(shape)
    batch, q_len = checks.positive_int(batch, "batch"), checks.positive_int(q_len, "q_len")
    num_sms = checks.positive_int(num_sms, "num_sms")
    per_row = (3 * s.hidden_size + (s.num_q_heads + 2 * s.num_kv_heads) * s.head_dim
               + 2 * s.num_q_heads * s.head_dim + 3 * s.intermediate_size + s.vocab_size)
    group = s.num_q_heads // s.num_kv_heads
    if q_len == 1:
        partials = (8 * num_sms + batch * s.num_kv_heads) * group * (s.head_dim + 1) * 4
    else:
        partials = (128 * num_sms + batch * q_len * s.num_q_heads) * (s.head_dim + 1) * 4
    return batch * q_len * per_row * _elem(dtype) + partials


def step_ceiling(shape: ModelShape, kv_dtype: str, context: int, *, gpu_memory_gib, utilization: float = 0.9,
                 block_size: int = 16, dtype: torch.dtype = torch.bfloat16, num_sms: int = 132,
                 q_len: int = 1, draft_model=None) -> dict:
    """The largest batch of ``context``-token sequences whose KV and activations fit, with the planner's accounting.

    ``q_len``: new tokens per sequence in the step (1: decode; k + 1: verification of k drafts). They are
    the last ``q_len`` of the ``context``, so the KV per sequence is the same; the activations grow with them.

    Budget = ``gpu_memory_gib × utilization − weights`` (:func:`fp8kv.capacity.plan_capacity`). The
    ceiling is the largest batch B whose KV (B × ⌈context / block_size⌉ whole blocks, plus the fixed
    scales) and :func:`activation_bytes` at B, together, fit in it; both grow with B, so it is found by
    bisection. The activations are counted at the batch planned, not at the batch the whole budget
    would hold: a large vocabulary (Gemma 3's 262k logits per sequence) would otherwise reserve more
    than the GPU for a batch that never runs. Returns the plan of the KV memory left beside the
    activations at the ceiling (``plan_capacity(kv_memory_gib=budget − activation_bytes)``, the pool a
    sweep allocates; it may hold a few blocks more than the ceiling needs) plus ``ceiling``,
    ``activation_bytes`` (at the ceiling), ``weights_bytes``, ``gpu``, ``gpu_memory_gib``,
    ``utilization`` and ``context``. Raises :class:`~fp8kv.capacity.CapacityError` when not even one
    sequence fits.

    ``draft_model`` (a registry name or ModelShape; speculative decoding with a separate draft model): its
    weights come off the budget and each sequence holds the draft's KV beside the target's (same KV dtype and
    context, :func:`fp8kv.capacity.plan_capacity`'s bytes), so the ceiling is the batch both models' KV fit;
    the draft's activations (a few MiB) are not counted. The plan gains ``draft_model``,
    ``draft_weights_bytes`` and ``draft_bytes_per_seq`` (0 without one).
    """
    from ..checks import positive_int

    shape = require_step_shape(shape)
    draft = None if draft_model is None else step_shape(draft_model, "draft_model")
    context = positive_int(context, "context")
    q_len = positive_int(q_len, "q_len")
    num_sms, dtype = positive_int(num_sms, "num_sms"), run_dtype_arg(dtype)
    if q_len > context:
        _fail(f"q_len={q_len} new tokens do not fit a context of {context} tokens (they are its last q_len)")
    weights_gib = None if shape.num_params is not None else param_count(shape) * _elem(dtype) / GIB
    base = plan_capacity(shape, kv_dtype, gpu_memory_gib=gpu_memory_gib, utilization=utilization,
                         block_size=block_size, max_model_len=context, weights_gib=weights_gib)
    budget, fixed = base["kv_budget_bytes"], base["fixed_scale_bytes"]
    bpseq = math.ceil(context / block_size)
    seq_bytes = bpseq * base["block_bytes"]
    draft_weights = draft_seq = 0
    if draft is not None:  # the draft model lives on the same GPU: its weights once, its KV per sequence
        dw = None if draft.num_params is not None else param_count(draft) * _elem(dtype) / GIB
        d = plan_capacity(draft, kv_dtype, gpu_memory_gib=gpu_memory_gib, utilization=utilization,
                          block_size=block_size, max_model_len=context, weights_gib=dw)
        draft_weights, draft_seq = d["weights_bytes"], bpseq * d["block_bytes"]
        budget -= draft_weights
        fixed += d["fixed_scale_bytes"]
    target_seq = seq_bytes
    seq_bytes += draft_seq

    def act(batch: int) -> int:
        return activation_bytes(shape, batch, dtype, num_sms, q_len)

    def fits(batch: int) -> bool:
        return fixed + batch * seq_bytes + act(batch) <= budget

    if not fits(1):
        rows = "" if q_len == 1 else f" ({q_len} tokens)"
        with_draft = "" if draft is None else f" (with the draft {draft.name}'s)"
        raise CapacityError(f"{shape.name} with {base['kv_dtype']} KV at context {context}: one sequence's KV"
                            f"{with_draft} ({gib_text(seq_bytes)}) and the activations of batch 1{rows} "
                            f"({gib_text(act(1))}) do not fit in the {gib_text(max(budget, 0))} left after the weights")
    lo, hi = 1, max(1, (budget - fixed) // seq_bytes)  # fits(lo); KV alone bounds the batch above
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    ceiling, activations = lo, act(lo)
    # The target's pool: its share of the KV memory (the draft's KV is the rest).
    target_kv = (budget - activations) * target_seq // seq_bytes
    plan = plan_capacity(shape, kv_dtype, kv_memory_gib=target_kv / GIB, block_size=block_size, max_model_len=context)
    ceiling = min(ceiling, plan["blocks"] // bpseq)  # the GiB round trip may drop a byte
    if ceiling < 1:
        raise CapacityError(f"{shape.name} with {plan['kv_dtype']} KV: {plan['blocks']} blocks hold no sequence of "
                            f"{context} tokens ({bpseq} blocks)")
    return dict(plan, ceiling=ceiling, activation_bytes=activations, weights_bytes=base["weights_bytes"],
                gpu=base["gpu"], gpu_memory_gib=base["gpu_memory_gib"], utilization=utilization, context=context,
                q_len=q_len, draft_model=None if draft is None else draft.name, draft_weights_bytes=draft_weights,
                draft_bytes_per_seq=draft_seq)


def kv_bytes_per_token(shape: ModelShape, kv_dtype: str, block_size: int = 16):
    """Bytes one token's K and V take in every layer, the planner's count (:func:`fp8kv.capacity.plan_capacity`'s
    ``bytes_per_token``: codes and, for FP8 and the quantized formats, the scales stored with each token)."""
    return plan_capacity(shape, kv_dtype, kv_memory_gib=MAX_MEMORY_GIB, block_size=block_size,
                         max_model_len=1)["bytes_per_token"]


def step_bytes(shape: ModelShape, weights: StepWeights, kv_dtype: str, batch: int, context: int,
               q_len: int = 1) -> dict:
    """Useful bytes of one step (ints): ``weights`` read (all layers, final norm, LM head; of the
    embedding only the B × q_len rows looked up unless it is the LM head), ``kv`` read by attention (B ×
    context tokens per layer, K and V) plus the ``q_len`` new tokens' K/V written, at
    :func:`kv_bytes_per_token` (a quantized format's scales counted with its codes); ``total``."""
    elem = _elem(weights.dtype)
    layer_bytes = sum(t.numel() * t.element_size() for lw in weights.layers for t in lw.tensors())
    head = weights.lm_head.numel() * weights.lm_head.element_size()
    embed = 0 if weights.lm_head is weights.embed else batch * q_len * shape.hidden_size * elem
    w = layer_bytes + weights.final_norm.numel() * elem + head + embed
    kv = round(batch * (context + q_len) * kv_bytes_per_token(shape, kv_dtype))
    return {"weights": w, "kv": kv, "total": w + kv}


def int_list(values, name: str) -> list:
    """An int as a list of one, or ``values`` as a list (its items checked by the caller); a str, a float or None is a
    TypeError naming ``name`` (a context of "64" was read as 6 and 4)."""
    if isinstance(values, numbers.Integral) and not isinstance(values, bool):
        return [int(values)]
    if isinstance(values, torch.Tensor) and values.ndim == 0:
        return [values]  # its dtype checked with the items
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, range)) and not hasattr(values, "tolist"):
        _fail(f"{name}={checks.show_value(values)} ({type(values).__name__}); expected an int or a list of ints",
              TypeError)
    return list(values.tolist() if hasattr(values, "tolist") else values)


def batch_points(ceilings: Sequence[int], ceiling: int, base: int = 4) -> list[int]:
    """Batches to measure for a KV dtype whose ceiling is ``ceiling``: powers of ``base`` below it, every
    ceiling of ``ceilings`` it reaches (so each dtype is also measured at the others' ceilings), and its own."""
    ceiling = checks.positive_int(ceiling, "ceiling")
    base = checks.integer(base, "base", minimum=2)  # 1 would never pass the ceiling
    ceilings = [checks.nonnegative_int(c, f"ceilings[{i}]") for i, c in enumerate(int_list(ceilings, "ceilings"))]
    pts = {1, ceiling}
    p = base
    while p < ceiling:
        pts.add(p)
        p *= base
    pts.update(c for c in ceilings if 1 <= c <= ceiling)
    return sorted(pts)


def _gpu_memory(gpu_memory_gib, dev):
    if gpu_memory_gib is not None:
        return gpu_memory_gib
    if dev.type != "cuda":
        _fail("gpu_memory_gib is required on CPU: the GiB (or a GPU name such as 'H200') to plan against")
    return torch.cuda.mem_get_info(dev)[1] / GIB


def run_dtype(dev: torch.device, dtype=None) -> torch.dtype:
    """The weights' and activations' dtype of a step run: ``dtype``, else bf16 on a GPU and fp32 on CPU."""
    return (torch.bfloat16 if dev.type == "cuda" else torch.float32) if dtype is None else run_dtype_arg(dtype)


def plan_sweep(models, contexts, kv_dtypes=("bf16", "fp8_e4m3"), *, batches=None, gpu_memory_gib=None,
               utilization: float = 0.9, block_size: int = 16, device=None, dtype=None, q_len: int = 1,
               backend: str | None = None, mode: str = "auto", draft_model=None) -> list[dict]:
    """What :func:`sweep` will measure, without building anything: one dict per (model, context, kv_dtype)
    with ``shape``, ``plan`` (the :func:`step_ceiling` plan, ``ceiling`` among its keys) and ``batches``.
    Explicit ``batches`` are checked against the ceiling, the largest batch whose KV and activations fit
    (both grow with the batch, so a batch fits exactly when it is at most the ceiling); one over it is
    refused (ValueError naming the ceiling). By default :func:`batch_points`. ``dtype``
    (of the activations; default :func:`run_dtype`, as :func:`sweep` runs) and ``device`` (its SM
    count) enter the activation estimate; ``q_len`` (new tokens per sequence, :func:`step_ceiling`'s) too.

    ``kv_dtypes``: element types or quantized formats (:func:`fp8kv.step.quantized.step_kv_dtype`; each plan's
    ``kv_dtype`` is the canonical name), a format's ceiling from the planner's bytes per token for it (codes and
    scales). Refused before any ceiling (ValueError naming ``kv_dtypes``, the value and what is accepted): an
    unknown name, a format whose block does not fit a model's head_dim, a format with ``q_len`` above 1 and,
    where ``backend`` (and ``mode``) is given, a format that backend does not read. ``draft_model``: a separate
    draft model sharing the GPU (:func:`step_ceiling`)."""
    from ..checks import positive_int
    from ..device import resolve_device
    from ..ops.decode.splits import sm_count  # here, not above: it imports triton (--interpret comes first)

    dev = resolve_device(device)
    dtype = run_dtype(dev, dtype)  # what sweep() runs on this device, so the plan is the one timed
    models = [models] if isinstance(models, ModelShape) else checks.listed(models, "models", "model names or ModelShapes")
    # each point once: a model or context named twice was measured twice, both rows feeding the best of each dtype
    shapes = list(dict.fromkeys(m if isinstance(m, ModelShape) else get_model(m) for m in models))
    contexts = list(dict.fromkeys(positive_int(c, "contexts") for c in int_list(contexts, "contexts")))
    kv_dtypes = checked_kv_dtypes(kv_dtypes, shapes, q_len, backend, mode, dev)  # a format's own refusal first
    if backend is not None:  # a name no sweep runs would be planned as if it ran
        checks.one_of(backend, "backend", STEP_BACKENDS)
    checks.one_of(mode, "mode", STEP_MODES)
    if batches is not None:
        batches = list(dict.fromkeys(positive_int(b, "batches") for b in int_list(batches, "batches")))
    for name, given in (("models", shapes), ("contexts", contexts), ("batches", batches)):
        if given is not None and not given:
            _fail(f"{name} is empty; expected at least one (a sweep of nothing measures nothing)")
    # The cache's rule (the planner's too): a page the pool cannot hold is refused here, before a point is built.
    block_size = check_block_size(block_size, "block_size")
    mem = _gpu_memory(gpu_memory_gib, dev)
    plans = []
    for shape in shapes:
        for ctx in contexts:
            ceil = {kv: step_ceiling(shape, kv, ctx, gpu_memory_gib=mem, utilization=utilization,
                                     block_size=block_size, dtype=dtype, num_sms=sm_count(dev), q_len=q_len,
                                     draft_model=draft_model)
                    for kv in kv_dtypes}
            for kv in kv_dtypes:
                c = ceil[kv]["ceiling"]
                if batches is not None:
                    over = [b for b in batches if b > c]
                    if over:
                        _fail(f"batches {over} exceed the ceiling of {c} sequences for {shape.name} with {kv} KV at "
                              f"context {ctx}: their KV and activations do not fit in the "
                              f"{gib_text(ceil[kv]['kv_budget_bytes'] + ceil[kv]['activation_bytes'])} left of "
                              f"{float(ceil[kv]['gpu_memory_gib']):.4g} GiB × {utilization} after the weights; pass "
                              f"batches (--batches) of at most {c}, or shorter contexts (--contexts)")
                    pts = sorted(set(batches))
                else:
                    pts = batch_points([x["ceiling"] for x in ceil.values()], c)
                plans.append(dict(shape=shape, context=ctx, kv_dtype=kv, plan=ceil[kv], batches=pts))
    return plans


def kv_dtype_names(kv_dtypes) -> list[str]:
    """``kv_dtypes`` (a name or a non-empty list of them) as canonical names, in order, once each
    (:func:`~fp8kv.step.quantized.step_kv_dtype`; ValueError / TypeError naming ``kv_dtypes``)."""
    kv_dtypes = checks.listed(kv_dtypes, "kv_dtypes", "KV dtype or format names")
    return list(dict.fromkeys(step_kv_dtype(kv, "kv_dtypes") for kv in kv_dtypes))


def checked_kv_dtypes(kv_dtypes, shapes, q_len: int = 1, backend: str | None = None, mode: str = "auto",
                      device=None, *, names: dict | None = None) -> list[str]:
    """``kv_dtypes`` as canonical names (in order, once each), every quantized format checked against each of
    ``shapes`` (its head_dim), ``q_len`` and, where given, ``backend`` / ``mode``, and every 16-bit or FP8 dtype
    against the backend and mode (see :func:`plan_sweep`). ``names``: what the messages call ``kv_dtypes``,
    ``backend`` and ``mode`` (the CLI's flags), as :func:`check_element_step`'s."""
    kv_names = kv_dtype_names(kv_dtypes)
    on_gpu = None if device is None else torch.device(device).type == "cuda"
    for kv in filter(is_format, kv_names):
        for shape in shapes:
            check_format_shape(kv, shape.num_kv_heads, shape.head_dim, model=shape.name,
                               name=(names or {}).get("kv_dtype", "kv_dtypes"))
        if backend is not None:
            check_format_step(kv, backend, mode, q_len, on_gpu=on_gpu, names=names)
        else:
            check_format_step(kv, "auto", "auto", q_len)
    for kv in (n for n in kv_names if not is_format(n)):
        for shape in shapes:
            check_element_step(kv, backend or "auto", mode, q_len, shape.head_dim, names=names)
    return kv_names


def check_element_step(kv_dtype: str, backend: str, mode: str, q_len: int = 1, head_dim: int | None = None, *,
                       names: dict | None = None) -> None:
    """Refuse (ValueError) 16-bit or FP8 pages of ``kv_dtype`` that ``backend`` (``"auto"``: any step backend) runs in
    ``mode`` (``"auto"``: :data:`~fp8kv.capability.AUTO_MODE`) on no arch, by :func:`fp8kv.capability.check`'s facts
    (fp8 mode needs FP8 pages; the reference has no fp8 mode): every point of such a run is refused as it is built.
    What depends on the machine that runs it (a GPU, what is installed) is left to the run. ``names``: what the
    message calls ``kv_dtypes``, ``backend`` and ``mode`` (the CLI's flags), as :func:`check_format_step`'s."""
    names = {"kv_dtype": "kv_dtypes", "backend": "backend", "mode": "mode", **(names or {})}
    backends = [b for b in STEP_BACKENDS if b != "auto"] if backend == "auto" else [backend]
    op = "decode" if q_len == 1 else "attend"

    def answers(m: str) -> list[tuple[bool, str]]:
        return [check(b, kv_dtype, m, arch, "tensor", head_dim, op=op) for b in backends for arch in ARCHS]

    used = AUTO_MODE if mode == "auto" else mode
    refused = answers(used)
    if not any(ok for ok, _ in refused):
        why = "; ".join(dict.fromkeys(w for _, w in refused))
        # advice about the mode only where another mode runs: a head_dim no kernel builds is not the mode's fault
        advice = (f"; expected {names['mode']} 'auto' or '{AUTO_MODE}', or an FP8 KV dtype and a backend with an "
                  "fp8 mode") if used != AUTO_MODE and any(ok for ok, _ in answers(AUTO_MODE)) else ""
        _fail(f"{names['mode']}={mode!r} with {names['kv_dtype']}={kv_dtype!r} and {names['backend']}={backend!r}: "
              f"{why}{advice}")


def plan_table(runs, kv_dtypes=("bf16", "fp8_e4m3"), *, gpu_memory_gib=None, utilization: float = 0.9,
               block_size: int = 16, device=None, dtype=None):
    """:func:`plan_sweep` of each ``(model, context)`` of ``runs`` as one table: model, context, kv_dtype,
    bytes/token (the planner's: all layers, K and V, codes and scales), ceiling (sequences), KV GiB, activations GiB and the batches :func:`~fp8kv.step.sweep_runs` will
    time with the same arguments (``dtype`` defaults as there: :func:`run_dtype`)."""
    import pandas as pd

    from ..device import resolve_device

    dev = resolve_device(device)
    rows = []
    for model, context in checked_runs(runs):
        for p in plan_sweep([model], [context], kv_dtypes, gpu_memory_gib=gpu_memory_gib, utilization=utilization,
                            block_size=block_size, device=dev, dtype=run_dtype(dev, dtype)):
            rows.append({"model": p["shape"].name, "context": p["context"], "kv_dtype": p["kv_dtype"],
                         "bytes/token": p["plan"]["bytes_per_token"], "ceiling": p["plan"]["ceiling"], "KV GiB": p["plan"]["kv_memory_bytes"] / GIB,
                         "activations GiB": p["plan"]["activation_bytes"] / GIB, "batches": p["batches"]})
    return pd.DataFrame(rows)


def checked_runs(runs) -> list[tuple]:
    """``runs`` checked: a non-empty list of ``(model, context)`` pairs (a registry name or a ModelShape)."""
    if not isinstance(runs, (list, tuple)):
        _fail(f"runs={runs!r}; expected a list of (model, context) pairs such as [('Qwen3-8B', 16384)]", TypeError)
    if not runs:
        _fail("runs=[]; give at least one (model, context) pair")
    for i, r in enumerate(runs):
        if not (isinstance(r, (list, tuple)) and len(r) == 2):
            _fail(f"runs[{i}]={r!r}; expected a (model, context) pair such as ('Qwen3-8B', 16384)")
    return [tuple(r) for r in runs]


# Smoke sizes (no GPU, or SMOKE forced): a two-layer toy with Qwen3's structure (GQA, q/k norm, tied
# embeddings) in 0.0008 GiB of "GPU memory", which holds 10 (fp16) or 18 (FP8) sequences, so each curve still runs
# to its ceiling; fp16, since the Triton interpreter's bf16 arithmetic is wrong.
TOY_QWEN = ModelShape("toy-qwen", 2, 4, 2, 32, hidden_size=64, max_position_embeddings=4096, intermediate_size=96,
                      vocab_size=128, tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6, qk_norm=True)


def smoke_settings(on_gpu: bool) -> dict:
    """The decode-step notebook's settings at smoke size: ``runs``, ``gpu_memory_gib``, ``weights``,
    ``kv_dtypes``, ``baseline`` and ``backend`` (the reference on a GPU, the interpreted Triton kernels
    on a CPU)."""
    return {"runs": [(TOY_QWEN, 64)], "gpu_memory_gib": 0.0008, "weights": "random",
            "kv_dtypes": ["fp16", "fp8_e4m3"], "baseline": "fp16", "backend": "reference" if on_gpu else "triton"}

