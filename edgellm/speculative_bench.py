"""Speculative decoding benchmark: plain vs. drafted greedy decoding of one target.

Prompts are function completions from Python's standard library: a function's header and
docstring, the model writes the body. Each prompt runs plain, then speculatively, back to back
(so a busy machine slows both alike); the row holds both speeds, the speedup, the acceptance
statistics, and whether the two outputs are identical (they must be). ``llama_speculative``
runs llama.cpp's ``llama-speculative`` on the same prompt for comparison.
This module returns rows; ``edgellm bench --draft`` and ``benchmarks/speculative.py`` print them.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from edgellm.api import Model, load
from edgellm.generate import stream_generate
from edgellm.sampling import SamplingParams
from edgellm.speculative import DEFAULT_DRAFT_VOCAB, check_same_vocabulary, make_drafter

#: (module file, function): short-bodied, documented functions of the standard library.
STDLIB_FUNCTIONS = [
    ("textwrap.py", "indent"), ("shlex.py", "quote"), ("genericpath.py", "commonprefix"),
    ("fnmatch.py", "filter"), ("calendar.py", "leapdays"), ("base64.py", "b64encode"),
    ("shutil.py", "copyfileobj"), ("bisect.py", "insort_right"),
]


def stdlib_prompt(function: tuple[str, str], stdlib: Path | None = None) -> str:
    """The source of (file, function) in the stdlib up to the end of its docstring, plus "\\n"."""
    filename, name = function
    stdlib = stdlib or Path(sysconfig.get_paths()["stdlib"])
    source = (stdlib / filename).read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            if ast.get_docstring(node) is None:
                raise ValueError(f"{filename}:{name} has no docstring")
            lines = source.splitlines()[node.lineno - 1: node.body[0].end_lineno]
            return "\n".join(lines) + "\n"
    raise LookupError(f"no top-level function {name!r} in {filename}")


@dataclass
class Run:
    tokens: list[int]
    tps: float  # generation tokens per second (after the first token)
    stats: dict  # extra["speculative"] ({} when plain)


def timed_run(model: Model, prompt_ids: list[int], n: int, draft=None,
              draft_n: int | None = None) -> Run:
    """Greedy decoding of n tokens (EOS ignored), plain or with ``draft``."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    responses = list(stream_generate(model, prompt_ids, params, draft=draft, draft_n=draft_n))
    last = responses[-1]
    return Run([r.token for r in responses], last.generation_tps,
               last.extra.get("speculative", {}))


def compare(target: Model, draft: Model | str, text: str, n: int = 128,
            draft_n: int | None = None, head_vocab: int | None = DEFAULT_DRAFT_VOCAB) -> dict:
    """One row: plain and speculative speed of ``target`` on ``text``, and the draft's stats."""
    ids = target.encode(text)
    plain = timed_run(target, ids, n)
    drafter = draft if isinstance(draft, str) else make_drafter(
        target, draft, ids, target.context_length, head_vocab=head_vocab)
    spec = timed_run(target, ids, n, drafter, draft_n)
    return {"prompt_tokens": len(ids), "plain_tps": plain.tps, "spec_tps": spec.tps,
            "speedup": spec.tps / plain.tps if plain.tps else 0.0,
            "same_output": spec.tokens == plain.tokens, **spec.stats}


def llama_speculative(bin_dir: Path, target: Path, draft: Path, prompt: str, n: int,
                      draft_max: int, threads: int) -> dict:
    """llama.cpp's llama-speculative (greedy) on one prompt: tokens/s and acceptance."""
    cmd = [str(bin_dir / "llama-speculative"), "-m", str(target), "-md", str(draft),
           "-p", prompt, "-n", str(n), "--temp", "0", "-t", str(threads), "-td", str(threads),
           "--spec-draft-n-max", str(draft_max), "-c", "2048", "--seed", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    log = out.stdout + out.stderr
    speed = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", log)
    accept = re.search(r"accept\s*=\s*([\d.]+)%", log)
    if not speed:
        raise RuntimeError("llama-speculative failed:\n" + log[-2000:])
    return {"tps": float(speed.group(3)),
            "acceptance": float(accept.group(1)) / 100 if accept else None}


def markdown_table(rows: list[dict], llama: bool = False) -> str:
    """The rows as a markdown table, with a mean line."""
    cols = ["prompt", "plain t/s", "spec t/s", "speedup", "accepted", "mean acc. len",
            "tok/pass", "mean k", "same output"]
    if llama:
        cols += ["llama.cpp spec t/s", "llama.cpp accepted", "llama.cpp speedup"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [r["prompt"], f"{r['plain_tps']:.2f}", f"{r['spec_tps']:.2f}",
                 f"{r['speedup']:.2f}x", f"{r.get('acceptance_rate', 0):.1%}",
                 f"{r.get('mean_accepted_length', 0):.2f}",
                 f"{r.get('tokens_per_target_pass', 0):.2f}",
                 f"{r.get('mean_draft_length', 0):.2f}", "yes" if r["same_output"] else "NO"]
        if llama:
            cells += [f"{r['llama_tps']:.2f}", f"{r['llama_acceptance'] or 0:.1%}",
                      f"{r['llama_speedup']:.2f}x"] if "llama_tps" in r else ["", "", ""]
        lines.append("| " + " | ".join(cells) + " |")
    speedups = [r["speedup"] for r in rows]
    if speedups:
        lines.append(f"\nmean speedup {sum(speedups) / len(speedups):.2f}x, "
                     f"min {min(speedups):.2f}x, all outputs identical: "
                     f"{all(r['same_output'] for r in rows)}")
    return "\n".join(lines)


def bench_draft(model: str, draft: str, backend: str = "auto", threads: int | None = 2,
                n: int = 128, draft_n: int | None = None, prompts: int = len(STDLIB_FUNCTIONS),
                head_vocab: int | None = DEFAULT_DRAFT_VOCAB, llama_dir: Path | None = None,
                llama_draft_max: int = 3) -> tuple[str, list[dict]]:
    """The whole benchmark: (a description line, one row per stdlib prompt).

    With ``llama_dir``, each row also has llama-speculative's speed, acceptance and speedup
    over llama-bench's plain tg<n> of the same file.
    """
    target = load(model, backend=backend, threads=threads, context_length=1024)
    drafter: Model | str = "ngram"
    if draft != "ngram":
        drafter = load(draft, backend=backend, threads=threads, context_length=1024)
        check_same_vocabulary(target, drafter)
    threads = threads or target.backend.threads or 1
    about = (f"target {target.path.name}, draft {draft}, backend {target.backend.name}, "
             f"{threads} threads, {n} tokens, greedy, draft length {draft_n or 'adaptive'}, "
             f"draft head {head_vocab or 'full'} rows")
    llama_plain = None
    if llama_dir is not None:
        from edgellm.bench import llama_bench

        llama_plain = llama_bench(target.path, threads, 0, n, 2,
                                  binary=str(llama_dir / "llama-bench"))[0]["mean_ts"]
        about += f"; llama.cpp plain (llama-bench tg{n}) {llama_plain:.2f} t/s"
    rows = []
    for function in STDLIB_FUNCTIONS[:prompts]:
        text = stdlib_prompt(function)
        row = {"prompt": f"{function[0][:-3]}.{function[1]}",
               **compare(target, drafter, text, n, draft_n, head_vocab)}
        if llama_plain is not None and draft != "ngram":
            ll = llama_speculative(llama_dir, target.path, drafter.path, text, n,
                                   llama_draft_max, threads)
            row.update(llama_tps=ll["tps"], llama_acceptance=ll["acceptance"],
                       llama_speedup=ll["tps"] / llama_plain)
        rows.append(row)
    return about, rows
