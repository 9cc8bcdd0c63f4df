"""`edgellm serve`: a local OpenAI-compatible server that decodes concurrent requests together.

    edgellm serve -m qwen2.5-coder-1.5b-instruct --ctx 4096 --parallel 8
    edgellm serve -m model.gguf --host 0.0.0.0 --api-key "$KEY" --kv-budget 1GiB

Binds 127.0.0.1 unless --host says otherwise; CORS is off unless --cors-origin names origins.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from .common import KV_DTYPE_NAMES, CliError, add_model_args, ensure_model

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edgellm serve", description=__doc__.split("\n\n")[0])
    add_model_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=8080)
    g.add_argument("--api-key", default=os.environ.get("EDGELLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: $EDGELLM_API_KEY, else none)")
    g.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="allow browser requests from ORIGIN (repeatable; default: none)")
    g.add_argument("--max-body", default="2MB", metavar="BYTES",
                   help="largest request body accepted (default 2MB)")
    g.add_argument("--alias", default=None,
                   help="the model id clients name (default: -m's catalog name or file stem)")
    g = p.add_argument_group("engine")
    g.add_argument("-np", "--parallel", type=int, default=None, metavar="N",
                   help="sequences decoded together (KV cache slots of --ctx tokens each; "
                        "default 8, or as many as --kv-budget holds)")
    g.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a slot before new ones get 503 (default 64)")
    g.add_argument("--prefill-chunk", type=int, default=128,
                   help="prompt tokens per step while others decode (default 128)")
    return p


def model_id(args: argparse.Namespace) -> str:
    if args.alias:
        return args.alias
    path = Path(args.model)
    return path.stem if path.suffix == ".gguf" else args.model


def main(argv: list[str], command: str = "serve") -> int:
    args = build_parser().parse_args(argv)
    try:
        import uvicorn

        from edgellm.server import create_app
    except ImportError as exc:
        raise CliError(f"the server needs its extra: pip install 'edgellm[serve]' ({exc})") \
            from None
    from edgellm.api import load
    from edgellm.cache import CacheConfig, parse_bytes
    from edgellm.engine import Engine

    if args.policy != "error":
        raise CliError("serve keeps --policy error: a reply that reaches --ctx ends with "
                       "finish_reason 'length'")
    budget = parse_bytes(args.kv_budget) if args.kv_budget else None
    max_body = parse_bytes(args.max_body)
    model = load(ensure_model(args.model), backend=args.backend, threads=args.threads,
                 context_length=args.ctx,
                 cache=CacheConfig(dtype=KV_DTYPE_NAMES[args.kv_dtype], keep=args.keep),
                 quant=args.quant)
    engine = Engine(model, ctx=args.ctx, kv_budget=budget, max_seqs=args.parallel,
                    max_queue=args.max_queue, prefill_chunk=args.prefill_chunk)
    app = create_app(engine, model_id(args), api_key=args.api_key,
                     cors_origins=tuple(args.cors_origin), max_body_bytes=max_body)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s",
                        stream=sys.stderr)
    if args.host not in LOOPBACK and not args.api_key:
        print(f"edgellm serve: warning: listening on {args.host} without --api-key: anyone "
              "who can reach this port can use the model", file=sys.stderr)
    threads = getattr(model.backend, "threads", None)
    print(f"edgellm serve: {model_id(args)} ({model.backend.name}, {threads} threads) on "
          f"http://{args.host}:{args.port}/v1\nedgellm serve: {engine.describe()}",
          file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                    timeout_graceful_shutdown=5)
    finally:
        engine.close()
    return 0
