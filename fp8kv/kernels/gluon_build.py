"""The Gluon decode kernel built for a GPU that need not be here: Triton compiles and its bundled ptxas
assembles on any machine, so its registers, spilled bytes, shared memory and SASS can be read on a CPU.

:func:`build` takes a launch that :func:`fp8kv.ops.gluon_launch` chose; ``scripts/gluon_sass.py`` prints it
for a layout, and the CPU tests check every default tile with it (no spills, the shared memory
:func:`fp8kv.ops.gluon_smem_bytes` reserves). It needs a process without the Triton interpreter
(``TRITON_INTERPRET`` unset when triton was first imported): the interpreter replaces Triton's own library
functions, which then cannot be compiled.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

from . import paged_decode_gluon as g

# Element types of the pointer arguments; every other runtime argument is an int32 but the float qk_scale.
_POINTERS = {"q_ptr": "*bf16", "k_ptr": "*u8", "v_ptr": "*u8", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
             "bt_ptr": "*i32", "seq_lens_ptr": "*i32", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}
# Integer arguments that a launch passes as multiples of 16 (head_dim is one, so are the page, query and partial
# strides, the capacity and the split length): Triton specialises such values, and the 16-byte copies rely on it.
_MULTIPLES_OF_16 = ("tokens_per_split", "row_capacity", "stride_qb", "stride_qh", "stride_kb", "stride_kt", "stride_kh",
                    "stride_ob", "stride_oh", "stride_os")


@dataclass(frozen=True)
class Build:
    """One compiled kernel: what ptxas allocated, and its SASS."""
    registers: int  # per thread
    spilled_bytes: int  # stack + local memory per thread: 0 unless the registers ran out
    shared_bytes: int  # dynamic shared memory per program
    sass: str


def _cuobjdump(*args: str) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return subprocess.run([str(tool), *args], capture_output=True, text=True, check=True).stdout


def build(cfg: dict, group: int, head_dim: int, *, block_size: int = 16, kv_dtype: str = "fp8_e4m3",
          arch: int = 90) -> Build:
    """Compile :func:`~fp8kv.kernels.paged_decode_gluon.gluon_decode_kernel` for ``sm{arch}`` with the
    constexprs of launch ``cfg`` (``fp8kv.ops.gluon_launch``) and ``group`` query heads per KV head."""
    from ..capability import interpreter_on

    if interpreter_on():
        raise RuntimeError("the Triton interpreter is on (TRITON_INTERPRET=1): build in a process without it")
    fn = g.gluon_decode_kernel
    constants = g.launch_constants(cfg, group, head_dim, block_size, kv_dtype)
    names = list(inspect.signature(fn.fn).parameters)
    signature = {n: "constexpr" if n in constants else _POINTERS.get(n, "fp32" if n == "qk_scale" else "i32")
                 for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n in _POINTERS or n in _MULTIPLES_OF_16}
    source = GluonASTSource(fn, signature, constexprs={(names.index(k),): v for k, v in constants.items()}, attrs=attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=g.NUM_WARPS))
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = _cuobjdump("--dump-resource-usage", str(cubin))
        sass = _cuobjdump("--dump-sass", str(cubin))
    field = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", usage)}
    return Build(registers=field["REG"], spilled_bytes=field["STACK"] + field["LOCAL"],
                 shared_bytes=kernel.metadata.shared, sass=sass)
