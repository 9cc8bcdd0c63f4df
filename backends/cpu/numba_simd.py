"""Integer dot products of a repacked weight row with int8 activations, as LLVM vector IR.

Numba cannot express these with plain loops: its integers widen to int64, so a loop of
``int8 * int8`` sums vectorises four lanes at a time (``vpmuldq``) if at all. These
``@intrinsic`` functions build the vector code directly: 32 weights a step as ``<32 x i8>``,
multiplied and summed in pairs into ``<8 x i32>`` lanes (lane k: weights 4k..4k+3, so
16-weight sub-blocks land in lanes 0-3 and 4-7), scaled once per block into an ``<8 x f32>``
accumulator, summed across lanes once per row. On x86 with AVX2 the pair sums are
``vpmaddubsw``/``vpmaddwd`` (as llama.cpp's AVX2 kernels); on any other target the same
arithmetic in generic vector IR (zero/sign extensions, multiplies, even/odd shuffles), which
LLVM lowers to whatever the CPU has (NEON on ARM). The layouts they read are
``numba_packed``'s; every pointer argument is an address (``array.ctypes.data``).

The jitted side of ``numba_pool`` (claiming chunks of rows, running a job's rows) is here too,
beside the intrinsics it inlines: Numba's on-disk cache only notices edits to the file a
function is defined in, so code compiled around these kernels in another file would keep
running a stale kernel after an edit here.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .numba_quant import _JIT

I8, I16, I32, I64, F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), \
    ir.FloatType()


def _vec(t, n: int) -> ir.VectorType:
    return ir.VectorType(t, n)


def _const(t, values) -> ir.Constant:
    return ir.Constant(_vec(t, len(values)), [ir.Constant(t, int(v)) for v in values])


def _splat(b: ir.IRBuilder, value, n: int):
    v = b.insert_element(ir.Constant(_vec(value.type, n), None), value, ir.Constant(I32, 0))
    return b.shuffle_vector(v, v, ir.Constant(_vec(I32, n), [ir.Constant(I32, 0)] * n))


def _pick(b: ir.IRBuilder, v, idx):
    return b.shuffle_vector(v, v, _const(I32, idx))


def _load(b: ir.IRBuilder, addr, byte_offset, t):
    """t at byte address addr + byte_offset (unaligned)."""
    p = b.inttoptr(b.add(addr, byte_offset), t.as_pointer())
    return b.load(p, align=1)


#: bytes ahead of the weights being read that each kernel step asks for (the C kernels' idea,
#: native/cpu_kernels.c; fixed here: Numba caches the compiled code). Non-temporal: read once
#: a token. Numba decode, alternating builds on 2 Zen 5 cores: Gemma 3 270M 8.6-8.9 -> 7.6-7.9
#: ms a token, the 0.5B 14.0-15.8 -> 13.0-13.5, the 1.5B 28.0 -> 22.7-24.4
NUMBA_PREFETCH_AHEAD = 4096


def _prefetch(b: ir.IRBuilder, addr, byte_offset):
    """Ask for the line at addr + byte_offset + NUMBA_PREFETCH_AHEAD, non-temporal."""
    p = b.inttoptr(b.add(b.add(addr, byte_offset), _c(NUMBA_PREFETCH_AHEAD)), I8.as_pointer())
    fn = _fn(b, "llvm.prefetch.p0", ir.VoidType(), [p.type, I32, I32, I32])
    b.call(fn, [p, ir.Constant(I32, 0), ir.Constant(I32, 0), ir.Constant(I32, 1)])


def _fn(b: ir.IRBuilder, name: str, ret, args):
    return cgutils.get_or_insert_function(b.module, ir.FunctionType(ret, args), name)


def _has_avx2(context) -> bool:
    """Whether the code is compiled for a CPU with AVX2 (Numba's target: the host, or
    NUMBA_CPU_NAME/NUMBA_CPU_FEATURES)."""
    codegen = context.codegen()
    features = getattr(codegen, "_tm_features", "") or ""
    if not features and hasattr(codegen, "_get_host_cpu_features"):
        features = codegen._get_host_cpu_features()
    return "+avx2" in features


def _udot(b: ir.IRBuilder, avx2: bool, w, x):
    """w <32 x i8> unsigned (each pair's products must fit int16: w <= 127 here), x <32 x i8>
    signed -> <8 x i32>, lane k = sum of w[i] * x[i] for i in 4k..4k+3."""
    if avx2:
        pairs = b.call(_fn(b, "llvm.x86.avx2.pmadd.ub.sw", _vec(I16, 16),
                           [_vec(I8, 32), _vec(I8, 32)]), [w, x])
        return b.call(_fn(b, "llvm.x86.avx2.pmadd.wd", _vec(I32, 8),
                          [_vec(I16, 16), _vec(I16, 16)]), [pairs, _const(I16, [1] * 16)])
    prod = b.mul(b.zext(w, _vec(I32, 32)), b.sext(x, _vec(I32, 32)))  # (32,) i32
    pairs = b.add(_pick(b, prod, range(0, 32, 2)), _pick(b, prod, range(1, 32, 2)))
    return b.add(_pick(b, pairs, range(0, 16, 2)), _pick(b, pairs, range(1, 16, 2)))


def _udot_scaled(b: ir.IRBuilder, avx2: bool, w, x, scales):
    """_udot with lane k multiplied by scales <8 x i32> (each scale repeated over the lanes of
    one sub-block; |scale| < 2^15). On AVX2 the scale rides in vpmaddwd's second operand (the
    16-bit lanes 2k, 2k + 1 of lane k) instead of a 32-bit multiply."""
    if avx2:
        pairs = b.call(_fn(b, "llvm.x86.avx2.pmadd.ub.sw", _vec(I16, 16),
                           [_vec(I8, 32), _vec(I8, 32)]), [w, x])
        s16 = _pick(b, b.trunc(scales, _vec(I16, 8)), [k // 2 for k in range(16)])
        return b.call(_fn(b, "llvm.x86.avx2.pmadd.wd", _vec(I32, 8),
                          [_vec(I16, 16), _vec(I16, 16)]), [pairs, s16])
    return b.mul(_udot(b, avx2, w, x), scales)


def _sdot(b: ir.IRBuilder, avx2: bool, w, x):
    """As _udot for signed w <32 x i8> (|w| <= 127 pairs fit int16 with x in -127..127)."""
    if avx2:  # |w| * (x with w's sign): vpabsb, vpsignb, then the unsigned products
        aw = b.call(_fn(b, "llvm.abs.v32i8", _vec(I8, 32), [_vec(I8, 32), ir.IntType(1)]),
                    [w, ir.Constant(ir.IntType(1), 0)])
        sx = b.call(_fn(b, "llvm.x86.avx2.psign.b", _vec(I8, 32), [_vec(I8, 32), _vec(I8, 32)]),
                    [x, w])
        return _udot(b, avx2, aw, sx)
    prod = b.mul(b.sext(w, _vec(I32, 32)), b.sext(x, _vec(I32, 32)))
    pairs = b.add(_pick(b, prod, range(0, 32, 2)), _pick(b, prod, range(1, 32, 2)))
    return b.add(_pick(b, pairs, range(0, 16, 2)), _pick(b, pairs, range(1, 16, 2)))


def _nibbles(b: ir.IRBuilder, v, n: int):
    """v <n x i8> -> (low nibbles, high nibbles), each <n x i8>."""
    return b.and_(v, _const(I8, [15] * n)), b.lshr(v, _const(I8, [4] * n))


def _fma(b: ir.IRBuilder, acc, ints, scale):
    """acc + f32(ints <8 x i32>) * scale (a scalar f32, splatted)."""
    return b.fadd(acc, b.fmul(b.sitofp(ints, _vec(F32, 8)), _splat(b, scale, 8),
                              flags=("fast",)), flags=("fast",))


def _row_loop(b: ir.IRBuilder, count, body):
    """sum over i < count of body(b, i) (an <8 x f32>), reduced to one f32."""
    accp = cgutils.alloca_once_value(b, ir.Constant(_vec(F32, 8), None))
    with cgutils.for_range(b, count) as loop:
        b.store(body(b, loop.index, b.load(accp)), accp)
    reduce = _fn(b, "llvm.vector.reduce.fadd.v8f32", F32, [F32, _vec(F32, 8)])
    return b.call(reduce, [ir.Constant(F32, 0.0), b.load(accp)], fastmath=("fast",))


def _c(v: int):
    return ir.Constant(I64, v)


_ADDR = types.intp


@intrinsic
def dot_q8_0(typingctx, q, d, xq, xd, blocks):
    """Row of Q8_0: q int8 (32 * blocks,), d f32 (blocks,) . xq int8, xd f32 (Q8_0)."""
    sig = types.float32(_ADDR, _ADDR, _ADDR, _ADDR, _ADDR)

    def codegen(context, b, signature, args):
        q, d, xq, xd, blocks = args
        avx2 = _has_avx2(context)

        def block(b, i, acc):
            off = b.mul(i, _c(32))
            _prefetch(b, q, off)
            s = _sdot(b, avx2, _load(b, q, off, _vec(I8, 32)), _load(b, xq, off, _vec(I8, 32)))
            scale = b.fmul(_load(b, d, b.mul(i, _c(4)), F32), _load(b, xd, b.mul(i, _c(4)), F32))
            return _fma(b, acc, s, scale)

        return _row_loop(b, blocks, block)

    return sig, codegen


def _q5_0_bits(b: ir.IRBuilder, h, lanes):
    """16 or 0 in each of 32 lanes: bit (lane % 8) of byte lanes[lane // 8] of h <8 x i8>."""
    spread = _const(I32, [lanes[i // 8] for i in range(32)])
    bit = _const(I8, [1 << (i % 8) for i in range(32)])
    set_ = b.icmp_unsigned("!=", b.and_(b.shuffle_vector(h, h, spread), bit),
                           _const(I8, [0] * 32))
    return b.select(set_, _const(I8, [16] * 32), _const(I8, [0] * 32))


@intrinsic
def dot_q5_0(typingctx, nib, qh, d, xq, xd, xs, blocks):
    """Row of Q5_0: nib u8 (16 * blocks,) ggml's nibbles, qh u32 (blocks,) fifth bits,
    d f32 (blocks,) . xq int8, xd f32, xs int32 (blocks,) sums of xq (Q8_0).

    Two blocks a step: their 32 nibble bytes in one load, the low nibbles (weights 0-15 of
    each) against x[0:16] of each block and the high ones against x[16:32], so lanes 0-3 of
    the sums are the first block's and 4-7 the second's, each scaled by its own d * xd."""
    sig = types.float32(_ADDR, _ADDR, _ADDR, _ADDR, _ADDR, _ADDR, _ADDR)

    def codegen(context, b, signature, args):
        nib, qh, d, xq, xd, xs, blocks = args
        avx2 = _has_avx2(context)
        v16 = _vec(I8, 16)

        def halves(b, at, first):
            """x[first:first + 16] of two consecutive blocks at byte address ``at``."""
            a = _load(b, xq, b.add(at, _c(first)), v16)
            c = _load(b, xq, b.add(at, _c(32 + first)), v16)
            return b.shuffle_vector(a, c, _const(I32, range(32)))

        def pair(b, p, acc):
            _prefetch(b, nib, b.mul(p, _c(32)))
            lo, hi = _nibbles(b, _load(b, nib, b.mul(p, _c(32)), _vec(I8, 32)), 32)
            h = _load(b, qh, b.mul(p, _c(8)), _vec(I8, 8))  # two blocks' u32 fifth bits
            lo = b.or_(lo, _q5_0_bits(b, h, (0, 1, 4, 5)))
            hi = b.or_(hi, _q5_0_bits(b, h, (2, 3, 6, 7)))
            at = b.mul(p, _c(64))
            s = b.add(_udot(b, avx2, lo, halves(b, at, 0)), _udot(b, avx2, hi, halves(b, at, 16)))
            # the weights' -16 offset: -16 * sum(x) of each block, in lanes 0 and 4
            sums = b.mul(_load(b, xs, b.mul(p, _c(8)), _vec(I32, 2)), _const(I32, [-16, -16]))
            s = b.add(s, b.shuffle_vector(sums, ir.Constant(_vec(I32, 2), None),
                                          _const(I32, [0, 2, 2, 2, 1, 2, 2, 2])))
            scale = b.fmul(_load(b, d, b.mul(p, _c(8)), _vec(F32, 2)),
                           _load(b, xd, b.mul(p, _c(8)), _vec(F32, 2)))
            lanes = _pick(b, scale, [0, 0, 0, 0, 1, 1, 1, 1])
            return b.fadd(acc, b.fmul(b.sitofp(s, _vec(F32, 8)), lanes, flags=("fast",)),
                          flags=("fast",))

        acc = _row_loop(b, b.udiv(blocks, _c(2)), pair)
        return _q5_0_tail(b, avx2, args, acc, b.sub(blocks, _c(1)))

    return sig, codegen


def _q5_0_tail(b, avx2, args, acc, last):
    """acc plus block ``last`` of a row with an odd number of Q5_0 blocks (else acc)."""
    nib, qh, d, xq, xd, xs, blocks = args
    odd = b.icmp_unsigned("==", b.urem(blocks, _c(2)), _c(1))
    result = cgutils.alloca_once_value(b, acc)
    with b.if_then(odd):
        lo, hi = _nibbles(b, _load(b, nib, b.mul(last, _c(16)), _vec(I8, 16)), 16)
        w = b.shuffle_vector(lo, hi, _const(I32, range(32)))  # weights 0..31
        h4 = _load(b, qh, b.mul(last, _c(4)), _vec(I8, 4))
        h = b.shuffle_vector(h4, h4, _const(I32, [0, 1, 2, 3, 0, 1, 2, 3]))
        w = b.or_(w, _q5_0_bits(b, h, (0, 1, 2, 3)))
        s = _udot(b, avx2, w, _load(b, xq, b.mul(last, _c(32)), _vec(I8, 32)))
        off = b.mul(_load(b, xs, b.mul(last, _c(4)), I32), ir.Constant(I32, -16))
        s = b.add(s, b.insert_element(ir.Constant(_vec(I32, 8), None), off, ir.Constant(I32, 0)))
        scale = b.fmul(_load(b, d, b.mul(last, _c(4)), F32), _load(b, xd, b.mul(last, _c(4)), F32))
        total = b.call(_fn(b, "llvm.vector.reduce.add.v8i32", I32, [_vec(I32, 8)]), [s])
        b.store(b.fadd(acc, b.fmul(b.sitofp(total, F32), scale)), result)
    return b.load(result)


@intrinsic
def dot_q4_k(typingctx, nib, sc, mn, dd, dm, xq, xd, xs, supers):
    """Row of Q4_K: nib u8 (128 * supers,) the file's nibbles (32 bytes: sub-blocks 2j low,
    2j + 1 high), sc, mn u8 (8 * supers,) 6-bit scales and mins, dd, dm f32 (supers,)
    . xq int8, xd f32 (supers,), xs int32 (8 * supers,) sums of xq per 32 (Q8_K)."""
    sig = types.float32(*([_ADDR] * 9))

    def codegen(context, b, signature, args):
        nib, sc, mn, dd, dm, xq, xd, xs, supers = args
        avx2 = _has_avx2(context)

        def superblock(b, s, acc):
            total = ir.Constant(_vec(I32, 8), None)
            _prefetch(b, nib, b.mul(s, _c(128)))
            _prefetch(b, nib, b.add(b.mul(s, _c(128)), _c(64)))
            for j in range(4):
                lo, hi = _nibbles(b, _load(b, nib, b.add(b.mul(s, _c(128)), _c(32 * j)),
                                           _vec(I8, 32)), 32)
                xo = b.add(b.mul(s, _c(256)), _c(64 * j))
                for k, w in ((0, lo), (1, hi)):
                    scale = b.zext(_load(b, sc, b.add(b.mul(s, _c(8)), _c(2 * j + k)), I8), I32)
                    total = b.add(total, _udot_scaled(
                        b, avx2, w, _load(b, xq, b.add(xo, _c(32 * k)), _vec(I8, 32)),
                        _splat(b, scale, 8)))
            mins = b.mul(b.zext(_load(b, mn, b.mul(s, _c(8)), _vec(I8, 8)), _vec(I32, 8)),
                         _load(b, xs, b.mul(s, _c(32)), _vec(I32, 8)))  # m_j * sum(x_j)
            xds = _load(b, xd, b.mul(s, _c(4)), F32)
            acc = _fma(b, acc, total, b.fmul(_load(b, dd, b.mul(s, _c(4)), F32), xds))
            return _fma(b, acc, mins, b.fneg(b.fmul(_load(b, dm, b.mul(s, _c(4)), F32), xds)))

        return _row_loop(b, supers, superblock)

    return sig, codegen


@intrinsic
def dot_q6_k(typingctx, ql, qh, sc, d, xq, xd, xs, supers):
    """Row of Q6_K: ql u8 (128 * supers,), qh u8 (64 * supers,) the file's low and high
    bits, sc int8 (16 * supers,), d f32 (supers,) . xq int8, xd f32 (supers,), xs int32
    (16 * supers,) sums of xq per 16 (Q8_K)."""
    sig = types.float32(*([_ADDR] * 8))

    def codegen(context, b, signature, args):
        ql, qh, sc, d, xq, xd, xs, supers = args
        avx2 = _has_avx2(context)
        v32 = _vec(I8, 32)

        def mask(v):
            return _const(I8, [v] * 32)

        def superblock(b, s, acc):
            total = ir.Constant(_vec(I32, 8), None)
            _prefetch(b, ql, b.mul(s, _c(128)))
            _prefetch(b, ql, b.add(b.mul(s, _c(128)), _c(64)))
            _prefetch(b, qh, b.mul(s, _c(64)))
            scales = b.sext(_load(b, sc, b.mul(s, _c(16)), _vec(I8, 16)), _vec(I32, 16))
            for h in range(2):
                a = _load(b, ql, b.add(b.mul(s, _c(128)), _c(64 * h)), v32)
                c = _load(b, ql, b.add(b.mul(s, _c(128)), _c(64 * h + 32)), v32)
                hb = _load(b, qh, b.add(b.mul(s, _c(64)), _c(32 * h)), v32)
                ws = (b.or_(b.and_(a, mask(15)), b.shl(b.and_(hb, mask(3)), mask(4))),
                      b.or_(b.and_(c, mask(15)), b.shl(b.and_(hb, mask(12)), mask(2))),
                      b.or_(b.lshr(a, mask(4)), b.and_(hb, mask(48))),
                      b.or_(b.lshr(c, mask(4)), b.lshr(b.and_(hb, mask(192)), mask(2))))
                for g, w in enumerate(ws):
                    x = _load(b, xq, b.add(b.mul(s, _c(256)), _c(128 * h + 32 * g)), v32)
                    # lanes 0-3: sub-block 2g, 4-7: 2g + 1
                    first = 8 * h + 2 * g
                    lanes = _pick(b, scales, [first] * 4 + [first + 1] * 4)
                    total = b.add(total, _udot_scaled(b, avx2, w, x, lanes))
            # the weights' -32 offset: -32 * sum over sub-blocks of scale * sum(x)
            sums = b.mul(scales, _load(b, xs, b.mul(s, _c(64)), _vec(I32, 16)))
            sums = b.add(_pick(b, sums, range(8)), _pick(b, sums, range(8, 16)))
            total = b.sub(total, b.shl(sums, _const(I32, [5] * 8)))
            xds = _load(b, xd, b.mul(s, _c(4)), F32)
            return _fma(b, acc, total, b.fmul(_load(b, d, b.mul(s, _c(4)), F32), xds))

        return _row_loop(b, supers, superblock)

    return sig, codegen


# -- atomics and raw stores for the thread pool (numba_pool) ---------------------------------
@intrinsic
def atomic_load(typingctx, addr):
    """The int64 at addr, read atomically (sequentially consistent)."""
    sig = types.int64(_ADDR)

    def codegen(context, b, signature, args):
        p = b.inttoptr(args[0], I64.as_pointer())
        return b.load_atomic(p, "seq_cst", 8)

    return sig, codegen


@intrinsic
def atomic_store(typingctx, addr, value):
    """Store the int64 value at addr atomically (sequentially consistent: the stores before it
    are visible to a thread that reads it)."""
    sig = types.void(_ADDR, types.int64)

    def codegen(context, b, signature, args):
        p = b.inttoptr(args[0], I64.as_pointer())
        b.store_atomic(args[1], p, "seq_cst", 8)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def atomic_cas(typingctx, addr, expected, desired):
    """Compare-and-swap the int64 at addr: True where it held ``expected`` (now ``desired``)."""
    sig = types.boolean(_ADDR, types.int64, types.int64)

    def codegen(context, b, signature, args):
        p = b.inttoptr(args[0], I64.as_pointer())
        pair = b.cmpxchg(p, args[1], args[2], "seq_cst", "seq_cst")
        return b.extract_value(pair, 1)

    return sig, codegen


@intrinsic
def atomic_add(typingctx, addr, value):
    """Add value to the int64 at addr atomically; returns the old value."""
    sig = types.int64(_ADDR, types.int64)

    def codegen(context, b, signature, args):
        p = b.inttoptr(args[0], I64.as_pointer())
        return b.atomic_rmw("add", p, args[1], "seq_cst")

    return sig, codegen


@intrinsic
def store_f32(typingctx, addr, value):
    """Store the f32 value at byte address addr."""
    sig = types.void(_ADDR, types.float32)

    def codegen(context, b, signature, args):
        b.store(args[1], b.inttoptr(args[0], F32.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def spin_pause(typingctx):
    """A spin-wait hint to the core (x86 pause; elsewhere nothing)."""
    sig = types.void()

    def codegen(context, b, signature, args):
        triple = context.codegen()._tm.triple if hasattr(context.codegen(), "_tm") else ""
        if "x86" in str(triple):
            b.call(_fn(b, "llvm.x86.sse2.pause", ir.VoidType(), []), [])
        return context.get_dummy_value()

    return sig, codegen


# -- the mat-vec jobs the pool (numba_pool) runs ---------------------------------------------
# Here, beside the intrinsics they inline: Numba's on-disk cache only notices changes to the
# file a function is defined in, so code compiled around these kernels must live in this file.
#: rows per unit of work (as the C kernels)
CHUNK_ROWS = 16
#: idle polls (~0.2 ms) before a helper goes to sleep
SPIN_POLLS = 5000
#: kernel kinds in a job
KINDS = {"Q8_0": 0, "Q5_0": 1, "Q4_K": 2, "Q6_K": 3}

# ctl (int64): its own cache line each for the counter, the done count and the sleepers; then
# the job: kind, rows, blocks, 5 plane addresses, 5 plane strides, 3 activation addresses,
# 3 activation strides, out address, out stride (bytes per token), tokens
_CTR, _DONE, _SLEEPING, _JOB = 0, 8, 16, 24
#: a weight's part of a job (kind, rows, blocks, 5 addresses, 5 strides)
WEIGHT_FIELDS = 13
_ACT = _JOB + WEIGHT_FIELDS
_OUT, _OUT_STRIDE, _TOKENS = _ACT + 6, _ACT + 7, _ACT + 8
#: a claim takes 1/parts of the chunks left (set once per pool: CLAIM_PARTS x threads)
_PARTS = _TOKENS + 1
_CTL_WORDS = _PARTS + 1
#: as the C pool's decode mat-vecs (native/cpu_pool.c, MATVEC_PARTS): claims of half of what
#: is left per thread, not one chunk each (a claim moves a cache line between cores). Every
#: job here is a decode step's (at most MATVEC_MAX_TOKENS tokens: prompts take tiles + BLAS).
#: Halves against quarters, interleaved: Numba decode Gemma 9.70 -> 8.29 ms a token, 0.5B
#: 16.73 -> 14.40
CLAIM_PARTS = 1


@nb.njit(inline="always", **_JIT)
def _run_chunk(ctl, c):
    """Rows 16c..16c+15 of the published job, for each of its tokens."""
    kind, rows, blocks = ctl[_JOB], ctl[_JOB + 1], ctl[_JOB + 2]
    p0, p1, p2, p3, p4 = ctl[_JOB + 3], ctl[_JOB + 4], ctl[_JOB + 5], ctl[_JOB + 6], ctl[_JOB + 7]
    s0, s1, s2, s3, s4 = ctl[_JOB + 8], ctl[_JOB + 9], ctl[_JOB + 10], ctl[_JOB + 11], \
        ctl[_JOB + 12]
    xq, xd, xs = ctl[_ACT], ctl[_ACT + 1], ctl[_ACT + 2]
    tq, td, ts = ctl[_ACT + 3], ctl[_ACT + 4], ctl[_ACT + 5]
    out, out_stride, n = ctl[_OUT], ctl[_OUT_STRIDE], ctl[_TOKENS]
    for r in range(c * CHUNK_ROWS, min(rows, c * CHUNK_ROWS + CHUNK_ROWS)):
        a0, a1, a2, a3, a4 = p0 + r * s0, p1 + r * s1, p2 + r * s2, p3 + r * s3, p4 + r * s4
        for t in range(n):
            q, d, s = xq + t * tq, xd + t * td, xs + t * ts
            if kind == 0:
                v = dot_q8_0(a0, a1, q, d, blocks)
            elif kind == 1:
                v = dot_q5_0(a0, a1, a2, q, d, s, blocks)
            elif kind == 2:
                v = dot_q4_k(a0, a1, a2, a3, a4, q, d, s, blocks)
            else:
                v = dot_q6_k(a0, a1, a2, a3, q, d, s, blocks)
            store_f32(out + t * out_stride + 4 * r, v)


@nb.njit(inline="always", **_JIT)
def _work(ctl, gen):
    """Claim and run chunks of job generation gen until none are left."""
    at = np.int64(ctl.ctypes.data)
    v = atomic_load(at + 8 * _CTR)
    while True:
        chunks, nxt = (v >> 20) & 0xFFFFF, v & 0xFFFFF
        if (v >> 40) != gen or nxt >= chunks:
            return
        take = max((chunks - nxt) // ctl[_PARTS], 1)
        if atomic_cas(at + 8 * _CTR, v, v + take):
            for c in range(nxt, nxt + take):
                _run_chunk(ctl, c)
            atomic_add(at + 8 * _DONE, take)
        v = atomic_load(at + 8 * _CTR)


@nb.njit(inline="always", **_JIT)
def _write_job(ctl, job, xq, xd, xs, out):
    """The job's weight fields, activations and output into ctl (not yet opened)."""
    for i in range(WEIGHT_FIELDS):
        ctl[_JOB + i] = job[i]
    ctl[_ACT], ctl[_ACT + 1], ctl[_ACT + 2] = xq.ctypes.data, xd.ctypes.data, xs.ctypes.data
    ctl[_ACT + 3], ctl[_ACT + 4], ctl[_ACT + 5] = xq.strides[0], xd.strides[0], xs.strides[0]
    ctl[_OUT], ctl[_OUT_STRIDE], ctl[_TOKENS] = out.ctypes.data, out.strides[0], xq.shape[0]


@nb.njit(nogil=True, **_JIT)
def _publish(ctl, job, xq, xd, xs, out):
    """Write the job into ctl and open it (a new generation); returns the generation and
    whether a helper sleeps (then the caller wakes it)."""
    at = np.int64(ctl.ctypes.data)
    _write_job(ctl, job, xq, xd, xs, out)
    chunks = (job[1] + CHUNK_ROWS - 1) // CHUNK_ROWS
    atomic_store(at + 8 * _DONE, 0)
    gen = ((atomic_load(at + 8 * _CTR) >> 40) + 1) & 0xFFFFFF
    atomic_store(at + 8 * _CTR, (gen << 40) | (chunks << 20))
    return gen, atomic_load(at + 8 * _SLEEPING) > 0


@nb.njit(nogil=True, **_JIT)
def _work_and_wait(ctl, gen, chunks):
    """The caller's share of job gen, then wait for chunks the helpers claimed."""
    _work(ctl, gen)
    at = np.int64(ctl.ctypes.data)
    while atomic_load(at + 8 * _DONE) < chunks:
        spin_pause()


@nb.njit(nogil=True, **_JIT)
def _helper_poll(ctl, seen, polls):
    """Run jobs as they are published; return the last generation seen once ``polls``
    consecutive polls found nothing new."""
    at = np.int64(ctl.ctypes.data)
    idle = 0
    while idle < polls:
        gen = atomic_load(at + 8 * _CTR) >> 40
        if gen != seen:
            seen = gen
            _work(ctl, gen)
            idle = 0
        else:
            idle += 1
            spin_pause()
    return seen


@nb.njit(nogil=True, **_JIT)
def _run_alone(ctl, job, xq, xd, xs, out):
    """The whole job on the calling thread (one thread, or too few rows to share)."""
    _write_job(ctl, job, xq, xd, xs, out)
    for c in range((job[1] + CHUNK_ROWS - 1) // CHUNK_ROWS):
        _run_chunk(ctl, c)


@nb.njit(**_JIT)
def _add(ctl, i, value):
    atomic_add(np.int64(ctl.ctypes.data) + 8 * i, value)


@nb.njit(**_JIT)
def _get(ctl, i):
    return atomic_load(np.int64(ctl.ctypes.data) + 8 * i)
