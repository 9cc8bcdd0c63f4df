"""Loader for the optional C kernels, built with cffi on first use.

x86 builds cpu_kernels.c + cpu_gemm.c + cpu_packed.c, aarch64 builds cpu_neon.c (each after the
shared thread pool, cpu_pool.c, and before the portable attention entry points and the
whole-block decode, cpu_attention_batch.c and cpu_block.c). The build picks the best
instruction set this CPU has (AVX-512 VNNI, else AVX2, never AMX; NEON with dotprod, else
plain NEON), compiles once into a cache folder keyed by the source's hash and the flags, and
loads the result. ``load()`` returns None, never raises, where there is no such CPU, no
compiler or no cffi: callers fall back to the Numba kernels.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Any

from edgellm.atomic import fsync_dir

#: per architecture, compiled as one unit in this order (the thread pool first; on x86 the GEMM
#: uses the mat-vec file's helpers, the packed weights the GEMM's tiles)
SOURCES: dict[str, tuple[Path, ...]] = {
    arch: tuple(Path(__file__).with_name(name) for name in names)
    for arch, names in (("x86_64", ("cpu_pool.c", "cpu_kernels.c", "cpu_gemm.c", "cpu_packed.c",
                                    "cpu_attention_batch.c", "cpu_block.c")),
                        ("aarch64", ("cpu_pool.c", "cpu_neon.c", "cpu_attention_batch.c",
                                     "cpu_block.c")))}

CDEF = """
int ek_supports(int qtype);
void ek_set_prefetch_ahead(int bytes);
int ek_prefetch_ahead(void);
int ek_matmul_f32(int qtype, const uint8_t *w, int64_t row_bytes, int rows, int cols,
                  const float *x, int n, float *out, int nthreads, int gemm_min);
int ek_matvec_multi(int count, const int *qtypes, const uint8_t *const *ws,
                    const int64_t *row_bytes, const int *rows, int cols, const float *x, int n,
                    float *out, int nthreads);
int64_t ek_packed_bytes(int qtype, int rows, int cols);
int ek_pack(int qtype, const uint8_t *w, int64_t row_bytes, int rows, int cols, uint8_t *dst,
            int nthreads);
int ek_matmul_packed(int qtype, const uint8_t *packed, int rows, int cols, const float *x,
                     int n, float *out, int nthreads);
int ek_matmul_packed_multi(int count, const int *qtypes, const uint8_t *const *packed,
                           const int *rows, int cols, const float *x, int n, float *out,
                           int nthreads);
int ek_packed_rows(int qtype, const uint8_t *packed, int rows, int cols, const int64_t *ids,
                   int n, float *out);
void ek_rms_norm(const float *x, const float *w, float *out, int64_t rows, int d, float eps);
void ek_rope(const float *x, const float *cos, const float *sin, float *out, int n, int heads,
             int hd, int neox);
void ek_silu_mul(const float *gate, const float *up, float *out, int64_t n, int nthreads);
void ek_gelu_tanh_mul(const float *gate, const float *up, float *out, int64_t n,
                      int nthreads);
int ek_attention_f16(const float *q, const uint16_t *k, const uint16_t *v, const uint8_t *mask,
                     int n, int n_heads, int n_kv, int hd, int T, float scale, float softcap,
                     float *out, int nthreads);
int ek_attention_f16_batch(int count, const float *q, const uint16_t *const *k,
                           const uint16_t *const *v, const uint8_t *const *mask, const int *n,
                           const int *T, int n_heads, int n_kv, int hd, float scale,
                           float softcap, float *out, int nthreads);
int ek_attention_f16_append(int count, const float *q, const float *k_new, const float *v_new,
                            uint16_t *const *kc, uint16_t *const *vc, const int *slot,
                            const int *lo, int n_heads, int n_kv, int hd, float scale,
                            float softcap, float *out, int nthreads);
typedef struct {
    int d, n_heads, n_kv, hd, ffn;
    float eps, scale, softcap;
    int neox;
    int gelu;
    const float *attn_norm, *q_norm, *k_norm, *post_attn_norm, *ffn_norm, *post_ffn_norm;
    const int *qkv_types;
    const uint8_t *const *qkv;
    const float *const *qkv_bias;
    int wo_type, gate_up_types[2], down_type;
    const uint8_t *wo, *down;
    const uint8_t *const *gate_up;
} block_t;
int ek_decode_block(const block_t *b, float *x, int n, uint16_t *const *kc, uint16_t *const *vc,
                    const int *slot, const int *lo, const float *cos, const float *sin,
                    float *scratch, int nthreads, int attn_threads);
int ek_decode_blocks(const block_t *const *b, int n_blocks, float *x, int n,
                     uint16_t *const *kc, uint16_t *const *vc, const int *slot, const int *lo,
                     const float *const *cos, const float *const *sin, float *scratch,
                     int nthreads, const int *attn_threads);
"""

#: instruction-set variant -> (cpuinfo flags it needs, compiler flags)
VARIANTS: dict[str, tuple[tuple[str, ...], list[str]]] = {
    "avx512vnni": (("avx2", "fma", "f16c", "avx512bw", "avx512vl", "avx512_vnni"),
                   ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
                    "-mavx512vnni"]),
    # AVX2 with the VEX-encoded vpdpbusd (Intel since Alder Lake, AMD since Zen 4)
    "avx2vnni": (("avx2", "fma", "f16c", "avx_vnni"), ["-mavx2", "-mfma", "-mf16c", "-mavxvnni"]),
    "avx2": (("avx2", "fma", "f16c"), ["-mavx2", "-mfma", "-mf16c"]),
    # aarch64 (/proc/cpuinfo "Features"): smmla with i8mm (Apple M2+, Snapdragon X, Graviton 3),
    # sdot with dotprod (Armv8.2+: Apple M1, Cortex-A76/Pi 5), else vmull_s8 + pairwise adds
    # (Cortex-A72/Pi 4)
    "neon_i8mm": (("asimd", "asimddp", "i8mm"), ["-march=armv8.6-a+i8mm"]),
    "neon_dotprod": (("asimd", "asimddp"), ["-march=armv8.2-a+dotprod"]),
    "neon": (("asimd",), ["-march=armv8-a"]),
}

_loaded: dict[str, Any] = {}


def machine_arch() -> str | None:
    """"x86_64" or "aarch64" (the architectures with C kernels), or None."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        return "x86_64"
    if machine in ("aarch64", "arm64"):
        return "aarch64"
    return None


def variant_arch(variant: str) -> str:
    """The architecture a kernel variant is built for."""
    return "aarch64" if variant.startswith("neon") else "x86_64"


def _darwin_arm_flags() -> set[str]:
    """macOS on Apple silicon has no /proc/cpuinfo: its sysctl names, as Linux's flags."""
    flags = {"asimd"}
    for flag, key in (("asimddp", "FEAT_DotProd"), ("i8mm", "FEAT_I8MM")):
        try:
            got = subprocess.run(["sysctl", "-n", f"hw.optional.arm.{key}"],
                                 capture_output=True, text=True, timeout=5).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            got = ""
        if got == "1":
            flags.add(flag)
    return flags


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo ("flags" on x86, "Features" on ARM; empty
    where that is unavailable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    if platform.system() == "Darwin" and machine_arch() == "aarch64":
        return _darwin_arm_flags()
    return set()


def runnable_variants() -> list[str]:
    """The kernel variants this CPU executes, fastest first (empty off x86-64 and aarch64)."""
    arch = machine_arch()
    if arch is None:
        return []
    flags = cpu_flags()
    return [name for name, (needs, _) in VARIANTS.items()
            if variant_arch(name) == arch and all(f in flags for f in needs)]


def best_variant() -> str | None:
    """The fastest kernel variant this CPU runs, or None off x86-64 and aarch64."""
    runnable = runnable_variants()
    return runnable[0] if runnable else None


#: environment variable that forces a variant (or "numba", the no-C path) instead of the best
ISA_ENV = "EDGELLM_ISA"


def requested_isa() -> str | None:
    """$EDGELLM_ISA: a variant this CPU runs, or "numba"; None where unset (the best).

    Raises ValueError, naming the choices, for a variant this CPU cannot execute (running it
    would die on an illegal instruction) or a name that is no variant at all."""
    name = os.environ.get(ISA_ENV, "").strip().lower()
    if not name or name == "auto":
        return None
    choices = runnable_variants() + ["numba"]
    if name not in choices:
        known = "a variant this CPU cannot run" if name in VARIANTS else "not a variant"
        raise ValueError(f"{ISA_ENV}={name}: {known}; choose one of {', '.join(choices)}")
    return name


def cache_dir() -> Path:
    base = os.environ.get("EDGELLM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "edgellm")
    return Path(base) / "native"


def build_extension(prefix: str, source: str, cdef: str, flags: list[str],
                    link_args: tuple[str, ...] = ()) -> Path:
    """A cffi extension of ``source`` in the cache, compiled once per source, cdef and flags.

    Built in a private folder, then renamed into the cache: a build killed mid-link never
    leaves a truncated library under the name later runs would load.
    """
    import cffi

    key = hashlib.sha256((source + cdef + " ".join(flags)).encode()).hexdigest()[:12]
    name = f"{prefix}_{key}"
    out_dir = cache_dir()
    found = list(out_dir.glob(name + "*.so")) if out_dir.is_dir() else []
    if found:
        return found[0]
    out_dir.mkdir(parents=True, exist_ok=True)
    ffi = cffi.FFI()
    ffi.cdef(cdef)
    ffi.set_source(name, source, extra_compile_args=flags, extra_link_args=list(link_args))
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".build-") as tmp:
        built = Path(ffi.compile(tmpdir=tmp))
        final = out_dir / built.name
        os.replace(built, final)
    fsync_dir(out_dir)
    return final


def import_extension(path: Path) -> Any:
    """The compiled module at ``path`` (``.lib``, ``.ffi``)."""
    spec = importlib.util.spec_from_file_location(path.name.split(".")[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(variant: str) -> Path:
    flags = ["-O3", "-pthread", "-fno-math-errno"] + VARIANTS[variant][1]
    source = "\n".join(path.read_text() for path in SOURCES[variant_arch(variant)])
    return build_extension(f"_edgellm_cpu_{variant}", source, CDEF, flags, ("-pthread",))


def load(variant: str | None = None) -> Any | None:
    """The compiled kernel module (``.lib``, ``.ffi``) for variant (default: best), or None."""
    variant = variant or best_variant()
    if variant is None or variant_arch(variant) != machine_arch():
        return None  # none here, or another architecture's (the AVX2 build on an ARM CPU)
    if variant not in _loaded:
        try:
            module = import_extension(_build(variant))
        except Exception as exc:  # no compiler, no cffi, odd toolchain: use Numba instead
            warnings.warn(f"edgellm: C kernels unavailable ({exc}); using Numba", stacklevel=2)
            module = None
        _loaded[variant] = module
    return _loaded[variant]


def variant_of(module: Any) -> str:
    """The variant name a module returned by ``load`` was built for."""
    return next(name for name, loaded in _loaded.items() if loaded is module)
