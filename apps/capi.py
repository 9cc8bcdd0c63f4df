"""`edgellm capi build [--out DIR]`: build libedgellm and edgellm.h for C programs."""

from __future__ import annotations

import argparse

from edgellm.apps.common import CliError

DEFAULT_OUT = "build/capi"


def main(argv: list[str], command: str = "capi") -> int:
    parser = argparse.ArgumentParser(
        prog=f"edgellm {command}",
        description="The C ABI (native/edgellm.h). `build` compiles libedgellm (cffi "
                    "embedding mode: it runs this venv's Python) and writes it with edgellm.h "
                    "into --out.")
    sub = parser.add_subparsers(dest="action", required=True)
    build = sub.add_parser("build", help="compile libedgellm and copy edgellm.h into --out")
    build.add_argument("--out", default=DEFAULT_OUT,
                       help=f"folder for libedgellm and edgellm.h (default: {DEFAULT_OUT})")
    build.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args(argv)

    from edgellm.native import capi_build

    try:
        lib = capi_build.build(args.out, force=args.force)
    except RuntimeError as exc:
        raise CliError(str(exc).splitlines()[0]) from None
    out = lib.parent
    print(f"{lib}\n{out / 'edgellm.h'}")
    print(f"compile: cc -I {out} app.c -L {out} -ledgellm -Wl,-rpath,{out}")
    print(f"runtime: the library starts {capi_build.venv_python()} "
          "(set EDGELLM_PYTHON to use another venv)")
    return 0
