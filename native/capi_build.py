"""Build libedgellm (the C ABI of ``native/edgellm.h``) with cffi's embedding mode.

``build(out_dir)`` writes ``libedgellm.so`` (``.dylib`` on macOS) and ``edgellm.h`` into
``out_dir``: a C program compiles with ``-I out_dir`` and links with
``-L out_dir -ledgellm -Wl,-rpath,out_dir``. The library embeds CPython; it records this
interpreter (the venv's ``bin/python``, see ``native/capi.c``) as the one to start, so it
belongs to the venv that built it. Builds are cached: an unchanged source, interpreter and
compiler setup returns the existing files without compiling.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
HEADER = HERE / "edgellm.h"
SOURCE = HERE / "capi.c"
MODULE = "_libedgellm"  # the embedded module's name inside the library

#: the Python functions behind the C functions (edgellm/capi.py attaches them), and the C
#: helpers the Python side calls
CDEF = """
typedef int (*elm_progress_fn)(void *user_data, double fraction, const char *stage);
extern "Python" {
    int elm_py_ping(void);
    int elm_py_model_load(const char *options_json, void *progress, void *user_data,
                          uint64_t *out_handle);
    int elm_py_model_free(uint64_t model);
    int elm_py_model_info(uint64_t model, char *buf, size_t buf_size, size_t *out_size);
    int elm_py_tokenize(uint64_t model, const char *text, uint32_t flags, int32_t *tokens,
                        size_t capacity, size_t *out_count);
    int elm_py_detokenize(uint64_t model, const int32_t *tokens, size_t n_tokens, char *buf,
                          size_t buf_size, size_t *out_size);
    int elm_py_request_create(uint64_t model, uint64_t *out_handle);
    int elm_py_request_cancel(uint64_t request);
    int elm_py_request_free(uint64_t request);
    int elm_py_run_start(uint64_t request, int kind, const char *request_json);
    int elm_py_run_next(uint64_t request, const char **chunk, size_t *length);
    int elm_py_request_result(uint64_t request, char *buf, size_t buf_size, size_t *out_size);
}
void elm_set_error(const char *message);
void elm_set_init_error(const char *message);
void elm_mark_ready(void);
"""

#: runs inside the library on its first Python call: attach the Python side, or record why
#: it could not be loaded (the C side reports it as EDGELLM_ERR_RUNTIME)
INIT_CODE = f"""
from {MODULE} import ffi, lib

@ffi.def_extern()
def elm_py_ping():
    return 0

try:
    from edgellm import capi as _capi
    _capi.attach(ffi, lib)
except BaseException as exc:
    import sys
    lib.elm_set_init_error(("the embedded Python (%s) could not load edgellm: %s: %s"
                            % (sys.executable, type(exc).__name__, exc)).encode("utf-8",
                                                                                "replace"))
"""


def python_prototypes() -> str:
    """C prototypes of the extern "Python" functions (cffi defines them after the source
    that calls them), as static declarations."""
    body = CDEF.split('extern "Python" {', 1)[1].split("}", 1)[0]
    protos = [" ".join(p.split()) for p in body.split(";") if p.strip()]
    return "".join(f"static {p};\n" for p in protos)


def library_name() -> str:
    """libedgellm's file name on this platform."""
    return "libedgellm.dylib" if sys.platform == "darwin" else "libedgellm.so"


def venv_python() -> str:
    """The interpreter the library will start: this venv's python (not resolved through
    symlinks: the venv's own path is what lets CPython find its pyvenv.cfg)."""
    return os.path.abspath(sys.executable)


def _c_string(text: str) -> str:
    return json.dumps(text)  # a JSON string is a valid C string literal for these paths


def _build_key(python: str) -> str:
    from edgellm import __version__

    parts = [HEADER.read_text(), SOURCE.read_text(), CDEF, INIT_CODE, python, __version__,
             sys.version, str(sysconfig.get_config_var("CC"))]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def build(out_dir: str | os.PathLike, python: str | None = None, force: bool = False) -> Path:
    """Compile libedgellm into ``out_dir`` (with ``edgellm.h`` beside it); its path.

    ``python`` is the interpreter the library starts (default: this one). Raises
    RuntimeError naming the cause when cffi or the C compiler fails.
    """
    try:
        import cffi
    except ImportError:
        raise RuntimeError("building libedgellm needs cffi: pip install cffi") from None
    from edgellm import __version__

    out = Path(out_dir).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    python = python or venv_python()
    key = _build_key(python)
    lib_path, header_path, stamp = out / library_name(), out / HEADER.name, out / ".edgellm-build"
    if (not force and lib_path.is_file() and header_path.is_file() and stamp.is_file()
            and stamp.read_text().strip() == key):
        return lib_path
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    ffi.embedding_init_code(INIT_CODE)
    prelude = (f"#define EDGELLM_VENV_PYTHON {_c_string(python)}\n"
               f"#define EDGELLM_LIBRARY_VERSION {_c_string(__version__)}\n"
               + python_prototypes() + SOURCE.read_text())
    ffi.set_source(MODULE, prelude, include_dirs=[str(HERE)],
                   extra_compile_args=["-O2", "-pthread", "-fvisibility=hidden"],
                   extra_link_args=["-pthread"])
    with tempfile.TemporaryDirectory(prefix=".build-", dir=out) as tmp:
        try:
            built = Path(ffi.compile(tmpdir=tmp, target=library_name()))
        except Exception as exc:  # distutils/setuptools raise their own types
            raise RuntimeError(f"compiling libedgellm failed: {exc}") from exc
        # each file lands under a temporary name and is renamed: a C build never sees half
        # of one, and a build that failed leaves the previous files in place
        _replace(built, lib_path)
        _replace_text(header_path, HEADER.read_text())
    _replace_text(stamp, key + "\n")
    return lib_path


def _replace(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.copyfile(src, tmp)
    os.chmod(tmp, 0o755)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, dst)


def _replace_text(dst: Path, text: str) -> None:
    tmp = dst.with_name(f".{dst.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, dst)
