"""Where a decode mat-vec's time goes, on a GPU: the kernel as decode runs it, against the
same grid doing only its loads, the same grid doing nothing, and a plain stream of as many
bytes. Each is replayed from a CUDA graph over copies of the matrix (weights cold, as
``torch_matvec.py`` times them), at the tile the card's tuner keeps for the shape.

    python benchmarks/matvec_anatomy.py [--plain]

Per matrix of the 1.5B (gate+up with the GLU, both down projections, Q+K, O), in us a
launch and GB/s of the matrix's bytes:

- ``decode``: ``qmatvec`` / ``qmatvec_glu`` as a decode step launches them (on Hopper
  programmatic dependent launches, ``kernels._pdl``);
- ``plain``: the same with plain launches, as the three below are launched;
- ``loads``: the grid and tile of ``plain`` issuing the same loads a step ahead
  (``kernels._qmv_loads``, the lone token's activations) and folding each into an
  accumulator of its own layout, summed once at the end: what the memory system takes
  for this access pattern, without the sums, the layout conversions or the epilogue (a
  split's partials, the GLU's 8-bit blocks);
- ``empty``: the grid with nothing to do (launch and scheduling in a graph);
- ``stream``: the matrix's bytes read as one flat array, 8 KB a program (what the card
  gives for this many bytes in one launch).

So ``plain - loads`` is the arithmetic and epilogue, ``loads - stream`` what the access
pattern and grid cost over a plain stream. The loads kernel may need fewer registers than
the real one (its line says how many), so more of its programs may fit a multiprocessor:
a floor for the pattern, not its exact share (compiled for sm_90 without a GPU: 126
registers against 121 for gate+up's tile, 72 against 125 for the Q6_K down's).

``--plain``: only the figures with plain launches (no PDL anywhere). Needs CUDA; the tuning
file of ``$EDGELLM_HOME`` is used as decode uses it (``cuda_run.sh`` runs this after
``bench``, which saved the choices).
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl
from torch_matvec import COLD_BYTES, copies, planes, replayed_us  # (this folder: on the path)

from edgellm.backends.torch import kernels
from edgellm.backends.torch.packing import K_QUANTS, stack_rows
from edgellm.quants import Q

# (label, type, rows, cols): the 1.5B Q4_K_M's mat-vecs that set a decode step's pace
SHAPES = [("gate+up", Q.Q4_K, 8960, 1536), ("down", Q.Q6_K, 1536, 8960),
          ("down", Q.Q4_K, 1536, 8960), ("q+k", Q.Q4_K, 1792, 1536), ("o", Q.Q4_K, 1536, 1536)]
STREAM_WORDS = 2048  # int32 words a program of the stream kernel reads (8 KB)


@triton.jit
def _bits(v):
    """v's bits as int32 (f16 scales bit-cast, bytes widened)."""
    if v.dtype.is_fp16():
        return v.to(tl.int16, bitcast=True).to(tl.int32)
    else:
        return v.to(tl.int32)


@triton.jit
def _fold(w_lo, w_hi, h_lo, h_hi, a_lo, a_hi, b_lo, b_hi, dd, dmin, x_lo, x_hi, xd,
          acc_w, acc_h, acc_s, acc_m, acc_d, acc_x, acc_xd, KIND: tl.constexpr):
    """One step's loads XOR'ed (added: xd) into accumulators of their own shapes, so that
    none is dead and none changes layout."""
    acc_w = acc_w ^ w_lo
    if KIND == 0:  # (the nibble types' w_hi is w_lo: XOR'ing both would fold to no load)
        acc_w = acc_w ^ w_hi
    if KIND == 3 or KIND == 4 or KIND == 6 or KIND == 7:
        acc_h = acc_h ^ h_lo ^ h_hi
    acc_s = acc_s ^ _bits(a_lo) ^ _bits(a_hi)
    if KIND == 2 or KIND == 4 or KIND == 5 or KIND == 6:
        acc_m = acc_m ^ _bits(b_lo) ^ _bits(b_hi)
    if KIND >= 5:
        acc_d = acc_d ^ _bits(dd)
        if KIND != 7:
            acc_d = acc_d ^ _bits(dmin)
    acc_x = acc_x ^ x_lo ^ x_hi
    acc_xd = acc_xd + xd
    return acc_w, acc_h, acc_s, acc_m, acc_d, acc_x, acc_xd


@triton.jit
def _loads_kernel(xq_ptr, xd_ptr, out_ptr, q_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, F,
                  KW, nqw, ng, nsup, n_chunks, cps, KIND: tl.constexpr, BN: tl.constexpr,
                  CH: tl.constexpr, GLU: tl.constexpr):
    """``_qmv_kernel``'s (GLU: ``_qmv_glu_kernel``'s) programs and loop with its loads a
    step ahead (``_qmv_rows``, a lone token), the sums left out: each program writes one
    int, the fold of everything it loaded."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    c_start = split * cps
    c_end = tl.minimum(c_start + cps, n_chunks)
    if GLU:  # gate row j, up row j, ... as one tile of 2 BN rows
        pair = tl.arange(0, 2 * BN)
        rows = pid * BN + pair // 2 + (pair % 2) * F
        rmask = pid * BN + pair // 2 < F
        R: tl.constexpr = 2 * BN
    else:
        rows = pid * BN + tl.arange(0, BN)
        rmask = rows < F
        R: tl.constexpr = BN
    SUB: tl.constexpr = 2 if KIND == 7 else 1  # scales per half chunk
    acc_w = tl.zeros((R, CH, 2, 4), tl.int32)
    acc_h = tl.zeros((R, CH, SUB, 1), tl.int32)
    acc_s = tl.zeros((R, CH, SUB), tl.int32)
    acc_m = tl.zeros((R, CH, 1), tl.int32)
    acc_d = tl.zeros((R, CH, 1), tl.int32)
    acc_x = tl.zeros((CH, 2, 4), tl.int32)
    acc_xd = tl.zeros((CH, 2), tl.float32)
    w_lo, w_hi, h_lo, h_hi, a_lo, a_hi, b_lo, b_hi, dd, dmin = kernels._qmv_loads(
        q_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, rows, rmask, c_start, c_end, nqw, ng, nsup,
        KIND, CH)
    x_lo, x_hi, xd = kernels._qmv_x(xq_ptr, xd_ptr, 0, c_start, c_end, KW, CH)
    for c0 in range(c_start, c_end, CH):
        n_w_lo, n_w_hi, n_h_lo, n_h_hi, n_a_lo, n_a_hi, n_b_lo, n_b_hi, n_dd, n_dmin = (
            kernels._qmv_loads(q_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, rows, rmask,
                               c0 + CH, c_end, nqw, ng, nsup, KIND, CH))
        n_x_lo, n_x_hi, n_xd = kernels._qmv_x(xq_ptr, xd_ptr, 0, c0 + CH, c_end, KW, CH)
        acc_w, acc_h, acc_s, acc_m, acc_d, acc_x, acc_xd = _fold(
            w_lo, w_hi, h_lo, h_hi, a_lo, a_hi, b_lo, b_hi, dd, dmin, x_lo, x_hi, xd, acc_w,
            acc_h, acc_s, acc_m, acc_d, acc_x, acc_xd, KIND)
        w_lo, w_hi, h_lo, h_hi, a_lo, a_hi, b_lo, b_hi, dd, dmin = (
            n_w_lo, n_w_hi, n_h_lo, n_h_hi, n_a_lo, n_a_hi, n_b_lo, n_b_hi, n_dd, n_dmin)
        x_lo, x_hi, xd = n_x_lo, n_x_hi, n_xd
    total = (tl.sum(tl.reshape(acc_w, (R * CH * 8,)), axis=0)
             + tl.sum(tl.reshape(acc_h, (R * CH * SUB,)), axis=0)
             + tl.sum(tl.reshape(acc_s, (R * CH * SUB,)), axis=0)
             + tl.sum(tl.reshape(acc_m, (R * CH,)), axis=0)
             + tl.sum(tl.reshape(acc_d, (R * CH,)), axis=0)
             + tl.sum(tl.reshape(acc_x, (CH * 8,)), axis=0)
             + tl.sum(tl.reshape(acc_xd, (CH * 2,)), axis=0).to(tl.int32))
    tl.store(out_ptr + pid * tl.num_programs(1) + split, total)


@triton.jit
def _empty_kernel(out_ptr):
    """A grid that does nothing but let its first program write a word."""
    if tl.program_id(0) == 0 and tl.program_id(1) == 0:
        tl.store(out_ptr, 0)


@triton.jit
def _stream_kernel(words_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Sum of BLOCK int32 words a program (a flat read of n words), one int out."""
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + tl.program_id(0), tl.sum(tl.load(words_ptr + at, mask=at < n, other=0)))


def grid_of(p, tile: tuple, glu: bool) -> tuple[int, int, int]:
    """(programs, splits, chunks per split) as ``kernels.qmatvec`` / ``qmatvec_glu`` launch
    ``tile`` over p (the GLU: a program per BN gate rows, all of K), but a program a row
    block where the tile loops over blocks (the figures' own kernels do not loop)."""
    n_chunks = kernels._geometry(p)[3]
    if glu:
        return triton.cdiv(p.rows // 2, tile[0]), 1, n_chunks
    _, splits, cps = kernels.matvec_grid(p.rows, n_chunks, tile, p.q.device)
    return triton.cdiv(p.rows, tile[0]), splits, cps


def launches(p, xq, xd, tile: tuple, glu: bool) -> dict:
    """What each figure launches for one copy p of the matrix: name -> a function of none."""
    bn, ch, warps, _ = tile
    programs, splits, cps = grid_of(p, tile, glu)
    nq, ng, nsup, n_chunks = kernels._geometry(p)
    flat = torch.cat([a.reshape(-1).view(torch.uint8) for a in p.arrays().values()])
    flat = flat[: flat.numel() // 4 * 4].view(torch.int32)
    streams = triton.cdiv(flat.numel(), STREAM_WORDS)
    out = torch.empty(max(programs * splits, streams), dtype=torch.int32, device=xq.device)
    rows = p.rows // 2 if glu else p.rows
    if glu:
        decode = lambda: kernels.qmatvec_glu(xq, xd, p, False)  # noqa: E731
    else:
        decode = lambda: kernels.qmatvec(xq, xd, p)  # noqa: E731
    return {
        "decode": decode,
        "loads": lambda: _loads_kernel[(programs, splits)](
            xq, xd, out, *kernels._plane_args(p, kernels._words(p)), rows, xq.shape[1],
            nq // 4, ng, nsup, n_chunks, cps, KIND=p.kind, BN=bn, CH=ch, GLU=glu,
            num_warps=warps),
        "empty": lambda: _empty_kernel[(programs, splits)](out, num_warps=warps),
        "stream": lambda: _stream_kernel[(streams,)](
            flat, out, flat.numel(), BLOCK=STREAM_WORDS, num_warps=4),
    }


def _not_timed(tile) -> None:
    """A tuner's run that fails: asked for a tile it has not kept, it keeps none."""
    raise RuntimeError("the tile was to be tuned by the launch before")


def anatomy(label: str, qtype, rows: int, cols: int, pdl: bool) -> str:
    """One line of figures for the (rows, cols) matrix of ``qtype`` ("gate+up": two stacked,
    through the GLU kernel), each launch replayed over cold copies of it."""
    glu = label == "gate+up"
    if glu:  # gate and up stacked as the backend stacks them
        p, _ = stack_rows([planes(qtype, rows, cols), planes(qtype, rows, cols)], torch.cat)
    else:
        p = planes(qtype, rows, cols)
    x = torch.randn(1, cols, device="cuda")
    xq, xd = kernels.quantize_activations(x, 256 if qtype in K_QUANTS else 32, p.padded)
    (kernels.qmatvec_glu(xq, xd, p, False) if glu else kernels.qmatvec(xq, xd, p))  # tune
    tile = kernels._matvec_tile("matvec_glu" if glu else "matvec", (p,), xq.device,
                                _not_timed)  # (the choice just made; never a new one)
    mats = copies(p, max(2, min(64, COLD_BYTES // p.nbytes)))
    runs = [launches(m, xq, xd, tile, glu) for m in mats]
    device = xq.device
    saved = kernels._pdl_devices.get(device)
    times = {}
    try:
        for name in (("decode",) if pdl else ()) + ("plain", "loads", "empty", "stream"):
            kernels._pdl_devices[device] = saved if name == "decode" else 0
            key = "decode" if name == "plain" else name
            times[name] = replayed_us([r[key] for r in runs])
    finally:
        kernels._pdl_devices.pop(device, None)
        if saved is not None:
            kernels._pdl_devices[device] = saved
    programs, splits, _ = grid_of(p, tile, glu)
    figures = ", ".join(f"{name} {us:.1f} us {p.nbytes / us / 1e3:.0f} GB/s"
                        for name, us in times.items())
    loads = runs[0]["loads"]()  # (the compiled kernel: its registers set how many programs fit)
    return (f"{label} {qtype.name} {p.rows}x{cols} ({p.nbytes / 1e6:.1f} MB) tile {tile}, "
            f"{programs}x{splits} programs: {figures}; loads kernel {loads.n_regs} registers,"
            f" {loads.n_spills} spilt")


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("matvec_anatomy.py needs a CUDA GPU")
    pdl = "--plain" not in sys.argv
    print(torch.cuda.get_device_name(), "PDL mode", kernels._pdl(torch.device("cuda", 0)))
    for label, qtype, rows, cols in SHAPES:
        print(anatomy(label, qtype, rows, cols, pdl), flush=True)


if __name__ == "__main__":
    main()
