"""`convert --verify`: the written GGUF against its source folder.

Tokenization: our tokenizer (from the file's metadata) against HF ``tokenizers`` on
``tokenizer.json`` (or sentencepiece on ``tokenizer.model``) over a set of texts: must be
equal. Logits: our runtime on the file against HF transformers on the folder (f32),
teacher-forced over a few prompts: top-1 agreement and the largest logit difference
(quantized files differ by their rounding; f32 files should agree to ~1e-4). The logit check
is skipped, and says so, where torch or transformers is not installed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

TEXTS = (
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Numbers 1234567890, 3.14159 and dates 2024-11-23.",
    "  spaces, \ttabs\n\nnew lines, Ünïcödé, 東京, Москва, emoji 🙂",
    "it's we'll THEY'RE I'm you'd",
)
PROMPTS = (
    "The capital of France is Paris. The capital of Germany is",
    "import numpy as np\n\ndef mean(xs):\n    return",
    "Once upon a time, in a small village by the sea, there lived",
)


@dataclass
class VerifyReport:
    token_mismatches: list[str] = field(default_factory=list)
    texts_checked: int = 0
    top1: list[float] = field(default_factory=list)  # per prompt
    max_logit_diff: float = 0.0
    logits_skipped: str | None = None

    @property
    def ok(self) -> bool:
        return not self.token_mismatches

    def lines(self) -> list[str]:
        out = [f"verify: tokenization {self.texts_checked - len(self.token_mismatches)}/"
               f"{self.texts_checked} texts equal to the source tokenizer"]
        out += [f"verify:   differs on {t!r}" for t in self.token_mismatches]
        if self.logits_skipped:
            out.append(f"verify: logits skipped ({self.logits_skipped})")
        elif self.top1:
            out.append(f"verify: logits vs transformers (f32), {len(self.top1)} prompts: top-1 "
                       f"agreement {np.mean(self.top1):.1%}, max |difference| "
                       f"{self.max_logit_diff:.4f}")
        return out


def source_tokenize(folder: Path):
    """A function text -> ids with the folder's own tokenizer (no specials added)."""
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        return lambda text: tok.encode(text, add_special_tokens=False).ids
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    return lambda text: sp.encode(text)


def verify(folder: str | os.PathLike, gguf_path: str | os.PathLike,
           backend: str = "auto") -> VerifyReport:
    """Compare the converted file with its source folder (see the module docstring)."""
    import edgellm

    folder = Path(folder)
    report = VerifyReport()
    model = edgellm.load(gguf_path, backend=backend)
    theirs = source_tokenize(folder)
    for text in TEXTS:
        report.texts_checked += 1
        if model.tokenizer.encode(text, add_bos=False) != theirs(text):
            report.token_mismatches.append(text)
    try:
        import torch
        import transformers
    except ImportError as exc:
        report.logits_skipped = f"{exc.name} is not installed"
        return report
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for prompt in PROMPTS:
        ids = model.encode(prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float().numpy()  # (n, vocab)
        ours = model.net.forward(np.array(ids), model.make_cache(len(ids) + 1),
                                 all_logits=True)[:, : ref.shape[1]]
        report.top1.append(float((ours.argmax(-1) == ref.argmax(-1)).mean()))
        report.max_logit_diff = max(report.max_logit_diff, float(np.abs(ours - ref).max()))
    return report
