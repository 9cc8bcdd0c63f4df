"""The torch backend's triton kernels compiled for a Hopper GPU (sm_90) on a machine without
one: what ptxas makes of them (registers, bytes spilt to local memory) and their PTX, from
the ptxas and cuobjdump that triton's wheel carries.

A kernel is compiled from a launch as the backend makes it (``kernels._launch``'s
arguments: tensors become pointers of their dtype, Python numbers 32-bit scalars, keyword
arguments the kernel names its constexprs, the rest compile options), so a test can record
the launches of a real decode step in the interpreter and ask how each compiles for a GPU.

    python -m tests.offline_sm90    # the decode kernels' registers at the models' shapes
    python -m tests.offline_sm90 --tuning FILE  # a tuning file's mat-vec tiles: registers,
                                    # programs a multiprocessor, waves

EDGELLM_SM90_TRITON=DIR (a folder holding another triton package, as ``pip install --target``
makes one) compiles with that triton instead, in a child process: the lent GPUs run an
older triton than this machine, whose code generation can differ (registers, spills);
``benchmarks/sm90_preflight.sh`` runs the tests and the table that way.

Under TRITON_INTERPRET=1 (the tests here) the kernels are the interpreter's, so the compile
runs in a child process without it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

SM90 = GPUTarget("cuda", 90, 32)
MULTIPROCESSORS = 132  # an H100 SXM's and an H200's
_POINTER = {"float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16", "int64": "*i64",
            "int32": "*i32", "int8": "*i8", "uint8": "*u8", "bool": "*i1"}
_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion", "launch_pdl")
#: a folder with another triton to compile with (a child process imports it first)
OTHER_TRITON = "EDGELLM_SM90_TRITON"


@dataclass
class Compiled:
    """One kernel compiled for sm_90: its PTX and ptxas's resource use."""

    name: str
    ptx: str
    registers: int
    spilt_bytes: int  # the stack frame per thread: local memory that registers spilt to
    shared_bytes: int = 0  # shared memory per program (the layout conversions' scratch)
    warps: int = 4
    compiler: str = ""  # the triton that compiled it: version and package folder

    @property
    def per_multiprocessor(self) -> int:
        """How many of its programs fit one sm_90 multiprocessor at once."""
        return programs_per_multiprocessor(self.registers, self.warps, self.shared_bytes)

    def lines(self, pattern: str) -> list[int]:
        """Indices of the PTX lines that match ``pattern`` (a regular expression)."""
        rx = re.compile(pattern)
        return [i for i, line in enumerate(self.ptx.splitlines()) if rx.search(line)]

    def last_to_finish(self) -> tuple[int, int]:
        """(first, last) PTX lines of the work that the last program of a group does: after
        its ticket (the first atomic add) and before the ticket's reset (the first
        exchange): a split attention's combine, a split mat-vec's sum of partials."""
        return (min(self.lines(r"atom\.global\S*\.add")),
                min(self.lines(r"atom\.global\S*\.exch")))

    def load_runs(self, loads: str, first: int, last: int) -> list[list[int]]:
        """The lines matching ``loads`` between lines first and last, in runs that no
        instruction waiting for them splits (a barrier, or a warp shuffle: a reduction's)."""
        waits = [i for i in self.lines(r"bar\.sync|shfl\.sync") if first < i < last]
        bounds = [first, *waits, last]
        runs = [[i for i in self.lines(loads) if lo < i < hi]
                for lo, hi in zip(bounds, bounds[1:], strict=False)]
        return [run for run in runs if run]


def compile_launch(kernel, args: tuple, meta: dict) -> Compiled:
    """``kernel[grid](*args, **meta)`` compiled for sm_90 instead of launched."""
    return compile_specs([launch_spec(kernel, args, meta)])[0]


def launch_spec(kernel, args: tuple, meta: dict) -> dict:
    """What compiling a launch takes, as plain data: the kernel's name in
    ``kernels``, each argument's triton type, the constexprs and the compile options."""
    names = kernel.arg_names
    constexprs = {k: v for k, v in meta.items() if k in names}
    options = {k: v for k, v in meta.items() if k in _OPTIONS}
    assert set(meta) <= set(constexprs) | set(options), set(meta) - set(names)
    positional = [n for n in names if n not in constexprs]
    assert len(positional) == len(args), (kernel.__name__, len(positional), len(args))
    # as triton's launcher specializes: integers equal to 1 become constants, pointers and
    # integers divisible by 16 are marked so (wider loads, cheaper indexing)
    given = dict(zip(positional, args, strict=True))
    constexprs.update({n: 1 for n, a in given.items() if _type(a) == "i32" and a == 1})
    if "INTERP" in constexprs:  # (a GPU's instructions, not the interpreter's stand-ins)
        constexprs["INTERP"] = False
    return {"kernel": kernel.__name__, "constexprs": constexprs, "options": options,
            "signature": {n: "constexpr" if n in constexprs else _type(given[n])
                          for n in names},
            "aligned": [n for n, a in given.items() if n not in constexprs and _divisible(a)]}


def compile_specs(specs: list[dict]) -> list[Compiled]:
    """``launch_spec``s compiled for sm_90: here, or in a child process where this
    process's kernels are triton's interpreter's (TRITON_INTERPRET=1: nothing to compile;
    the child runs without it) or another triton is asked for (OTHER_TRITON: the child
    imports it first)."""
    from edgellm.backends.torch import kernels

    other = os.environ.get(OTHER_TRITON)
    if not kernels._INTERPRETING and not other:
        return [_compile(spec) for spec in specs]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if other:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (other, env.get("PYTHONPATH"))))
    done = subprocess.run([sys.executable, "-m", "tests.offline_sm90", "--specs"],
                          input=json.dumps(specs), capture_output=True, text=True, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    return [Compiled(**c) for c in json.loads(done.stdout)]


def _compile(spec: dict) -> Compiled:
    from edgellm.backends.torch import kernels

    kernel = getattr(kernels, spec["kernel"])
    names = kernel.arg_names
    source = ASTSource(kernel, spec["signature"],
                       constexprs={(names.index(k),): v
                                   for k, v in spec["constexprs"].items()},
                       attrs={(names.index(n),): [["tt.divisibility", 16]]
                              for n in spec["aligned"]})
    compiled = triton.compile(source, target=SM90, options=spec["options"])
    registers, stack = _resources(compiled.asm["cubin"])
    return Compiled(spec["kernel"], compiled.asm["ptx"], registers, stack,
                    compiled.metadata.shared, compiled.metadata.num_warps,
                    f"triton {triton.__version__} in {os.path.dirname(triton.__file__)}")


#: an sm_90 multiprocessor's limits: registers, resident warps and programs, shared memory
SM90_REGISTERS, SM90_WARPS, SM90_PROGRAMS, SM90_SHARED = 65536, 64, 32, 228 * 1024


def programs_per_multiprocessor(registers: int, warps: int, shared_bytes: int = 0) -> int:
    """How many programs (thread blocks) of ``warps`` warps, ``registers`` a thread and
    ``shared_bytes`` of shared memory fit one sm_90 multiprocessor at once: registers are
    given out a warp at a time in units of 256 (8 a thread), and each block takes 1 KB of
    shared memory beside its own."""
    per_warp = -(-registers * 32 // 256) * 256
    return min(SM90_REGISTERS // (per_warp * warps), SM90_WARPS // warps, SM90_PROGRAMS,
               SM90_SHARED // (shared_bytes + 1024))


def _type(arg) -> str:
    """A launch argument's triton type: tensors are pointers to their dtype."""
    if hasattr(arg, "dtype") and hasattr(arg, "data_ptr"):
        return _POINTER[str(arg.dtype).removeprefix("torch.")]
    if isinstance(arg, bool):
        return "i1"
    if isinstance(arg, int):
        return "i32" if -2**31 <= arg < 2**31 else "i64"
    if isinstance(arg, float):
        return "fp32"
    raise TypeError(f"no triton type for {type(arg).__name__}")


def _divisible(arg) -> bool:
    """Is a launch argument a multiple of 16 (an integer) or 16-byte aligned (a tensor)?"""
    if hasattr(arg, "data_ptr"):
        return arg.data_ptr() % 16 == 0
    return isinstance(arg, int) and not isinstance(arg, bool) and arg % 16 == 0


def _resources(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) per thread, as ``cuobjdump -res-usage`` reports them."""
    tool = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        report = subprocess.run([tool, "-res-usage", f.name], capture_output=True,
                                text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", report)
    assert found, report
    return int(found.group(1)), int(found.group(2))


def attention_launch(heads: int, kv_heads: int, head_dim: int, storage: int,
                     pdl: int = 0, sequences: int = 1) -> tuple:
    """(kernel, args, meta) of a decode step's attention as a graph launches it (one token
    over ``storage`` slots, its output's 8-bit blocks and the step's keys and values
    written in the launch, the mask's span read from the device; ``sequences`` > 1: a
    batch graph's, a token each over its own cache), through ``kernels.attention`` with
    the launch recorded, not run: the real arguments at a real model's shape."""
    import torch

    from edgellm.backends.torch import kernels

    n = sequences
    q = torch.zeros((n, heads, head_dim))
    k = torch.zeros((storage, kv_heads, head_dim), dtype=torch.float16)
    mask = torch.ones((n, storage), dtype=torch.bool)
    new = torch.zeros((n, kv_heads, head_dim))
    write = (torch.zeros(n, dtype=torch.int64), new, new)
    span = torch.full((n,), storage, dtype=torch.int64)
    apart = (torch.zeros(n, dtype=torch.int64),) * 2 if n > 1 else None
    return _recorded(lambda: kernels.attention(q, k, k, mask, head_dim ** -0.5,
                                               quantize=True, write=write, span=span,
                                               apart=apart), pdl)[0]


def matvec_launch(rows: int, cols: int, qtype, tokens: int = 1, pdl: int = 0) -> tuple:
    """(kernel, args, meta) of the mat-vec of a (rows, cols) matrix of ``qtype`` blocks over
    ``tokens`` tokens, through ``kernels.qmatvec``: a GPU's default tile and K split (no
    tuner times tiles here)."""
    from edgellm.backends.torch import kernels

    planes, xq, xd = _zero_matvec_inputs(rows, cols, qtype, tokens)
    return _recorded(lambda: kernels.qmatvec(xq, xd, planes), pdl)[0]


def _zero_matvec_inputs(rows: int, cols: int, qtype, tokens: int) -> tuple:
    """(planes, xq, xd): a (rows, cols) matrix of ``qtype`` blocks, all zero, and
    ``tokens`` tokens' 8-bit activations, on the CPU: a mat-vec's arguments at that shape."""
    import numpy as np
    import torch

    from edgellm.backends.torch.packing import pack
    from edgellm.quants import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    planes = pack(np.zeros((rows, cols // block * size), np.uint8), qtype, rows,
                  cols).upload("cpu")
    return (planes, torch.zeros((tokens, planes.padded // 4), dtype=torch.int32),
            torch.zeros((tokens, planes.padded // 32)))


def flash_launch(heads: int, kv_heads: int, head_dim: int, tokens: int, tile: tuple,
                 pdl: int = 0) -> tuple:
    """(kernel, args, meta) of a ``tokens``-token prompt's flash attention in ``tile``."""
    import torch

    from edgellm.backends.torch import kernels

    q = torch.zeros((tokens, heads, head_dim))
    kv = torch.zeros((tokens, kv_heads, head_dim), dtype=torch.float16)
    mask = torch.ones((tokens, tokens), dtype=torch.bool)
    return _recorded(lambda: kernels.flash_prompt_attention(q, kv, kv, mask, head_dim ** -0.5,
                                                            tile), pdl)[0]


def _recorded(work, pdl: int, run: bool = False, grids: list | None = None) -> list[tuple]:
    """The (kernel, args, meta) of every launch ``work()`` makes through
    ``kernels._launch``, each with PDL mode ``pdl``; launched as well where ``run`` (work
    that reads its launches' results), else not. ``grids``: each launch's grid appended."""
    from edgellm.backends.torch import kernels

    launches: list[tuple] = []
    saved = kernels._launch, kernels._INTERPRETING, kernels._multiprocessors

    def record(kernel, grid, *args, **meta):
        if grids is not None:
            grids.append(grid)
        launches.append((kernel, args, {**meta, "PDL": pdl, "launch_pdl": bool(pdl)}))
        if run:
            saved[0](kernel, grid, *args, **meta)

    kernels._launch = record
    if not run:  # the launches' shapes chosen as for a GPU of H100/H200 size
        kernels._INTERPRETING, kernels._multiprocessors = False, lambda device: MULTIPROCESSORS
    try:
        work()
    finally:
        kernels._launch, kernels._INTERPRETING, kernels._multiprocessors = saved
    return launches


def tuned_matvec_launch(op: str, kind: int, rows: int, n_chunks: int, tile: tuple,
                        pipeline: int = 1) -> tuple[tuple, int]:
    """((kernel, args, meta), programs) of a decode mat-vec ("matvec", or "matvec_glu" over
    gate and up stacked: ``rows`` both) of ``kind`` blocks in ``tile`` (rows per program,
    chunks per step, warps, programs a multiprocessor aimed at: ``kernels.matvec_grid``) and loop
    ``pipeline`` (``kernels.matvec_pipeline``'s mode): a tuning file's choice as a GPU
    would launch it, one token."""
    from edgellm.backends.torch import kernels
    from edgellm.backends.torch.packing import KINDS

    qtype = {k: q for q, k in KINDS.items()}[kind]
    planes, xq, xd = _zero_matvec_inputs(rows, n_chunks * 64, qtype, 1)
    saved = dict(kernels.MATVEC_TILES), dict(kernels._env_flags)
    kernels.MATVEC_TILES[kind] = tuple(tile)  # (all four: as kept, not timed)
    kernels._env_flags["EDGELLM_MATVEC_PIPELINE"] = bool(pipeline)
    grids: list = []
    try:
        launch = _recorded(lambda: kernels.qmatvec_glu(xq, xd, planes, False)
                           if op == "matvec_glu" else kernels.qmatvec(xq, xd, planes), 0,
                           grids=grids)[0]
    finally:
        kernels.MATVEC_TILES.clear()
        kernels.MATVEC_TILES.update(saved[0])
        kernels._env_flags.clear()
        kernels._env_flags.update(saved[1])
    programs = 1
    for n in grids[0]:
        programs *= n
    return launch, programs


def occupancy_report(tuning_file: str) -> list[str]:
    """A line per decode mat-vec that a tuning file (``$EDGELLM_HOME/tuning/<gpu>.json``)
    keeps a tile for: registers, bytes spilt, programs a multiprocessor, the launch's
    programs and how many waves of MULTIPROCESSORS x that they make."""
    with open(tuning_file, encoding="utf-8") as f:
        choices = json.load(f)["choices"]
    keys, launches = [], []
    for key, tile in sorted(choices.items()):
        op, kind, rows, n_chunks, *loop = key.split(":")
        if op in ("matvec", "matvec_glu"):  # (the plain loop's tiles: "...:unpipelined")
            keys.append((key, tuple(tile)))
            launches.append(tuned_matvec_launch(op, int(kind), int(rows), int(n_chunks),
                                                tile, 0 if "unpipelined" in loop else 1))
    compiled = compile_specs([launch_spec(*launch) for launch, _ in launches])
    lines = []
    for (key, tile), (_, programs), c in zip(keys, launches, compiled, strict=True):
        fit = c.per_multiprocessor
        lines.append(f"{key:26s} {str(tile):18s} {c.registers:3d} registers, "
                     f"{c.spilt_bytes} bytes spilt, {fit:2d} a multiprocessor, {programs:6d} "
                     f"programs: {programs / (fit * MULTIPROCESSORS):.2f} waves")
    return lines


def main() -> None:
    from edgellm.quants import Q

    if sys.argv[1:2] == ["--tuning"]:  # a tuning file's mat-vec tiles, as sm_90 runs them
        print("\n".join(occupancy_report(sys.argv[2])))
        return

    # (the three models' attention heads, and their largest mat-vecs)
    for label, shape in (("Qwen2.5 1.5B", (12, 2, 128)), ("Qwen2.5 0.5B", (14, 2, 64)),
                         ("Gemma 3 270M", (4, 1, 256))):
        for storage in (656, 4096, 32768):
            c = compile_launch(*attention_launch(*shape, storage))
            if label.endswith("1.5B") and storage == 656:  # (first: which triton compiles)
                print(c.compiler)
            print(f"attention {label} over {storage} slots: {c.registers} registers, "
                  f"{c.spilt_bytes} bytes spilt")
    for rows, cols, qtype in ((17920, 1536, Q.Q4_K), (1536, 8960, Q.Q6_K),
                              (9728, 896, Q.Q5_0), (896, 4864, Q.Q8_0)):
        for tokens in (1, 8):
            c = compile_launch(*matvec_launch(rows, cols, qtype, tokens))
            print(f"mat-vec {qtype.name} {rows}x{cols} x {tokens} tokens: {c.registers} "
                  f"registers, {c.spilt_bytes} bytes spilt")


if __name__ == "__main__":
    if sys.argv[1:] == ["--specs"]:  # (compile_specs' child: specs on stdin, JSON out)
        print(json.dumps([asdict(_compile(spec)) for spec in json.load(sys.stdin)]))
    else:
        main()
