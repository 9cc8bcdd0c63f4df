"""`edgellm tokenize -m MODEL TEXT`: the ids (JSON) and the piece of each."""

from __future__ import annotations

import argparse
import json

from edgellm import store

from .common import ensure_model


def main(argv: list[str], command: str = "tokenize") -> int:
    p = argparse.ArgumentParser(prog="edgellm tokenize", description=__doc__)
    p.add_argument("-m", "--model", default=store.DEFAULT_MODEL,
                   help="catalog name, path to a .gguf file, or a Hugging Face model folder")
    p.add_argument("text")
    p.add_argument("--no-bos", action="store_true", help="never add BOS")
    p.add_argument("--no-special", action="store_true",
                   help="treat special-token text as plain text")
    p.add_argument("--ids-only", action="store_true", help="print only the JSON list of ids")
    args = p.parse_args(argv)
    from edgellm.modelinfo import read_header
    from edgellm.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_metadata(read_header(ensure_model(args.model)).metadata)
    ids = tok.encode(args.text, add_bos=False if args.no_bos else None,
                     parse_special=not args.no_special)
    print(json.dumps(ids))
    if not args.ids_only:
        for i in ids:
            print(f"{i:>8}  {tok.id_to_piece(i)!r}")
    return 0
