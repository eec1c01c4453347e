"""A real greedy decode loop whose attention reads a paged FP8 KV cache.

Each layer gets its own :class:`fp8kv.cache.PagedKVCache` (one sequence, shuffled pages).
Prefill writes the prompt's K/V into it (quantizing; static scales fixed from the prompt, a
number, or calibrated per layer) and computes the prompt's attention from the dequantized
cache. Every decode step writes the new token's K/V with :meth:`PagedKVCache.append` and calls
the decode function (``fp8kv.reference.decode`` by default, or any backend with the same call
``decode_fn(q [B, Hq, D], cache, sm_scale=..., **variants) -> out [B, Hq, D] (or (out, lse))``)
for that layer's attention. ``variants`` are the layer's own (:func:`fp8kv.models.attention.attention_variants`:
``window`` on sliding layers, ``soft_cap``, ``sinks``), passed only where the layer has them: the
cache keeps every token and a windowed layer's decode reads only its window, so the loop runs past
the window. The model runs without a transformers cache: one token in, its position given.

The same loop with a bf16 paged cache is the baseline; the two token streams are compared
token by token. Teacher-forcing the generated tokens through :func:`fp8kv.models.run_quantized`
with the same per-layer scales reproduces the loop's logits (up to fp32 summation order), which
is how the loop itself is tested.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..cache import PagedKVCache
from ..formats import kv_dtype_info
from .attention import attention_handler, attention_variants, model_attention
from .introspect import check_positions, num_layers, one_sequence
from .kv_config import check_layer_scales, layer_entry

__all__ = ["greedy_decode_paged", "DecodeResult", "resolve_decode_fn", "decode_backends", "long_prompt_decode"]


def decode_backends(device) -> list[str]:
    """Decode backends to compare on ``device``: the reference, plus on a CUDA device the Triton
    kernel and, where installed and the GPU is supported, FlashInfer."""
    from ..capability import check
    from ..device import resolve_device

    names = ["reference"]
    if resolve_device(device).type == "cuda":  # check() without an arch: this GPU and what is installed
        names += [b for b in ("triton", "flashinfer") if check(b, "fp8_e4m3", "dequant")[0]]
    return names


def resolve_decode_fn(backend: str = "reference", mode: str = "auto", q_dtype: torch.dtype = torch.bfloat16):
    """The decode function of ``backend``: ``"reference"`` (the fp32 oracle, any device) or a backend
    of :func:`fp8kv.decode` (``"auto"``, ``"triton"``, ``"flashinfer"``) with its ``mode``.

    The GPU kernels take 16-bit queries: an fp32 query (an fp32 model) is cast to ``q_dtype`` for
    them (bf16 as in serving engines; fp16 under the Triton interpreter, whose bf16 arithmetic is wrong).
    """
    if q_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"q_dtype={q_dtype}; expected torch.bfloat16 or torch.float16")
    if backend == "reference":
        from ..reference import decode

        return decode
    from ..backends import BACKENDS
    from ..backends import decode as dispatch

    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; expected 'reference', 'auto' or one of {tuple(BACKENDS)}")

    def fn(q, cache, sm_scale=None, **variants):
        q16 = q.to(q_dtype) if q.dtype == torch.float32 else q
        return dispatch(q16, cache, backend=backend, mode=mode, sm_scale=sm_scale, **variants)

    fn.__name__ = f"fp8kv.decode[{backend}, {mode}]"
    return fn


@dataclass
class DecodeResult:
    """Outcome of :func:`greedy_decode_paged`.

    ``tokens``: ids generated with ``kv_dtype``; ``baseline_tokens``: with the baseline cache;
    ``match_fraction``: fraction of positions with identical tokens; ``first_divergence``: index of
    the first differing token (None if all agree; the streams are not comparable after it, since
    each continues its own text); ``saturated``: per layer, elements clamped while writing;
    ``k_scales`` / ``v_scales``: per-layer scales of the FP8 caches; ``logits``: ``[n_new, vocab]``
    fp32 that chose each token (with ``return_logits``), likewise ``baseline_logits``.
    """

    kv_dtype: str
    baseline: str
    backend: str
    prompt_len: int
    tokens: list
    baseline_tokens: list
    saturated: list
    k_scales: list
    v_scales: list
    logits: torch.Tensor | None = field(default=None, repr=False)
    baseline_logits: torch.Tensor | None = field(default=None, repr=False)

    @property
    def match_fraction(self) -> float:
        n = len(self.tokens)
        return sum(a == b for a, b in zip(self.tokens, self.baseline_tokens, strict=True)) / n if n else 1.0

    @property
    def first_divergence(self) -> int | None:
        for i, (a, b) in enumerate(zip(self.tokens, self.baseline_tokens, strict=True)):
            if a != b:
                return i
        return None

    def summary(self) -> dict:
        """Plain columns for result tables."""
        return dict(kv_dtype=self.kv_dtype, baseline=self.baseline, backend=self.backend,
                    prompt_len=self.prompt_len, n_new=len(self.tokens), match_fraction=self.match_fraction,
                    first_divergence=self.first_divergence, saturated=int(sum(self.saturated)))


class _PagedHandler:
    """Attention handler: prefill fills a paged cache per layer; decode steps read it via decode_fn."""

    def __init__(self, kv_dtype, granularity, k_scale, v_scale, block_size, max_len, decode_fn):
        self.kv_dtype, self.granularity = kv_dtype, granularity
        self.k_scale, self.v_scale = k_scale, v_scale
        self.block_size, self.max_len, self.decode_fn = block_size, max_len, decode_fn
        self.caches: dict[int, PagedKVCache] = {}
        self.variants: dict[int, dict] = {}  # per layer, what its decode steps pass to decode_fn

    @staticmethod
    def _layer(spec, layer):
        return layer_entry(spec, "scale", layer)  # lengths were checked against the model on entry

    def __call__(self, module, q, k, v, mask, scaling, kwargs):
        layer = module.layer_idx
        if q.shape[0] != 1:
            raise ValueError(f"greedy_decode_paged runs one sequence; got batch {q.shape[0]}")
        kt, vt = k[0].transpose(0, 1), v[0].transpose(0, 1)  # [T, Hkv, D]
        if layer not in self.caches:  # prefill
            fp8 = kv_dtype_info(self.kv_dtype)[2] is not None
            kw = dict(k_scale=self._layer(self.k_scale, layer), v_scale=self._layer(self.v_scale, layer)) if fp8 else {}
            cache = PagedKVCache.from_dense([kt], [vt], [kt.shape[0]], block_size=self.block_size,
                                            kv_dtype=self.kv_dtype, granularity=self.granularity,
                                            max_seq_len=self.max_len, seed=layer, **kw)
            self.caches[layer] = cache
            self.variants[layer] = attention_variants(module, kwargs)
            kd, vd = cache.gather(0)  # the prompt attends over what the cache holds
            kd = kd.transpose(0, 1)[None].to(q.dtype)
            vd = vd.transpose(0, 1)[None].to(q.dtype)
            return model_attention(module, q, kd, vd, mask, scaling, kwargs)
        if q.shape[2] != 1:
            raise ValueError(f"decode step with {q.shape[2]} query tokens; the loop feeds one token per step")
        cache = self.caches[layer]
        cache.append(kt, vt)
        res = self.decode_fn(q[:, :, 0, :], cache, sm_scale=scaling, **self.variants[layer])
        out = res[0] if isinstance(res, tuple) else res
        return out.to(q.dtype)[:, None], None  # [B, 1, Hq, D], as transformers' attention returns


@torch.no_grad()
def _run(model, prompt, n_new, kv_dtype, granularity, k_scale, v_scale, block_size, decode_fn, keep_logits):
    t = prompt.shape[1]
    handler = _PagedHandler(kv_dtype, granularity, k_scale, v_scale, block_size, t + n_new, decode_fn)
    tokens, logits = [], []
    with attention_handler(model, handler):
        last = model(input_ids=prompt, use_cache=False).logits[0, -1].float()
        for i in range(n_new):
            tokens.append(int(last.argmax()))
            if keep_logits:
                logits.append(last.cpu())
            if i == n_new - 1:
                break
            pos = torch.tensor([[t + i]], device=prompt.device)
            nxt = torch.tensor([[tokens[-1]]], device=prompt.device)
            last = model(input_ids=nxt, position_ids=pos, use_cache=False).logits[0, -1].float()
    n = num_layers(model)
    caches = [handler.caches[i] for i in range(n)]
    return tokens, (torch.stack(logits) if keep_logits else None), caches, [handler.variants[i] for i in range(n)]


def _check_decode_positions(model, prompt, n_new: int) -> None:
    """The prompt and the ``n_new - 1`` generated tokens fed back (the last is only chosen) within the model's
    positions."""
    t = prompt.shape[1]
    check_positions(model, t + n_new - 1, f"prompt_ids of {t} tokens and n_new={n_new} (fed back but the last)")


def greedy_decode_paged(model, prompt_ids, n_new: int, kv_dtype: str = "fp8_e4m3", *, backend: str = "reference",
                        mode: str = "auto", decode_fn=None, granularity: str = "tensor", k_scale=None, v_scale=None,
                        block_size: int = 16, baseline: str = "bf16", return_logits: bool = False) -> DecodeResult:
    """Greedy-decode ``n_new`` tokens twice, with a ``kv_dtype`` and a ``baseline`` paged cache.

    Parameters
    ----------
    model : causal LM from :func:`fp8kv.models.load_model` (batch 1).
    prompt_ids : int64 ``[T]`` or ``[1, T]``, ids within the model's vocabulary.
    n_new : tokens to generate (>= 1); sliding-window layers decode with their window (any length).
    kv_dtype : ``"fp8_e4m3"``, ``"fp8_e5m2"``, ``"bf16"`` or ``"fp16"`` (see ``fp8kv.formats.KV_DTYPES``).
    backend, mode : ``"reference"``, or a backend and mode of ``fp8kv.decode`` (``"triton"``,
        ``"flashinfer"``, ``"auto"``); ignored when ``decode_fn`` is given.
    decode_fn : ``fn(q [1, Hq, D], cache, sm_scale=float, **variants) -> out`` or ``(out, lse)``;
        ``variants`` (``window``, ``soft_cap``, ``sinks``) are passed only to layers that have them.
    granularity, k_scale, v_scale : FP8 cache scales (``PagedKVCache.from_dense``): None = amax of
        the prompt's K/V, a method name, a float, or per-layer lists (e.g. from
        :func:`fp8kv.models.calibrate_scales`, one entry per layer). Static: decode tokens are
        written with them.
    block_size : page size in tokens.
    baseline : kv_dtype of the comparison run (its scales are never needed: 16-bit).
    return_logits : keep the logits that chose each token.
    """
    if not isinstance(n_new, int) or n_new < 1:
        raise ValueError(f"n_new must be a positive int; got {n_new!r}")
    kv_name = kv_dtype_info(kv_dtype)[0]
    base_name = kv_dtype_info(baseline)[0]
    prompt = one_sequence(prompt_ids, model, "prompt_ids")
    _check_decode_positions(model, prompt, n_new)
    # A per-layer list shorter than the layers would fail at its first missing layer, mid-prefill.
    check_layer_scales(model, k_scale=k_scale, v_scale=v_scale)
    fn = decode_fn if decode_fn is not None else resolve_decode_fn(backend, mode)
    label = getattr(fn, "__name__", "custom") if backend != "reference" or decode_fn is not None else backend
    toks, lg, caches, _ = _run(model, prompt, n_new, kv_name, granularity, k_scale, v_scale, block_size, fn,
                               return_logits)
    btoks, blg, _, _ = _run(model, prompt, n_new, base_name, "tensor", None, None, block_size, fn, return_logits)
    return DecodeResult(kv_name, base_name, label, prompt.shape[1], toks, btoks,
                        [c.saturated for c in caches], [c.k_scale.clone() for c in caches],
                        [c.v_scale.clone() for c in caches], lg, blg)


def _describe_windows(variants: list[dict]) -> str:
    """``"window 512 x15, full x3"``: the layers' attention spans, for result tables."""
    from collections import Counter

    counts = Counter(v.get("window") for v in variants)
    parts = [f"window {w} x{n}" for w, n in sorted((w, n) for w, n in counts.items() if w is not None)]
    if counts.get(None):
        parts.append(f"full x{counts[None]}")
    return ", ".join(parts)


@torch.no_grad()
def long_prompt_decode(model, prompt_ids, n_new: int = 32, kv_dtypes=("bf16", "fp8_e4m3"), *,
                       backend: str = "reference", mode: str = "auto", decode_fn=None, granularity: str = "tensor",
                       k_scale=None, v_scale=None, block_size: int = 16):
    """Greedy decode after a long prompt through the paged cache, scored against the model's own attention.

    For each ``kv_dtype`` the loop of :func:`greedy_decode_paged` runs once (every layer's decode
    step reads its paged cache through ``backend``, sliding-window layers with their window, so a
    prompt longer than the window exercises it). The same tokens are then teacher-forced through
    the model with its own attention (transformers' sdpa/eager with its masks, fp32 K/V, no paged
    cache): at each generated position, the KL of the model's next-token distribution to the
    loop's, and whether the loop's greedy token is the model's.

    Parameters
    ----------
    model : causal LM from :func:`fp8kv.models.load_model` (batch 1), e.g. ``"gemma3-270m"``.
    prompt_ids : int64 ``[T]`` or ``[1, T]``, ids within the model's vocabulary (T ~ 2k for
        Gemma-3's 512-token windows).
    n_new : tokens to generate per kv_dtype (>= 1).
    kv_dtypes : caches to run (``"bf16"`` shows what the paged path itself costs, FP8 formats the
        quantization on top).
    backend, mode, decode_fn, granularity, k_scale, v_scale, block_size : as :func:`greedy_decode_paged`.

    Returns
    -------
    pandas DataFrame, one row per kv_dtype: kv_dtype, backend, prompt_len, n_new, layers (window
    spans), top1_agreement (fraction of steps whose token is the model's own greedy choice),
    first_divergence (first step where it is not; None if never), mean_kl and max_kl (nats,
    KL(model's own || paged loop)), saturated (elements clamped writing the FP8 caches).
    """
    import pandas as pd

    from .evaluate import next_token_kl

    if not isinstance(n_new, int) or isinstance(n_new, bool) or n_new < 1:
        raise ValueError(f"n_new must be a positive int; got {n_new!r}")
    if isinstance(kv_dtypes, str):
        kv_dtypes = [kv_dtypes]
    names = [kv_dtype_info(k)[0] for k in kv_dtypes]
    if not names:  # an empty table would read as "nothing to report", not as a mistake
        raise ValueError(f"kv_dtypes={kv_dtypes!r} is empty; give at least one, e.g. ('bf16', 'fp8_e4m3')")
    prompt = one_sequence(prompt_ids, model, "prompt_ids")
    _check_decode_positions(model, prompt, n_new)
    check_layer_scales(model, k_scale=k_scale, v_scale=v_scale)
    t = prompt.shape[1]
    fn = decode_fn if decode_fn is not None else resolve_decode_fn(backend, mode)
    label = getattr(fn, "__name__", "custom") if backend != "reference" or decode_fn is not None else backend
    rows = []
    for kv in names:
        fp8 = kv_dtype_info(kv)[2] is not None
        toks, logits, caches, variants = _run(model, prompt, n_new, kv, granularity if fp8 else "tensor",
                                              k_scale if fp8 else None, v_scale if fp8 else None, block_size,
                                              fn, True)
        forced = torch.cat([prompt, torch.tensor([toks[:-1]], dtype=torch.int64, device=prompt.device)], 1)
        own = model(input_ids=forced, use_cache=False).logits[0, t - 1:].float().cpu()  # [n_new, vocab]
        kl = next_token_kl(own.log_softmax(-1), logits.log_softmax(-1))
        agree = (own.argmax(-1) == torch.tensor(toks)).tolist()
        rows.append(dict(kv_dtype=kv, backend=label, prompt_len=t, n_new=n_new, layers=_describe_windows(variants),
                         top1_agreement=sum(agree) / n_new,
                         first_divergence=next((i for i, a in enumerate(agree) if not a), None),
                         mean_kl=float(kl.mean()), max_kl=float(kl.max()),
                         saturated=int(sum(c.saturated for c in caches))))
    return pd.DataFrame(rows)
