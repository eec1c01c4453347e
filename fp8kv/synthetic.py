"""Synthetic K, V and queries with the structure that matters for FP8 quantization.

Real attention activations are far from i.i.d. Gaussians, and the differences are exactly what
decides which scale granularity works:

* **Key outlier channels.** A few channels of every key head carry a large, mostly constant
  magnitude across tokens (a learned bias), before and after RoPE (KIVI, KVQuant). One scale for
  the whole tensor is then set by those channels, and every other channel gets few FP8 codes.
  Here: ``outlier_channels`` channels per head get a mean of ``±outlier_scale`` plus noise of
  standard deviation ``outlier_scale / 2``; the other channels are standard normal.
* **Per-head magnitude spread.** Heads differ in norm by an order of magnitude. Here each head's
  K (and, independently, V) is multiplied by a factor drawn log-uniformly from
  ``[1/sqrt(head_spread), sqrt(head_spread)]`` (the largest head is at most ``head_spread`` times
  the smallest).
* **Per-token magnitude spread.** Token norms vary too (the first token, the "attention sink",
  is often far off). Each token's K and V vector is multiplied by a log-uniform factor in
  ``[1/sqrt(token_spread), sqrt(token_spread)]``.
* **Heavy-tailed values.** V has no channel outliers (why KIVI quantizes V per token) but
  heavy tails: here Student-t with ``v_tail_df`` degrees of freedom, rescaled to unit variance
  (excess kurtosis ``6 / (df - 4)`` for df > 4, infinite for df <= 4).
* **RoPE.** Keys in a cache are stored after the rotary embedding. With ``rope=True`` token ``t``
  is rotated as in Llama / Hugging Face (``rotate_half`` pairs ``(i, i + D/2)``, angle
  ``t * theta^(-2i/D)``). Outlier channels are then placed on whole rotary pairs among the
  lowest frequencies, as in trained models: the rotation keeps the pair's norm, so the outliers
  stay outliers at any position.

The outlier channels are a function of ``(head_dim, outlier_channels, rope)`` only
(:func:`outlier_channel_indices`), the same for every head, so queries drawn with the same
settings line up with the keys' outlier channels.

Every random number comes from a NumPy generator seeded with ``seed`` (an int >= 0; None, which
would draw fresh entropy on every call, is refused) on the CPU; the tensors are moved to ``device``
at the end, so a seed gives the same values on every device. Values that are not finite in the
requested dtype (scales or spreads too large for it) are a ValueError naming the parameters, never
returned.

:func:`random_paged_cache` is the other kind: a full paged cache of N(0, 1) K/V at benchmark sizes
(gigabytes), generated on the device chunk by chunk with torch's generator (so its values depend
on the device), without a dense copy.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from . import checks
from .cache import LAYOUTS, PagedKVCache, shuffled_block_table
from .device import refuse_past_free_memory
from .formats import kv_dtype_info
from .quant import GRANULARITIES, cast_saturating, reduce_dims, scale_from_stat
from .rope import rope_at_positions as apply_rope  # its name here: synthetic K/Q turned to their positions

__all__ = ["kv_like_llm", "queries_like_llm", "outlier_channel_indices", "apply_rope", "kurtosis",
           "random_paged_cache", "CHUNK_ELEMS", "ragged_kv"]

# The seeds each generator takes: NumPy's SeedSequence any int >= 0; torch.Generator.manual_seed an int of
# checks.GENERATOR_SEEDS (a negative one taken modulo 2**64).
_NUMPY_SEEDS = (0, None)
_TORCH_SEEDS = checks.GENERATOR_SEEDS


def _seed(value, seeds: tuple[int, int | None], generator: str) -> int:
    """``seed`` as an int in ``seeds`` (``(lo, hi)``; hi None: no bound), else a TypeError / ValueError naming it."""
    if value is None:  # NumPy would draw fresh entropy: different tensors on every call, unlike the promise
        checks.fail("seed=None; expected an int (the same seed gives the same tensors; None would give new ones "
                    "on every call)", TypeError)
    seed = checks.integer(value, "seed")
    lo, hi = seeds
    if seed < lo or (hi is not None and seed > hi):
        checks.fail(f"seed={seed}; expected an int {f'in [{lo}, {hi}]' if hi is not None else f'>= {lo}'} "
                    f"(what {generator} takes)")
    return seed


def _finite_as(x: torch.Tensor, dtype: torch.dtype, what: str, params: str) -> torch.Tensor:
    """``x`` (computed in fp32) cast to ``dtype``, or a ValueError naming ``params`` if a value is not finite there:
    a scale or spread too large for the dtype gives inf (and NaN after RoPE), which must not be returned."""
    y = x.to(dtype)
    bad = ~torch.isfinite(y)
    if bool(bad.any()):
        name = str(dtype).replace("torch.", "")
        limit = min(checks.FP32_MAX, torch.finfo(dtype).max)  # computed in fp32: float64 holds no more
        checks.fail(f"{what}: {int(bad.sum())} of {y.numel()} generated values are not finite in {name} (computed "
                    f"in float32; |values| must stay within {limit:.4g}) with {params}; make them smaller or ask "
                    "for a wider dtype")
    return y


def _check_common(head_dim: int, dtype, rope: bool) -> None:
    checks.flag(rope, "rope")
    if dtype not in checks.FLOAT_DTYPES:
        raise TypeError(f"dtype={dtype!r} must be one of {checks.FLOAT_DTYPES}")
    if rope and head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be even with rope=True (RoPE rotates channel pairs)")


def outlier_channel_indices(head_dim: int, outlier_channels: int, rope: bool = True) -> torch.Tensor:
    """The key outlier channels used by :func:`kv_like_llm` (int64, sorted).

    With ``rope=True`` they come in rotary pairs ``(i, i + D/2)``, taking every other pair from
    the lowest frequency (``i = D/2 - 1, D/2 - 3, ...``); ``outlier_channels`` must then be even.
    Without RoPE they are spread evenly over the head (``linspace``).
    """
    head_dim = checks.positive_int(head_dim, "head_dim")
    rope = checks.flag(rope, "rope")
    if isinstance(outlier_channels, bool) or not isinstance(outlier_channels, (int, np.integer)) \
            or outlier_channels < 0:
        raise ValueError(f"outlier_channels={outlier_channels!r} must be a non-negative int")
    n = int(outlier_channels)
    if n == 0:
        return torch.zeros(0, dtype=torch.int64)
    if not rope:
        if n > head_dim:
            raise ValueError(f"outlier_channels={n} exceeds head_dim={head_dim}")
        return torch.from_numpy(np.unique(np.linspace(0, head_dim - 1, n).round().astype(np.int64)))
    half = head_dim // 2
    if n % 2 or n // 2 > (half + 1) // 2:
        raise ValueError(f"outlier_channels={n} must be even with rope=True (outliers sit on rotary pairs) "
                         f"and at most {2 * ((half + 1) // 2)} for head_dim={head_dim}")
    pairs = [half - 1 - 2 * j for j in range(n // 2)]
    return torch.tensor(sorted(pairs + [p + half for p in pairs]), dtype=torch.int64)


def _log_uniform(rng: np.random.Generator, n: int, spread: float) -> np.ndarray:
    """n factors log-uniform in [1/sqrt(spread), sqrt(spread)] (all 1 for spread == 1)."""
    half = 0.5 * math.log(spread)
    return np.exp(rng.uniform(-half, half, size=n)).astype(np.float32)


def kv_like_llm(num_tokens: int, num_kv_heads: int, head_dim: int, *, seed: int = 0, device="cpu",
                dtype: torch.dtype = torch.float32, outlier_channels: int = 4, outlier_scale: float = 6.0,
                head_spread: float = 3.0, token_spread: float = 1.5, v_tail_df: float = 5.0,
                v_mean: float = 0.5, rope: bool = True, rope_theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one sequence, shaped like a KV cache: ``k, v`` ``[num_tokens, num_kv_heads, head_dim]``.

    Parameters
    ----------
    num_tokens, num_kv_heads, head_dim : sizes (positive ints; head_dim even with ``rope``).
    seed : NumPy seed, an int >= 0; the same seed gives the same tensors on every device.
    device, dtype : where (``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"meta"`` or a torch.device:
        :func:`fp8kv.checks.device`) and in which float dtype the tensors are returned (computed in fp32;
        a value that is not finite in ``dtype`` is a ValueError naming the scales and spreads).
    outlier_channels : key channels per head with a large constant magnitude (0 for none);
        even with ``rope`` (see :func:`outlier_channel_indices`).
    outlier_scale : their mean magnitude relative to the unit-variance ordinary channels (> 0).
    head_spread : max/min ratio of the per-head magnitude factors (>= 1; 1 for none).
    token_spread : max/min ratio of the per-token magnitude factors (>= 1; 1 for none).
    v_tail_df : Student-t degrees of freedom of V (> 2; smaller is heavier-tailed).
    v_mean : standard deviation of V's per-(head, channel) mean, relative to its unit-variance
        noise (>= 0). Real values carry such a bias (their mean vector's norm is about half their
        RMS norm); it is what the attention output mostly consists of.
    rope, rope_theta : rotate the keys by RoPE at positions ``0 .. num_tokens - 1``.

    Returns
    -------
    (k, v) : two tensors ``[num_tokens, num_kv_heads, head_dim]`` of ``dtype`` on ``device``.
    """
    t = checks.positive_int(num_tokens, "num_tokens")
    h = checks.positive_int(num_kv_heads, "num_kv_heads")
    d = checks.positive_int(head_dim, "head_dim")
    _check_common(d, dtype, rope)
    seed = _seed(seed, _NUMPY_SEEDS, "NumPy's default_rng")
    device = checks.device(device)  # here, not in .to() at the end: "cuda" without a GPU, 7, ... by name
    scale = checks.positive_float(outlier_scale, "outlier_scale")
    head_spread = checks.real(head_spread, "head_spread", minimum=1.0)
    token_spread = checks.real(token_spread, "token_spread", minimum=1.0)
    df = checks.real(v_tail_df, "v_tail_df", minimum=2.0, inclusive=False)
    v_mean = checks.real(v_mean, "v_mean", minimum=0.0)
    rope_theta = checks.real(rope_theta, "rope_theta", minimum=1.0, inclusive=False)
    channels = outlier_channel_indices(d, outlier_channels, rope).numpy()
    # on the host at the peak: fp32 K, V drawn in fp64 and its fp32 copy (16 bytes an element)
    refuse_past_free_memory(16 * t * h * d, torch.device("cpu"), f"num_tokens={t} x num_kv_heads={h} x head_dim={d}")

    rng = np.random.default_rng(seed)
    # Draw order is fixed (it defines what a seed means): K noise, outlier signs, outlier noise,
    # head factors K, head factors V, token factors, V noise, V mean.
    with np.errstate(over="ignore", invalid="ignore"):  # overflow becomes inf, refused by name below
        k = rng.standard_normal((t, h, d), dtype=np.float32)
        n_out = len(channels)
        if n_out:
            signs = rng.choice(np.array([-1.0, 1.0], dtype=np.float32), size=(h, n_out))
            noise = rng.standard_normal((t, h, n_out), dtype=np.float32)
            k[:, :, channels] = scale * (signs[None] + 0.5 * noise)
        k *= _log_uniform(rng, h, head_spread)[None, :, None]
        v_head = _log_uniform(rng, h, head_spread)
        tok = _log_uniform(rng, t, token_spread)
        k *= tok[:, None, None]
        v = rng.standard_t(df, size=(t, h, d)).astype(np.float32) * np.float32(math.sqrt((df - 2.0) / df))
        v += np.float32(v_mean) * rng.standard_normal((1, h, d), dtype=np.float32)
        v *= v_head[None, :, None] * tok[:, None, None]

    k_t = torch.from_numpy(k)
    if rope:
        k_t = apply_rope(k_t, torch.arange(t), rope_theta)
    spreads = f"head_spread={head_spread:g}, token_spread={token_spread:g}"
    k_t = _finite_as(k_t, dtype, "kv_like_llm keys", f"outlier_scale={scale:g}, {spreads}")
    v_t = _finite_as(torch.from_numpy(v), dtype, "kv_like_llm values",
                     f"{spreads}, v_tail_df={df:g}, v_mean={v_mean:g}")
    return k_t.to(device), v_t.to(device)


def queries_like_llm(num_queries: int, num_q_heads: int, head_dim: int, *, seed: int = 1, device="cpu",
                     dtype: torch.dtype = torch.float32, outlier_channels: int = 4, outlier_scale: float = 1.0,
                     head_spread: float = 3.0, query_scale: float = 1.5, position=None,
                     rope_theta: float = 10000.0) -> torch.Tensor:
    """Decode queries ``[num_queries, num_q_heads, head_dim]`` to attend to :func:`kv_like_llm` keys.

    Normal with standard deviation ``query_scale`` per channel, times a log-uniform per-head
    factor (``head_spread``); the channels of :func:`outlier_channel_indices` (same
    ``outlier_channels`` and RoPE choice as the keys) get ``outlier_scale`` times more (default 1:
    the keys alone carry the outliers). ``query_scale`` sets how peaked attention is (the logits'
    spread grows with it; the default gives logits of standard deviation about 2 and a largest
    attention weight of 0.1-0.2 over 2k tokens, as in a small real model's middle layers).

    Parameters
    ----------
    num_queries : query vectors (each one a decode step's query, attending to the whole context).
    position : None (no rotation), an int (every query at that position, e.g. the context length
        for the next decode step) or a sequence of ``num_queries`` ints, in ``[0, MAX_POSITION]``.
        Rotating implies RoPE-placed outlier channels (rotary pairs), as for keys with ``rope=True``.
    seed : NumPy seed, an int >= 0 (default 1, so default queries differ from default keys' noise).
    device, dtype : as for :func:`kv_like_llm` (a value not finite in ``dtype`` is a ValueError).

    Returns
    -------
    q : ``[num_queries, num_q_heads, head_dim]`` of ``dtype`` on ``device``.
    """
    n = checks.positive_int(num_queries, "num_queries")
    hq = checks.positive_int(num_q_heads, "num_q_heads")
    d = checks.positive_int(head_dim, "head_dim")
    rope = position is not None
    _check_common(d, dtype, rope)
    seed = _seed(seed, _NUMPY_SEEDS, "NumPy's default_rng")
    device = checks.device(device)
    scale = checks.positive_float(outlier_scale, "outlier_scale")
    head_spread = checks.real(head_spread, "head_spread", minimum=1.0)
    query_scale = checks.positive_float(query_scale, "query_scale")
    rope_theta = checks.real(rope_theta, "rope_theta", minimum=1.0, inclusive=False)
    channels = outlier_channel_indices(d, outlier_channels, rope).numpy()
    if rope:
        pos = _positions(position, n)
    # on the host at the peak: fp32 queries and their fp32 copy (8 bytes an element)
    refuse_past_free_memory(8 * n * hq * d, torch.device("cpu"), f"num_queries={n} x num_q_heads={hq} x head_dim={d}")

    rng = np.random.default_rng(seed)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow becomes inf, refused by name below
        q = rng.standard_normal((n, hq, d), dtype=np.float32)
        q[:, :, channels] *= np.float32(scale)
        q *= _log_uniform(rng, hq, head_spread)[None, :, None] * np.float32(query_scale)
    q_t = torch.from_numpy(q)
    if rope:
        q_t = apply_rope(q_t, torch.from_numpy(pos), rope_theta)
    q_t = _finite_as(q_t, dtype, "queries_like_llm",
                     f"outlier_scale={scale:g}, head_spread={head_spread:g}, query_scale={query_scale:g}")
    return q_t.to(device)


MAX_POSITION = 2**31 - 1  # the largest token position: seq_lens are int32


def _positions(position, n: int) -> np.ndarray:
    """``position`` (an int, or ``n`` of them) as ``n`` float64 positions, each an int in ``[0, MAX_POSITION]``.
    A float (2.5, NaN) is no token's position; a string or bool is not one either (NumPy would convert "5")."""
    what = f"expected an int or a sequence of {n} ints (token positions in [0, {MAX_POSITION}])"
    if isinstance(position, (str, bytes, bool)):
        checks.fail(f"position={checks.show_value(position)} ({type(position).__name__}); {what}", TypeError)
    try:
        pos = np.asarray(position)
    except (TypeError, ValueError, RuntimeError):  # ragged lists, unconvertible objects
        pos = None
    if pos is None or pos.dtype.kind not in "iu":  # floats (2.5 is no token), bools ("b"), strings, objects
        checks.fail(f"position={checks.show_value(position)} is not an int or a list of ints; {what}", TypeError)
    pos = pos.astype(np.float64)
    if pos.ndim == 0:
        pos = np.full(n, float(pos))
    if pos.shape != (n,):
        raise ValueError(f"position must be an int or {n} positions; got shape {pos.shape}")
    if (pos > MAX_POSITION).any():
        i = int(np.flatnonzero(pos > MAX_POSITION)[0])
        checks.fail(f"position[{i}]={int(pos[i])} is past {MAX_POSITION} (int32 positions, as seq_lens); {what}")
    if (pos < 0).any():
        raise ValueError(f"position must be >= 0; got min {pos.min()}")
    return pos


def kurtosis(x: torch.Tensor, dim=None) -> torch.Tensor | float:
    """Sample kurtosis ``E[(x - mean)^4] / Var(x)^2`` (3 for a Gaussian), in fp64.

    ``dim=None``: of all elements, returned as a float; otherwise along ``dim``, as a tensor. NaN where the values
    are all equal (zero variance: the ratio is 0 / 0, undefined, and no number would be right).
    """
    checks.readable_tensor(checks.tensor(x, "x", dtypes=checks.FLOAT_DTYPES), "x")
    if dim is not None:
        dim = checks.integer(dim, "dim", minimum=-max(x.ndim, 1), maximum=max(x.ndim, 1) - 1)
    xf = x.detach().to(torch.float64)
    if dim is None:
        c = xf.reshape(-1) - xf.mean()
        return float((c**4).mean() / (c**2).mean() ** 2)
    c = xf - xf.mean(dim=dim, keepdim=True)
    return (c**4).mean(dim=dim) / (c**2).mean(dim=dim) ** 2


# ------------------------------------------------------------------------------- a ragged test batch
def ragged_kv(seq_lens, num_kv_heads: int, head_dim: int, *, seed: int = 0,
              head_spread: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense K, V ``[B, max(seq_lens), Hkv, D]`` fp32 on the CPU for :meth:`PagedKVCache.from_dense`:
    standard normal (K drawn first, then V, from one torch generator seeded with ``seed``) and, with
    ``head_spread``, K's heads scaled log-evenly over ``[10^-0.5, 10^0.5]`` and channel 1 six times
    larger (an outlier channel, as real keys have), so the scale granularities differ. The backend
    matrix and the kernel tests check decode on this data. ``seed``: an int in
    :data:`fp8kv.checks.GENERATOR_SEEDS` (what ``torch.Generator.manual_seed`` takes)."""
    if isinstance(seq_lens, (str, bytes)) or not hasattr(seq_lens, "__iter__"):
        checks.fail(f"seq_lens={checks.show_value(seq_lens)} ({type(seq_lens).__name__}); expected a list of ints, "
                    "one length per sequence", TypeError)
    lens = [checks.nonnegative_int(n, f"seq_lens[{i}]") for i, n in enumerate(seq_lens)]
    if not lens or max(lens) < 1:
        checks.fail(f"seq_lens={lens}; expected at least one sequence holding a token")
    h = checks.positive_int(num_kv_heads, "num_kv_heads")
    d = checks.positive_int(head_dim, "head_dim")
    head_spread = checks.flag(head_spread, "head_spread")
    refuse_past_free_memory(2 * len(lens) * max(lens) * h * d * 4, torch.device("cpu"),  # K and V, fp32
                            f"seq_lens (max {max(lens)}, {len(lens)} sequences) x num_kv_heads={h} x head_dim={d}")
    g = torch.Generator().manual_seed(_seed(seed, _TORCH_SEEDS, "torch.Generator.manual_seed"))
    k = torch.randn(len(lens), max(lens), h, d, generator=g)
    v = torch.randn(len(lens), max(lens), h, d, generator=g)
    if head_spread:
        k = k * torch.logspace(-0.5, 0.5, h)[None, None, :, None]
        k[..., min(1, d - 1)] *= 6.0
    return k, v


# ------------------------------------------------------------------------------- a full paged cache
CHUNK_ELEMS = 2**26  # fp32 workspace per generation chunk (256 MiB)


def _chunk_randn(shape, seed: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32)


def random_paged_cache(batch: int, context: int, num_kv_heads: int, head_dim: int, *, block_size: int = 16,
                       kv_dtype: str = "bf16", granularity: str = "tensor", layout: str = "NHD", device=None,
                       seed: int = 0, chunk_elems: int = CHUNK_ELEMS) -> PagedKVCache:
    """A full paged cache of N(0, 1) K/V, built on the device without a dense copy.

    Every sequence holds ``context`` tokens; pages are assigned through a shuffled block table
    (as a serving engine's allocator would leave them). FP8 caches use amax scales computed from
    the generated data (tensor / head / channel: a first pass over the chunks finds the amax, a
    second regenerates each chunk from its seed and quantizes it; token_head: one pass), following
    ``fp8kv.quant`` (stored = Q(x / scale)). Memory: the pages plus one fp32 chunk of
    ``chunk_elems`` elements.

    ``device``: None / "auto" (the GPU if there is one), "cpu", "cuda", ... (:func:`fp8kv.device.resolve_device`).
    ``seed``: an int in :data:`fp8kv.checks.GENERATOR_SEEDS` (what ``torch.Generator.manual_seed`` takes); each chunk's generator
    is seeded from it (modulo 2**64, as torch takes a negative seed), and the shuffled block table with it.
    Returns a :class:`~fp8kv.cache.PagedKVCache` (through its validating constructor) with
    ``seq_lens = [context] * batch``; K, V pages ``[blocks, block_size, Hkv, D]`` (NHD) or
    ``[blocks, Hkv, block_size, D]`` (HND) of ``kv_dtype``.
    """
    from .device import resolve_device

    seed = _seed(seed, _TORCH_SEEDS, "torch.Generator.manual_seed")
    name, dtype, fmt = kv_dtype_info(kv_dtype)
    dev = resolve_device(device)
    checks.one_of(granularity, "granularity", GRANULARITIES)
    checks.one_of(layout, "layout", LAYOUTS)
    for n, v in (("batch", batch), ("context", context), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                 ("block_size", block_size), ("chunk_elems", chunk_elems)):
        checks.positive_int(v, n)
    if fmt is None and granularity != "tensor":  # 16-bit pages carry no scales
        checks.fail(f"granularity={granularity!r} with kv_dtype={kv_dtype!r}: a 16-bit cache has no scales; pass "
                    "granularity='tensor' or an FP8 kv_dtype")
    bpseq = math.ceil(context / block_size)
    num_blocks = batch * bpseq
    elem = torch.empty((), dtype=dtype).element_size()
    # K and V pages, a scale as large as the pages' tokens x heads, the block table and one fp32 chunk
    nbytes = num_blocks * block_size * num_kv_heads * (2 * head_dim * elem + 8) + 12 * num_blocks \
        + 4 * min(chunk_elems, num_blocks * block_size * num_kv_heads * head_dim)
    refuse_past_free_memory(nbytes, dev, f"batch={batch} x context={context} tokens x num_kv_heads={num_kv_heads} x "
                                         f"head_dim={head_dim} of {name}")
    block_table = shuffled_block_table(num_blocks, batch, bpseq, seed, dev)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    token_shape = (block_size, num_kv_heads, head_dim)
    shape = (num_blocks, *token_shape) if layout == "NHD" else (num_blocks, num_kv_heads, block_size, head_dim)
    per_block = block_size * num_kv_heads * head_dim
    step = max(1, chunk_elems // per_block)
    chunks = [(i, min(i + step, num_blocks)) for i in range(0, num_blocks, step)]

    def put(pages, i0, i1, x):
        pages[i0:i1] = x if layout == "NHD" else x.transpose(1, 2)

    pages_scales = []
    for which in (0, 1):  # K, V: independent streams
        # modulo 2**64: torch takes seeds below 2**64 (a negative one modulo 2**64 already, so every seed whose
        # chunk seeds fitted keeps its values), and a large seed times 1_000_003 would not fit
        parts = [(i0, i1, (seed * 1_000_003 + which * 500_001 + j) % 2**64) for j, (i0, i1) in enumerate(chunks)]
        pages = torch.empty(shape, dtype=dtype, device=dev)
        scale = None
        if fmt is None:
            for i0, i1, s in parts:
                put(pages, i0, i1, _chunk_randn((i1 - i0, *token_shape), s, dev).to(dtype))
        elif granularity == "token_head":
            scale = torch.empty(num_blocks, block_size, num_kv_heads, dtype=torch.float32, device=dev)
            for i0, i1, s in parts:
                x = _chunk_randn((i1 - i0, *token_shape), s, dev)
                sc = scale_from_stat(x.abs().amax(dim=reduce_dims(x.ndim, "token_head")), fmt.max)
                scale[i0:i1] = sc
                put(pages, i0, i1, cast_saturating(x / sc.unsqueeze(-1), fmt)[0])
        else:
            dims = reduce_dims(len(token_shape) + 1, granularity)  # over [blocks, block_size, Hkv, D] chunks
            amax = None
            for i0, i1, s in parts:
                a = _chunk_randn((i1 - i0, *token_shape), s, dev).abs().amax(dim=dims)
                amax = a if amax is None else torch.maximum(amax, a)
            scale = scale_from_stat(amax, fmt.max)
            bscale = scale.reshape({"tensor": (), "head": (num_kv_heads, 1), "channel": (num_kv_heads, head_dim)}
                                   [granularity])
            for i0, i1, s in parts:
                put(pages, i0, i1, cast_saturating(_chunk_randn((i1 - i0, *token_shape), s, dev) / bscale, fmt)[0])
        pages_scales.append((pages, scale))
    (k_pages, k_scale), (v_pages, v_scale) = pages_scales
    return PagedKVCache(k_pages, v_pages, block_table, seq_lens, name, granularity, k_scale, v_scale, layout)
