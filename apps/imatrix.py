"""`edgellm imatrix -m MODEL -f TEXT -o imatrix.gguf`: an importance matrix for convert.

Runs the model over the calibration text in chunks of --ctx tokens and writes, per matmul
weight, the summed squared input activations and the token count, in llama.cpp's imatrix GGUF
layout (llama-quantize reads ours; `edgellm convert --imatrix` reads llama-imatrix's).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from edgellm.apps.common import CliError, ensure_model


def main(argv: list[str], command: str = "imatrix") -> int:
    p = argparse.ArgumentParser(prog="edgellm imatrix", description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", required=True,
                   help="catalog name, .gguf file, or a Hugging Face model folder (converted "
                   "in memory to --quant first)")
    p.add_argument("--quant", default="q8_0",
                   choices=["f32", "f16", "bf16", "q8_0"],
                   help="type a Hugging Face folder is run in (q8_0; f16/f32 for the "
                   "unrounded weights)")
    p.add_argument("-f", "--file", required=True, help="calibration text file")
    p.add_argument("-o", "--output", default="imatrix.gguf", help="output (imatrix.gguf)")
    p.add_argument("-c", "--ctx", type=int, default=512, help="tokens per chunk (512)")
    p.add_argument("--chunks", type=int, default=None, help="at most this many chunks")
    p.add_argument("--backend", default="auto")
    p.add_argument("-t", "--threads", type=int, default=None)
    args = p.parse_args(argv)
    text_path = Path(args.file)
    if not text_path.is_file():
        raise CliError(f"{text_path}: no such calibration text file")
    from edgellm.converters.hf_convert import check_writable
    from edgellm.converters.imatrix import write_imatrix
    from edgellm.imatrix import compute_imatrix
    from edgellm.store import resolve_model

    check_writable(Path(args.output))
    model = Path(args.model)
    path = model if model.is_dir() else resolve_model(ensure_model(args.model))
    started = time.perf_counter()

    def progress(done: int, total: int) -> None:
        print(f"\rimatrix: chunk {done}/{total}, {time.perf_counter() - started:.0f} s",
              end="\n" if done == total else "", file=sys.stderr, flush=True)

    text = text_path.read_text(encoding="utf-8", errors="replace")
    imatrix = compute_imatrix(path, text, ctx=args.ctx, chunks=args.chunks,
                              backend=args.backend, threads=args.threads, progress=progress,
                              quant=args.quant)
    imatrix.datasets = [str(text_path)]
    write_imatrix(imatrix, args.output)
    print(f"wrote {args.output}: {len(imatrix.sums)} weights, {imatrix.chunk_count} chunks of "
          f"{args.ctx} tokens")
    return 0
