"""The KV storage formats, as data: one home for each fact (code width, packing, scales, zero points, bytes).

A :class:`Codec` stores one tensor ``[..., H, D]`` (K or V; leading dims index tokens); a
:class:`KVFormat` pairs the codec of K with the codec of V (the same one but for KIVI).

================== ========= ============================== =========== ============ ======== =========
codec              codes     scale shared by                scale dtype zero point   tensor   D=128:
                                                                                      scale    B/tok/head
================== ========= ============================== =========== ============ ======== =========
int8_tensor        int8      the whole tensor               fp32        --           --       128 (+4)
int8_token_head    int8      one token's head (D values)    fp32        --           --       132
int4_token_head    int4 x2   one token's head (D values)    fp32        --           --       68
kivi4_key_g{G}     uint4 x2  one channel over G tokens      fp16        fp16         --       64 + 4D/G
kivi4_value_g{G}   uint4 x2  G consecutive channels         fp16        fp16         --       64 + 4D/G
nvfp4              e2m1 x2   16 consecutive channels        e4m3        --           fp32     72 (+4)
mxfp4              e2m1 x2   32 consecutive channels        e8m0        --           --       68
e4m3_b16           e4m3      16 consecutive channels        e4m3        --           fp32     136 (+4)
e4m3_b32 (MXFP8)   e4m3      32 consecutive channels        e8m0        --           --       132
fp8_{fmt}_{gran}   fp8       as fp8kv.quant's granularity   fp32        --           --       128 (+...)
================== ========= ============================== =========== ============ ======== =========

"x2": two codes per byte (:mod:`.packing`). G is 32, 64 or 128 (:data:`KIVI_GROUPS`).
Conventions and their sources:

* int8 / int4 symmetric: ``scale = amax / qmax`` (127, 7; the most negative code unused), fp32
  scales as fp8kv.quant and vLLM's ``k_scale`` / ``v_scale`` keep them.
* KIVI (Liu et al. 2024, arXiv:2402.02750, and its reference code): asymmetric,
  ``z = min``, ``s = (max - min) / 15``, code ``round((x - z) / s)``; K per channel over groups of G
  tokens, V per token over groups of G channels; scale and zero point in fp16 (the model's dtype).
* NVFP4 (NVIDIA's two-level scaling, as TensorRT Model Optimizer and torchao's NVFP4Tensor do it):
  ``tensor_scale = amax / (448 x 6)``, block scale ``e4m3(clamp(block_amax / 6 / tensor_scale, 2^-6,
  448))``, codes ``e2m1(x / fp32(block_scale x tensor_scale))``, round-to-nearest-even.
* MXFP4 / MXFP8 (OCP Microscaling Formats v1.0, section 6.3): ``X = 2^(floor(log2(amax)) - emax_elem)``,
  emax_elem 2 for e2m1 and 8 for e4m3, stored as e8m0; scaled values beyond the element's max clamp.
* e4m3_b16: NVFP4's scaling with e4m3 codes, beside MXFP8 (e4m3_b32): the FP8 reference point at the
  block sizes of NVFP4 and MXFP4.
* fp8_*: fp8kv.quant itself (:func:`fp8kv.quant.quantize`), so every format is compared on one footing.

Saturation by design: OCP MX puts a block's amax in [2^emax, 2^(emax+1)) x X, so MXFP4 clamps scaled
values in [7, 8) to 6 and MXFP8 those in (464, 512) to 448; e4m3_b16's block scale, rounded to nearest
e4m3, can sit up to 1/16 below amax / 448 and clamp the block's largest values (up to 476) to 448. These
are counted in ``saturated``, as every value that rounds past the largest code is. NVFP4 does not
saturate with scales from the data: its top code 6 takes values up to the tie 7.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch

from .. import checks
from ..quant import GRANULARITIES, SCALE_BYTES
from .elements import ELEMENTS, Element

__all__ = ["Codec", "KVFormat", "Footprint", "CODECS", "KV_FORMATS", "KV_FORMAT_NAMES", "CODEC_NAMES",
           "KIVI_GROUPS", "SCALINGS", "RULES", "codec", "kv_format", "kivi", "footprint", "kv_footprint",
           "holding_formats", "summary_table"]

KIVI_GROUPS = (32, 64, 128)
# How values share a scale: fp8kv.quant's granularities, plus KIVI's keys (a channel over a group of
# tokens along dim -3) and blocks of consecutive channels along head_dim.
SCALINGS = (*GRANULARITIES, "channel_group", "block")
# How a scale is chosen: symmetric amax / max; asymmetric min / max with a zero point; NVFP4's two
# levels; OCP MX's power of two; fp8kv.quant's own (the fp8 reference formats).
RULES = ("amax", "min_max", "two_level", "pow2", "fp8")


@dataclass(frozen=True)
class Codec:
    """How one tensor ``[..., H, D]`` is stored.

    ``element``: the code (:data:`.elements.ELEMENTS`); ``scaling``: which values share a scale
    (:data:`SCALINGS`); ``block``: how many share it along head_dim (``block``) or along tokens
    (``channel_group``), else None; ``scale_dtype``: how the scales are stored; ``zero_point``:
    asymmetric, with zero points of ``scale_dtype`` shaped as the scales; ``tensor_scale``: a second,
    fp32 per-tensor level (NVFP4); ``rule``: how scales are chosen (:data:`RULES`).
    """

    name: str
    element: Element
    scaling: str
    block: int | None
    scale_dtype: torch.dtype
    rule: str
    zero_point: bool = False
    tensor_scale: bool = False
    description: str = ""

    @property
    def bits(self) -> int:
        return self.element.bits

    @property
    def packed(self) -> bool:
        """Two codes per byte (4-bit elements): codes ``[..., H, D // 2]`` uint8."""
        return self.element.bits == 4

    @property
    def code_dtype(self) -> torch.dtype:
        """dtype of the stored codes: uint8 when packed, else int8 or the fp8 dtype."""
        if self.packed:
            return torch.uint8
        return {"int8": torch.int8, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[self.element.name]

    @property
    def scale_bytes(self) -> int:
        return torch.empty((), dtype=self.scale_dtype).element_size()

    def check_shape(self, shape: tuple, name: str = "x") -> None:
        """Refuse a shape ``[..., H, D]`` this codec cannot store, naming ``name`` and what it needs."""
        shape = tuple(shape)
        need = 3 if self.scaling == "channel_group" else 2
        if len(shape) < need:
            dims = "[..., tokens, heads, head_dim]" if need == 3 else "[..., heads, head_dim]"
            raise ValueError(f"{name} must have at least {need} dims {dims} for codec {self.name!r}; got shape {shape}")
        d = shape[-1]
        if d < 1:
            raise ValueError(f"{name} has head_dim {d} (shape {shape}); expected head_dim >= 1")
        if self.scaling == "block" and d % self.block:
            raise ValueError(f"{name} has head_dim {d} (shape {shape}); codec {self.name!r} needs a head_dim that is a "
                             f"multiple of its block size {self.block}")
        if self.packed and d % 2:
            raise ValueError(f"{name} has head_dim {d} (shape {shape}); codec {self.name!r} packs two 4-bit codes "
                             "per byte and needs an even head_dim")
        if self.scaling == "channel_group" and shape[-3] % self.block:
            raise ValueError(f"{name} has {shape[-3]} tokens along dim -3 (shape {shape}); codec {self.name!r} "
                             f"groups keys over {self.block} tokens and needs a multiple of {self.block} (keep "
                             "the remainder unquantized until its group is full, as KIVI does)")

    def code_shape(self, shape: tuple) -> tuple:
        """Shape of the stored codes for data of ``shape``."""
        shape = tuple(shape)
        return (*shape[:-1], shape[-1] // 2) if self.packed else shape

    def scale_shape(self, shape: tuple) -> tuple:
        """Shape of the scales (and zero points) for data of ``shape`` ``[..., H, D]``."""
        shape = tuple(shape)
        if self.scaling == "channel_group":  # only this rule reads dim -3 (2-D data is [H, D] for the others)
            return (*shape[:-3], shape[-3] // self.block, *shape[-2:])
        return {
            "tensor": (),
            "head": shape[-2:-1],
            "token_head": shape[:-1],
            "channel": shape[-2:],
            "block": (*shape[:-1], shape[-1] // (self.block or 1)),
        }[self.scaling]


@dataclass(frozen=True)
class KVFormat:
    """A KV-cache storage format: the codec of K and the codec of V."""

    name: str
    key: Codec
    value: Codec
    description: str = ""

    @property
    def codecs(self) -> tuple[Codec, Codec]:
        return self.key, self.value


@dataclass(frozen=True)
class Footprint:
    """Bytes of a stored tensor (or cache): ``per_token`` with each token (codes, per-token and grouped
    scales, zero points; exact, a Fraction when a group spans tokens) and ``fixed`` held once whatever
    the length (per-tensor / per-head / per-channel scales). ``codes`` is the part of ``per_token`` that is
    codes; the rest, :attr:`per_token_scales`, is scales and zero points."""

    per_token: Fraction
    fixed: int
    codes: Fraction = Fraction(0)
    token_group: int = 1  # tokens a scale spans (a KIVI key's group): counts are whole groups

    @property
    def per_token_scales(self) -> Fraction:
        """Bytes of scales and zero points stored with each token (``per_token - codes``)."""
        return self.per_token - self.codes

    def nbytes(self, tokens: int) -> int:
        """Exact bytes for ``tokens`` tokens, whole groups of :attr:`token_group` (a ValueError naming them otherwise)."""
        tokens = checks.nonnegative_int(tokens, "tokens")
        total = self.per_token * tokens + self.fixed
        if tokens % self.token_group or total.denominator != 1:
            raise ValueError(f"tokens={tokens} does not fill whole token groups (a scale spans {self.token_group} "
                             f"tokens): {total} bytes counts part of a group")
        return int(total)

    def __add__(self, other: Footprint) -> Footprint:
        if not isinstance(other, Footprint):
            raise TypeError(f"Footprint + {checks.show_value(other)} ({type(other).__name__}); expected a Footprint")
        return Footprint(self.per_token + other.per_token, self.fixed + other.fixed, self.codes + other.codes,
                         math.lcm(self.token_group, other.token_group))

    def __mul__(self, n: int) -> Footprint:
        """The bytes of ``n`` such tensors (layers): ``n`` an int >= 1 (bytes are whole and not negative)."""
        n = checks.positive_int(n, "Footprint * n")
        return Footprint(self.per_token * n, self.fixed * n, self.codes * n, self.token_group)


def footprint(c: Codec | str, num_heads: int, head_dim: int) -> Footprint:
    """Bytes of one tensor ``[tokens, num_heads, head_dim]`` stored with codec ``c``: the one place
    storage is counted (codes + scales + zero points + a tensor scale). ``head_dim`` must suit the codec."""
    c = codec(c)
    num_heads, head_dim = checks.positive_int(num_heads, "num_heads"), checks.positive_int(head_dim, "head_dim")
    c.check_shape((c.block or 1, num_heads, head_dim), "shape")
    h, d = num_heads, head_dim
    codes = Fraction(h * d * c.bits, 8)
    per_scale = c.scale_bytes * (2 if c.zero_point else 1)
    per_token_scales = {"token_head": h, "block": Fraction(h * d, c.block or 1),
                        "channel_group": Fraction(h * d, c.block or 1)}.get(c.scaling, 0)
    fixed_scales = {"tensor": 1, "head": h, "channel": h * d}.get(c.scaling, 0)
    fixed = fixed_scales * per_scale + (SCALE_BYTES if c.tensor_scale else 0)
    return Footprint(codes + per_token_scales * per_scale, fixed, codes,
                     c.block if c.scaling == "channel_group" else 1)


def kv_footprint(fmt: KVFormat | str, *, num_kv_heads: int, head_dim: int, num_layers: int = 1) -> Footprint:
    """Bytes of a KV cache (K and V of ``num_layers`` layers) in format ``fmt``."""
    f = kv_format(fmt)
    num_kv_heads = checks.positive_int(num_kv_heads, "num_kv_heads")  # named as given here, not as footprint's
    num_layers = checks.positive_int(num_layers, "num_layers")
    return (footprint(f.key, num_kv_heads, head_dim) + footprint(f.value, num_kv_heads, head_dim)) * num_layers


def holding_formats(formats, *, num_kv_heads: int, head_dim: int) -> list[str]:
    """The names (canonical) among ``formats`` whose codecs can store ``num_kv_heads`` heads of ``head_dim`` (blocks
    that divide it, an even head_dim for 4-bit codes: :func:`kv_footprint` accepts the shape), in the order given.
    An unknown name is refused (ValueError), not left out; so is a format named twice (an alias or another case
    of a name counts as that name)."""
    num_kv_heads = checks.positive_int(num_kv_heads, "num_kv_heads")
    head_dim = checks.positive_int(head_dim, "head_dim")
    given = checks.listed(formats, "formats", "KV format names")
    fmts = [kv_format(f) for f in given]
    names = [f.name for f in fmts]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"formats={checks.show_value(given)} names {twice} more than once; expected each format once")
    out = []
    for f in fmts:
        try:
            kv_footprint(f, num_kv_heads=num_kv_heads, head_dim=head_dim)
        except ValueError:
            continue
        out.append(f.name)
    return out


def _fp8_codecs() -> list[Codec]:
    out = []
    for fmt in ("e4m3", "e5m2"):
        for gran in GRANULARITIES:
            out.append(Codec(f"fp8_{fmt}_{gran}", ELEMENTS[fmt], gran, None, torch.float32, "fp8",
                             description=f"fp8kv.quant: {fmt}, one fp32 scale per {gran.replace('_', ' x ')}"))
    return out


def _kivi_codecs(g: int) -> tuple[Codec, Codec]:
    u4 = ELEMENTS["uint4"]
    return (Codec(f"kivi4_key_g{g}", u4, "channel_group", g, torch.float16, "min_max", zero_point=True,
                  description=f"KIVI keys: asymmetric 4-bit, per channel over {g} tokens, fp16 scale and zero point"),
            Codec(f"kivi4_value_g{g}", u4, "block", g, torch.float16, "min_max", zero_point=True,
                  description=f"KIVI values: asymmetric 4-bit, per token over {g} channels, fp16 scale and zero point"))


_CODEC_LIST = [
    Codec("int8_tensor", ELEMENTS["int8"], "tensor", None, torch.float32, "amax",
          description="symmetric int8, one fp32 scale per tensor (amax / 127)"),
    Codec("int8_token_head", ELEMENTS["int8"], "token_head", None, torch.float32, "amax",
          description="symmetric int8, one fp32 scale per token and head"),
    Codec("int4_token_head", ELEMENTS["int4"], "token_head", None, torch.float32, "amax",
          description="symmetric int4 (-7..7), one fp32 scale per token and head"),
    *(c for g in KIVI_GROUPS for c in _kivi_codecs(g)),
    Codec("nvfp4", ELEMENTS["e2m1"], "block", 16, torch.float8_e4m3fn, "two_level", tensor_scale=True,
          description="NVFP4: e2m1, an e4m3 scale per 16 channels and an fp32 tensor scale"),
    Codec("mxfp4", ELEMENTS["e2m1"], "block", 32, torch.float8_e8m0fnu, "pow2",
          description="OCP MXFP4: e2m1, a power-of-two (e8m0) scale per 32 channels"),
    Codec("e4m3_b16", ELEMENTS["e4m3"], "block", 16, torch.float8_e4m3fn, "two_level", tensor_scale=True,
          description="e4m3 with NVFP4's scaling: an e4m3 scale per 16 channels and an fp32 tensor scale"),
    Codec("e4m3_b32", ELEMENTS["e4m3"], "block", 32, torch.float8_e8m0fnu, "pow2",
          description="OCP MXFP8: e4m3, a power-of-two (e8m0) scale per 32 channels"),
    *_fp8_codecs(),
]
CODECS: dict[str, Codec] = {c.name: c for c in _CODEC_LIST}
CODEC_NAMES: tuple[str, ...] = tuple(CODECS)
_CODEC_ALIASES = {"mxfp8": "e4m3_b32"}

KV_FORMATS: dict[str, KVFormat] = {}
for _c in _CODEC_LIST:
    if _c.name.startswith("kivi4_key_"):
        _g = _c.block
        KV_FORMATS[f"kivi4_g{_g}"] = KVFormat(f"kivi4_g{_g}", _c, CODECS[f"kivi4_value_g{_g}"],
                                              f"KIVI 4-bit, groups of {_g}: keys per channel, values per token")
    elif not _c.name.startswith("kivi4_value_"):
        KV_FORMATS[_c.name] = KVFormat(_c.name, _c, _c, _c.description)
KV_FORMAT_NAMES: tuple[str, ...] = tuple(KV_FORMATS)  # for iteration, choices and error messages


def codec(name: Codec | str) -> Codec:
    """Look up a codec by name (:data:`CODEC_NAMES`; ``"mxfp8"`` is ``"e4m3_b32"``)."""
    if isinstance(name, Codec):
        return name
    if not isinstance(name, str):
        raise TypeError(f"codec={name!r} ({type(name).__name__}); expected a codec name among {CODEC_NAMES}")
    key = _CODEC_ALIASES.get(name.lower(), name.lower())
    if key not in CODECS:
        raise ValueError(f"codec={name!r} is not a known codec; expected one of {CODEC_NAMES}")
    return CODECS[key]


def kv_format(name: KVFormat | str) -> KVFormat:
    """Look up a KV format by name (:data:`KV_FORMAT_NAMES`; ``"mxfp8"`` is ``"e4m3_b32"``)."""
    if isinstance(name, KVFormat):
        return name
    if not isinstance(name, str):
        raise TypeError(f"fmt={name!r} ({type(name).__name__}); expected a KV format name among {KV_FORMAT_NAMES}")
    key = _CODEC_ALIASES.get(name.lower(), name.lower())
    if key not in KV_FORMATS:
        raise ValueError(f"fmt={name!r} is not a known KV format; expected one of {KV_FORMAT_NAMES}")
    return KV_FORMATS[key]


def kivi(group_size: int) -> KVFormat:
    """The KIVI 4-bit format with groups of ``group_size`` (one of :data:`KIVI_GROUPS`)."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size not in KIVI_GROUPS:
        raise ValueError(f"group_size={group_size!r}; expected one of {KIVI_GROUPS}")
    return KV_FORMATS[f"kivi4_g{group_size}"]


def summary_table(head_dim: int = 128, num_kv_heads: int = 1):
    """One row per KV format: code bits, scale dtypes, block, bytes per token (K + V, one layer) at
    ``head_dim`` (formats whose blocks do not divide it are left out), as a pandas DataFrame."""
    import pandas as pd

    head_dim = checks.positive_int(head_dim, "head_dim")
    num_kv_heads = checks.positive_int(num_kv_heads, "num_kv_heads")
    rows = []
    for f in KV_FORMATS.values():
        try:
            fp = kv_footprint(f, num_kv_heads=num_kv_heads, head_dim=head_dim)
        except ValueError:
            continue
        rows.append(dict(name=f.name, key=f.key.name, value=f.value.name, bits=f.key.bits,
                         scale_dtype=str(f.key.scale_dtype).replace("torch.", ""), block=f.key.block,
                         zero_point=f.key.zero_point, tensor_scale=f.key.tensor_scale,
                         bytes_per_token=float(fp.per_token), fixed_bytes=fp.fixed,
                         description=f.description))
    return pd.DataFrame(rows)
