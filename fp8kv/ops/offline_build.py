"""fp8kv's Triton kernels built for a GPU that need not be here: Triton compiles and its bundled ptxas
assembles on any machine, so what ptxas allocated (registers, spilled bytes, shared memory) and the SASS of a
launch can be read on a CPU. :func:`compile_kernel` builds a kernel for its runtime arguments as a launch
specialises them (pointers and integers that are multiples of 16 marked so, integers equal to 1 made constants);
:func:`instructions` reads the SASS with its scheduling bits, :func:`main_loop` its tile loop and
:func:`instruction_mix` counts that loop's instructions by kind.

It needs a process where the Triton interpreter was off when triton was first imported: the interpreter
replaces Triton's own library functions, which then cannot be compiled.
"""

from __future__ import annotations

import collections
import inspect
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.interpreter import InterpretedFunction

from .. import checks
from ..capability import ARCHS

__all__ = ["Compiled", "Instruction", "compile_kernel", "instructions", "main_loop", "instruction_mix",
           "interpreter_replaced_triton", "signature_of", "issue_budget", "loop_issue", "INSTRUCTION_KINDS", "TARGET_ARCHS",
           "ISSUE_PER_CLOCK"]

# The sm versions a build may target: fp8kv's (capability.ARCHS). An arch Triton does not know can abort the
# process in LLVM, so no other is tried.
TARGET_ARCHS = tuple(int(a[2:]) for a in ARCHS)

# Warp instructions an SM issues a clock at most: one per scheduler, four schedulers an SM (sm80-sm90).
ISSUE_PER_CLOCK = 4

# Pointer element types by tensor dtype, as Triton names them in a kernel signature.
POINTER_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.uint8: "*u8",
                 torch.int8: "*i8", torch.int32: "*i32", torch.float8_e4m3fn: "*fp8e4nv", torch.float8_e5m2: "*fp8e5"}


@dataclass(frozen=True)
class Compiled:
    """One compiled kernel: what ptxas allocated, and its SASS."""
    registers: int  # per thread
    spilled_bytes: int  # stack + local memory per thread: 0 unless the registers ran out
    shared_bytes: int  # dynamic shared memory per program
    sass: str


def interpreter_replaced_triton() -> bool:
    """Whether this process imported triton with its interpreter on (then nothing can be compiled)."""
    return isinstance(tl.max, InterpretedFunction)


def signature_of(value) -> tuple[str, bool]:
    """(Triton type, multiple of 16) of one runtime argument, as a launch specialises it: an integer equal
    to 1 becomes a constant ("constexpr")."""
    if isinstance(value, torch.Tensor):
        return POINTER_TYPES[value.dtype], value.data_ptr() % 16 == 0
    if isinstance(value, float):
        return "fp32", False
    if value == 1:
        return "constexpr", False
    return ("i32" if -2**31 <= value < 2**31 else "i64"), value % 16 == 0


def _cuobjdump(*args: str) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return subprocess.run([str(tool), *args], capture_output=True, text=True, check=True).stdout


def compile_kernel(kernel_fn, args: list, constants: dict, *, arch: int, num_warps: int,
                   num_stages: int | None = None, source_cls=ASTSource, max_registers: int | None = None) -> Compiled:
    """Compile ``kernel_fn`` (a ``@triton.jit`` or Gluon function; ``source_cls`` its AST source class) for
    ``sm{arch}`` (one of :data:`TARGET_ARCHS`) with the runtime ``args`` (in the kernel's order, constexprs left
    out) and ``constants`` (the constexprs by name), as a launch with these arguments specialises it.
    ``max_registers``: ptxas's cap on registers a thread (Triton's ``maxnreg``; what it does not fit spills), or
    None for ptxas's own choice."""
    if arch not in TARGET_ARCHS:
        raise ValueError(f"arch={arch!r}; expected one of {TARGET_ARCHS}")
    if interpreter_replaced_triton():
        raise RuntimeError("triton was imported with its interpreter on (TRITON_INTERPRET=1): build in a process "
                           "without it")
    names = list(inspect.signature(kernel_fn.fn).parameters)
    runtime = [n for n in names if n not in constants]
    if len(runtime) != len(args):
        raise RuntimeError(f"{len(args)} runtime arguments given, {kernel_fn.fn.__name__} takes {len(runtime)}")
    typed = dict(zip(runtime, map(signature_of, args), strict=True))
    constants = {**constants, **{n: 1 for n, (kind, _) in typed.items() if kind == "constexpr"}}
    signature = {n: "constexpr" if n in constants else typed[n][0] for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, (_, aligned) in typed.items() if aligned}
    source = source_cls(kernel_fn, signature, constexprs={(names.index(k),): v for k, v in constants.items()},
                        attrs=attrs)
    options = dict(num_warps=num_warps) if num_stages is None else dict(num_warps=num_warps, num_stages=num_stages)
    if max_registers is not None:
        options["maxnreg"] = checks.positive_int(max_registers, "max_registers")
    kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = _cuobjdump("--dump-resource-usage", str(cubin))
        sass = _cuobjdump("--dump-sass", str(cubin))
    field = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", usage)}
    return Compiled(registers=field["REG"], spilled_bytes=field["STACK"] + field["LOCAL"],
                    shared_bytes=kernel.metadata.shared, sass=sass)


@dataclass(frozen=True)
class Instruction:
    address: int
    text: str
    write_barrier: int | None  # the scoreboard this variable-latency instruction sets (None: none)
    read_barrier: int | None
    wait_mask: int  # the scoreboards it waits for before it issues (bit i: scoreboard i)

    @property
    def opcode(self) -> str:
        """The instruction's name with its modifiers, its predicate left out (``@P0 LDG.E.128`` -> ``LDG.E.128``)."""
        return re.sub(r"^@!?U?P\w+\s+", "", self.text).split()[0]


def instructions(sass: str) -> list[Instruction]:
    """The instructions of ``cuobjdump --dump-sass`` output with their scheduling bits. Since sm70 each
    instruction is 128 bits, bits 105-125 holding its control (as reverse-engineered in Jia et al.,
    "Dissecting the NVIDIA Volta GPU Architecture via Microbenchmarking", 2018): 4 bits stall cycles,
    1 yield, 3 write-scoreboard index, 3 read-scoreboard index (7: none), a 6-bit wait mask, 4 reuse."""
    lines = sass.splitlines()
    found = []
    for i, line in enumerate(lines[:-1]):
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s+/\* (0x[0-9a-f]+) \*/", line)
        hi = re.search(r"^\s*/\* (0x[0-9a-f]+) \*/\s*$", lines[i + 1])
        if m and hi:
            control = int(hi.group(1), 16) >> 41
            write, read = (control >> 5) & 7, (control >> 8) & 7
            wait = (control >> 11) & 0x3F
            if (sb := re.match(r"DEPBAR\.\w+\s+SB(\d)", m.group(2))) is not None:
                wait |= 1 << int(sb.group(1))  # waits until that scoreboard's count drops
            found.append(Instruction(int(m.group(1), 16), m.group(2), None if write == 7 else write,
                                     None if read == 7 else read, wait))
    return found


def main_loop(code: list[Instruction]) -> list[Instruction]:
    """The instructions of the longest backward branch's loop (the decode's tile loop)."""
    spans = [(int(m.group(1), 16), ins.address) for ins in code
             if (m := re.search(r"\bBRA (0x[0-9a-f]+)", ins.text)) and int(m.group(1), 16) < ins.address]
    if not spans:
        raise ValueError("no backward branch in this SASS: no loop")
    start, end = max(spans, key=lambda s: s[1] - s[0])
    return [ins for ins in code if start <= ins.address <= end]


# Instruction kinds by SASS opcode (its name before the first modifier), for :func:`instruction_mix`.
INSTRUCTION_KINDS = (
    ("convert", ("I2F", "F2F", "F2I", "I2FP", "F2FP", "I2I")),  # number-format conversions
    ("integer", ("LOP3", "PRMT", "SHF", "IADD3", "IMAD", "ISETP", "SEL", "LEA", "IABS", "IMNMX", "VIMNMX", "BMSK",
                 "SGXT", "POPC", "FLO", "BREV", "VIADD")),
    ("fp16", ("HADD2", "HMUL2", "HFMA2", "HMNMX2", "HSETP2")),
    ("fp32", ("FADD", "FMUL", "FFMA", "FMNMX", "FSETP", "FSEL", "MUFU", "FCHK")),
    ("tensor core", ("HMMA", "HGMMA", "IMMA", "QGMMA", "WARPGROUP")),
    ("shared memory", ("LDS", "STS", "LDSM", "STSM")),
    ("global memory", ("LDG", "STG", "LDGSTS", "LDGDEPBAR", "RED", "REDG", "ATOMG")),
)
_KIND_OF = {op: kind for kind, ops in INSTRUCTION_KINDS for op in ops}


def instruction_mix(code: list[Instruction]) -> dict[str, int]:
    """How many of ``code``'s instructions are of each kind of :data:`INSTRUCTION_KINDS` ("other" for the rest:
    moves, branches, barriers, ...), and ``total``."""
    counts = collections.Counter(_KIND_OF.get(ins.opcode.split(".")[0], "other") for ins in code)
    return {**{kind: counts[kind] for kind, _ in INSTRUCTION_KINDS}, "other": counts["other"], "total": len(code)}


def issue_budget(bytes_per_token: float, copy_gbps: float, num_sms: int, clock_ghz: float) -> float:
    """The warp instructions per token an SM can issue (:data:`ISSUE_PER_CLOCK` a clock) while it reads
    ``bytes_per_token`` a token at ``copy_gbps`` spread over ``num_sms`` SMs at ``clock_ghz``: a kernel that issues
    more per token cannot stream at the copy rate whatever its schedule, and one close to it only with every
    scheduler issuing every clock."""
    bytes_per_token, copy_gbps, clock_ghz = (checks.real(v, name, minimum=0.0, inclusive=False) for v, name in
                                             ((bytes_per_token, "bytes_per_token"), (copy_gbps, "copy_gbps"),
                                              (clock_ghz, "clock_ghz")))
    num_sms = checks.positive_int(num_sms, "num_sms")
    bytes_a_clock = copy_gbps / (num_sms * clock_ghz)  # what one SM reads a clock at the copy rate
    return ISSUE_PER_CLOCK * bytes_per_token / bytes_a_clock


def loop_issue(sass: str, *, block_n: int, num_warps: int, programs_per_head: int = 1) -> dict:
    """The tile loop of ``sass`` by kind (:func:`instruction_mix`, one warp's), ``block_n``, ``num_warps`` and
    ``issue_per_token``: the warp instructions issued per token of K and V by the ``num_warps`` warps of each of the
    ``programs_per_head`` programs that read it, to set beside :func:`issue_budget`."""
    mix = instruction_mix(main_loop(instructions(sass)))
    return {**mix, "block_n": block_n, "num_warps": num_warps,
            "issue_per_token": mix["total"] * num_warps * programs_per_head / block_n}
