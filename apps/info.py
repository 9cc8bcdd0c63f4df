"""`edgellm info MODEL`: architecture, sizes, quant mix, context, chat template."""

from __future__ import annotations

import argparse
import json

from edgellm import store

from .common import ensure_model


def main(argv: list[str], command: str = "info") -> int:
    p = argparse.ArgumentParser(prog="edgellm info", description=__doc__)
    p.add_argument("model", nargs="?", default=store.DEFAULT_MODEL,
                   help="catalog name, path to a .gguf file, or a Hugging Face model folder "
                        "(described as converted at load: no weight is read)")
    p.add_argument("--quant", default="q8_0",
                   help="type a Hugging Face folder is quantized to at load (q8_0)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--template", action="store_true", help="print the whole chat template")
    p.add_argument("--backend", default=None,
                   help="also load the model on this backend and report the memory it holds "
                        "there (e.g. mlx: MLX's active memory beside the GGUF size)")
    args = p.parse_args(argv)
    from edgellm.modelinfo import describe, read_header

    header = read_header(ensure_model(args.model), args.quant)
    path = header.path
    info = describe(header)
    if args.backend:
        from edgellm.modelinfo import backend_memory

        info.update(backend_memory(path, args.backend, args.quant))
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    template = info.pop("chat_template")
    mix = info.pop("quant_mix")
    for key, value in info.items():
        print(f"{key:<24} {value:,}" if isinstance(value, int) else f"{key:<24} {value}")
    total = sum(mix.values())
    print("quant mix (by bytes)     " + ", ".join(
        f"{k} {100 * v / total:.1f}%" for k, v in mix.items()))
    if template is None:
        print("chat template            none (ChatML fallback)")
    elif args.template:
        print("chat template:\n" + template)
    else:
        print(f"chat template            {len(template)} chars (--template to print)")
    return 0
