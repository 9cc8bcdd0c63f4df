"""What every command shares: model/backend/sampling flags, loading, and error handling."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from edgellm import store

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130


class CliError(Exception):
    """A failure the user can fix; printed as one line."""


def run_guarded(fn: Callable[[], int]) -> int:
    """Run a command; expected failures become `edgellm: error: ...` and exit status 1."""
    from edgellm.cache import ContextOverflow

    try:
        return fn()
    except KeyboardInterrupt:
        print("\nedgellm: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return 0
    except (CliError, ValueError, LookupError, FileNotFoundError, IsADirectoryError,
            PermissionError, ContextOverflow, RuntimeError, OSError) as exc:
        message = exc.args[0] if isinstance(exc, LookupError) and exc.args else str(exc)
        print(f"edgellm: error: {message}", file=sys.stderr)
        return EXIT_ERROR


def add_model_args(parser: argparse.ArgumentParser, default_model: bool = True) -> None:
    """-m/--model, --backend, --threads, and the KV cache: --ctx, --kv-budget, --kv-dtype,
    --policy, --keep."""
    parser.add_argument("-m", "--model", default=store.DEFAULT_MODEL if default_model else None,
                        required=not default_model,
                        help="catalog name, path to a .gguf file, or a Hugging Face model "
                        f"folder (converted in memory; default: {store.DEFAULT_MODEL})")
    parser.add_argument("--quant", default="q8_0",
                        choices=["f32", "f16", "bf16", "q8_0", "q4_0", "q5_0", "q4_k_m",
                                 "q5_k_m", "q6_k"],
                        help="type a Hugging Face folder is quantized to at load (q8_0)")
    parser.add_argument("--backend", default="auto", help="auto, cpu, numpy, torch, mlx")
    parser.add_argument("-t", "--threads", type=int, default=None,
                        help="CPU threads (default: physical cores)")
    parser.add_argument("-c", "--ctx", type=int, default=None,
                        help="context size in tokens (KV cache slots; default min(model, 4096))")
    add_cache_args(parser)


KV_DTYPE_NAMES = {"f16": "float16", "float16": "float16", "f32": "float32",
                  "float32": "float32", "q8_0": "q8_0"}


def add_cache_args(parser: argparse.ArgumentParser) -> None:
    """The KV cache's budget and overflow policy (with --ctx): the same flags everywhere."""
    g = parser.add_argument_group("KV cache")
    g.add_argument("--kv-budget", default=None, metavar="BYTES",
                   help="cache budget in bytes, e.g. 256MB or 1GiB (context = tokens that fit)")
    g.add_argument("--kv-dtype", default="f16", choices=sorted(KV_DTYPE_NAMES),
                   help="cache storage type (default f16)")
    g.add_argument("--policy", default="error", choices=["error", "rotate", "truncate-turns"],
                   help="when the context is full: error (refuse), rotate (keep the first "
                        "--keep tokens and the most recent), truncate-turns (chat: drop the "
                        "oldest turns)")
    g.add_argument("--keep", type=int, default=4,
                   help="tokens kept at the start when rotating (attention sinks; default 4)")


def cache_config_from_args(args: argparse.Namespace):
    """The CacheConfig the cache flags describe."""
    from edgellm.cache import CacheConfig, parse_bytes

    budget = getattr(args, "kv_budget", None)
    return CacheConfig(max_tokens=args.ctx,
                       max_bytes=parse_bytes(budget) if budget else None,
                       dtype=KV_DTYPE_NAMES[getattr(args, "kv_dtype", "f16")],
                       policy=getattr(args, "policy", "error"), keep=getattr(args, "keep", 4))


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    """The SamplingParams flags, named as llama.cpp's tools name them."""
    g = parser.add_argument_group("sampling")
    g.add_argument("--temp", type=float, default=0.8, help="temperature; 0 = greedy")
    g.add_argument("--top-k", type=int, default=40)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--min-p", type=float, default=0.05)
    g.add_argument("--repeat-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("-n", "--max-tokens", type=int, default=max_tokens)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def sampling_from_args(args: argparse.Namespace):
    from edgellm.sampling import SamplingParams

    return SamplingParams(
        temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repeat_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed, max_tokens=args.max_tokens,
        stop=tuple(args.stop), ignore_eos=args.ignore_eos,
    )


def progress_bar(done: int, total: int, what: str) -> None:
    """A one-line progress bar on stderr."""
    if not sys.stderr.isatty() and done not in (0, total):
        return
    width = 30
    frac = done / total if total else 1.0
    bar = "#" * int(frac * width)
    end = "\n" if done >= total else ""
    print(f"\r{what:<11} [{bar:<{width}}] {done / 1e6:7.1f}/{total / 1e6:.1f} MB", end=end,
          file=sys.stderr, flush=True)


def ensure_model(name_or_path: str) -> str:
    """Pull a catalog model on first use (with a progress bar); paths pass through."""
    if name_or_path in store.CATALOG and not store.is_installed(name_or_path):
        print(f"edgellm: pulling {name_or_path} (first use)", file=sys.stderr)
        store.pull(name_or_path, progress=progress_bar)
    return name_or_path


def load_from_args(args: argparse.Namespace):
    """edgellm.load() with the common flags."""
    from edgellm.api import load

    return load(ensure_model(args.model), backend=args.backend, threads=args.threads,
                context_length=args.ctx, cache=cache_config_from_args(args),
                quant=getattr(args, "quant", "q8_0"))


def add_draft_args(parser: argparse.ArgumentParser) -> None:
    """--draft MODEL|ngram and --draft-n N: speculative decoding (same output, faster)."""
    g = parser.add_argument_group("speculative decoding")
    g.add_argument("--draft", default=None, metavar="MODEL",
                   help="draft model with the target's tokenizer (catalog name or .gguf), or "
                        "'ngram' for prompt lookup; the output stays the target's")
    g.add_argument("--draft-n", type=int, default=None, metavar="N",
                   help="pin the draft length (default: adaptive from measured costs and "
                        "acceptance, down to off while drafting does not pay)")


def load_draft_from_args(args: argparse.Namespace, target):
    """The draft the --draft flags name: None, "ngram", or a model on the target's backend."""
    if not getattr(args, "draft", None):
        return None
    if args.draft == "ngram":
        return "ngram"
    from edgellm.api import load
    from edgellm.speculative import check_same_vocabulary

    draft = load(ensure_model(args.draft), backend=args.backend, threads=args.threads,
                 context_length=target.context_length, quant=getattr(args, "quant", "q8_0"))
    check_same_vocabulary(target, draft)
    return draft


def speculative_summary(stats: dict) -> str:
    """One line of speculative statistics (``extra["speculative"]``) for stderr."""
    return (f"draft: {stats['drafted']} drafted, {stats['accepted']} accepted "
            f"({stats['acceptance_rate']:.1%}), mean accepted length "
            f"{stats['mean_accepted_length']:.2f}, {stats['tokens_per_target_pass']:.2f} "
            f"tokens per target pass")
