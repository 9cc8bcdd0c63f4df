"""`edgellm convert SRC -o OUT.gguf --type TYPE`: a Hugging Face model folder to GGUF.

    edgellm convert ./Qwen2.5-0.5B -o qwen-q4_k_m.gguf --type q4_k_m [--imatrix imatrix.gguf]
    edgellm convert ./Qwen2.5-0.5B --type q4_k_m --dry-run       # the plan, nothing written
    edgellm convert ./Qwen2.5-0.5B -o q.gguf --type q8_0 --verify  # tokens and logits vs HF
    edgellm convert MODEL.gguf --to mlx OUT_DIR    # a GGUF file to a folder mlx_lm.load opens
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from edgellm.apps.common import CliError

TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q5_0", "q4_k_m", "q5_k_m", "q6_k")


def build_parser(prog: str = "edgellm convert") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Convert a Hugging Face model folder "
                                "(config.json, *.safetensors, tokenizer) to GGUF.")
    p.add_argument("src", help="Hugging Face model folder (or, with --to mlx, a .gguf file "
                   "or catalog name)")
    p.add_argument("dest", nargs="?", default=None,
                   help="with --to mlx: the MLX model folder to write")
    p.add_argument("--to", choices=("gguf", "mlx"), default="gguf",
                   help="gguf (default): HF folder -> GGUF; mlx: GGUF -> an MLX folder "
                        "(mlx-lm's layout, quantized blocks kept exactly where they map)")
    p.add_argument("-o", "--output", default=None, help="output .gguf file")
    p.add_argument("--type", default="f16", choices=TYPES, help="output type (default f16)")
    p.add_argument("--imatrix", default=None, metavar="FILE",
                   help="importance matrix GGUF (edgellm imatrix or llama-imatrix) that "
                        "weights the quantizers' search")
    p.add_argument("--dry-run", action="store_true",
                   help="print each tensor's type and size, the total and bits per weight; "
                        "write nothing")
    p.add_argument("--verify", action="store_true",
                   help="after writing: tokenization vs HF tokenizers, logits vs transformers")
    p.add_argument("--name", default=None, help="general.name (default: the folder's name)")
    p.add_argument("-t", "--threads", type=int, default=None, help="quantizer threads")
    return p


def main(argv: list[str], command: str = "convert") -> int:
    # intermixed: `convert MODEL.gguf --to mlx DIR` has a positional on each side of --to
    args = build_parser().parse_intermixed_args(argv)
    if args.to == "mlx":
        return convert_to_mlx(args)
    from edgellm.converters.hf_convert import plan_conversion, write_gguf

    if not args.dry_run and not args.output:
        raise CliError("give the output file with -o OUT.gguf (or --dry-run for the plan)")
    imatrix = None
    if args.imatrix:
        from edgellm.converters.imatrix import read_imatrix

        imatrix = read_imatrix(args.imatrix)
    plan = plan_conversion(args.src, args.type, imatrix, name=args.name)
    if args.output:
        from edgellm.converters.hf_convert import check_writable

        check_writable(Path(args.output))
    print_plan(plan, detailed=args.dry_run)
    if args.dry_run:
        return 0
    started = time.perf_counter()
    write_gguf(plan, args.output, progress=progress_printer(started), threads=args.threads)
    seconds = time.perf_counter() - started
    size = Path(args.output).stat().st_size
    print(f"wrote {args.output}: {size / 1e6:.1f} MB, {plan.bits_per_weight:.2f} bits per "
          f"weight, in {seconds:.1f} s")
    if args.verify:
        from edgellm.converters.verify import verify

        report = verify(args.src, args.output)
        for line in report.lines():
            print(line)
        if not report.ok:
            return 1
    return 0


def print_plan(plan, detailed: bool) -> None:
    """The plan: per tensor (dry run), fallbacks (always), totals."""
    if detailed:
        for t in plan.tensors:
            shape = "x".join(str(d) for d in reversed(t.shape))
            print(f"{t.name:<36} {shape:>14} {t.qtype.name:>5} {t.nbytes / 1e6:9.2f} MB")
    for t in plan.fallbacks:
        print(f"fallback: {t.name}: {t.note}", file=sys.stderr)
    if plan.fallbacks:
        print(f"{len(plan.fallbacks)} of {len(plan.tensors)} tensors fell back to another type "
              "(listed above)", file=sys.stderr)
    if plan.imatrix_missing:
        print(f"importance matrix has no entry for {len(plan.imatrix_missing)} quantized "
              f"tensors (e.g. {plan.imatrix_missing[0]}); those use magnitude weights",
              file=sys.stderr)
    counts: dict[str, int] = {}
    for t in plan.tensors:
        counts[t.qtype.name] = counts.get(t.qtype.name, 0) + 1
    mix = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    print(f"{plan.spec.hf_name} -> {plan.spec.gguf_arch} {plan.kind.name}: "
          f"{len(plan.tensors)} tensors ({mix}), {plan.n_parameters / 1e6:.1f} M parameters, "
          f"{plan.total_bytes / 1e6:.1f} MB, {plan.bits_per_weight:.2f} bits per weight")


def progress_printer(started: float):
    """A progress callback: tensors, MB/s and ETA on one stderr line."""
    from edgellm.converters.hf_convert import describe_rate

    def show(done: int, total: int, done_bytes: int, total_bytes: int) -> None:
        if not sys.stderr.isatty() and done != total:
            return
        width = 30
        bar = "#" * int(width * done_bytes / max(1, total_bytes))
        end = "\n" if done == total else ""
        print(f"\rconverting [{bar:<{width}}] {done}/{total} tensors, "
              f"{describe_rate(done_bytes, total_bytes, started)}", end=end, file=sys.stderr,
              flush=True)

    return show


def convert_to_mlx(args: argparse.Namespace) -> int:
    """--to mlx: a GGUF model (file or catalog name) to an MLX folder for mlx_lm.load."""
    from edgellm.apps.common import ensure_model
    from edgellm.converters.mlx_export import export_mlx
    from edgellm.store import resolve_model

    dest = args.dest or args.output
    if not dest:
        raise CliError("give the MLX folder to write: edgellm convert MODEL.gguf --to mlx DIR")
    started = time.perf_counter()
    report = export_mlx(resolve_model(ensure_model(args.src)), dest,
                        progress=lambda done, total: _tensor_progress(done, total))
    for line in report.lines():
        print(line)
    print(f"in {time.perf_counter() - started:.1f} s; load it with mlx_lm.load({str(dest)!r})")
    return 0


def _tensor_progress(done: int, total: int) -> None:
    if sys.stderr.isatty() or done == total:
        end = "\n" if done == total else ""
        print(f"\rexporting {done}/{total} tensors", end=end, file=sys.stderr, flush=True)
