"""`edgellm pull NAME` and `edgellm list`: the local model store."""

from __future__ import annotations

import argparse

from edgellm import store

from .common import CliError, progress_bar


def pull_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="edgellm pull", description="install models from the registry")
    p.add_argument("names", nargs="*", default=[store.DEFAULT_MODEL],
                   help=f"catalog names (default: {store.DEFAULT_MODEL})")
    p.add_argument("--all", action="store_true", help="every catalog model")
    p.add_argument("--force", action="store_true", help="download again even if installed")
    args = p.parse_args(argv)
    names = list(store.CATALOG) if args.all else args.names
    for name in names:
        if name not in store.CATALOG:
            raise CliError(f"unknown model {name!r}: choose one of {', '.join(store.CATALOG)}")
    for name in names:
        if store.is_installed(name) and not args.force:
            print(f"{name}: already installed at {store.model_file(name)}")
            continue
        path = store.pull(name, progress=lambda d, t, w, n=name: progress_bar(d, t, f"{n}"),
                          force=args.force)
        print(f"{name}: installed at {path} (sha256 verified)")
    return 0


def list_main(argv: list[str]) -> int:
    argparse.ArgumentParser(prog="edgellm list", description="installed and available models") \
        .parse_args(argv)
    print(f"model store: {store.models_dir()}")
    print(f"{'name':<30} {'size':>9}  {'status':<13} description")
    for name, spec in store.CATALOG.items():
        status = "installed" if store.is_installed(name) else "not installed"
        default = " (default)" if name == store.DEFAULT_MODEL else ""
        print(f"{name:<30} {spec.size / 1e6:7.0f}MB  {status:<13} {spec.description}{default}")
    return 0


def main(argv: list[str], command: str = "list") -> int:
    return pull_main(argv) if command == "pull" else list_main(argv)
