"""A model folder's tokenizer as GGUF ``tokenizer.*`` metadata.

Two kinds, as llama.cpp reads them: byte-level BPE from ``tokenizer.json`` (``gpt2``: tokens,
token types, merges, and the pre-tokenizer named from our own table of the regexes it
splits with: an unknown one is refused, naming it, because a wrong guess silently changes
every tokenization), and SentencePiece from ``tokenizer.model`` (``llama``: pieces, scores,
types with byte fallback). Special and added tokens, BOS/EOS/PAD/UNK ids, add_bos/add_eos
and the chat template come from ``tokenizer_config.json`` / ``chat_template.jinja``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from edgellm.converters.hf_folder import HFFolder
from edgellm.tokenizer import TokenType

_QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
             r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
              r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

#: pre-tokenizer signature (the steps of tokenizer.json's pre_tokenizer) -> tokenizer.ggml.pre
PRE_TOKENIZERS: dict[tuple, str] = {
    (("split", _QWEN2_RE), ("bytelevel", False)): "qwen2",
    (("split", _LLAMA3_RE), ("bytelevel", False)): "llama-bpe",
    (("bytelevel", True),): "gpt-2",
    (("digits", True), ("bytelevel", True)): "smollm",
}

SPECIAL_KEYS = (("bos", "bos_token"), ("eos", "eos_token"), ("unknown", "unk_token"),
                ("padding", "pad_token"))


def pre_tokenizer_signature(pre: dict[str, Any] | None) -> tuple:
    """tokenizer.json's pre_tokenizer as a tuple of (step, setting) pairs."""
    if not pre:
        return ()
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    out = []
    for step in steps:
        kind = step.get("type")
        if kind == "Split":
            pattern = step.get("pattern", {})
            out.append(("split", pattern.get("Regex", pattern.get("String"))))
        elif kind == "ByteLevel":
            out.append(("bytelevel", bool(step.get("use_regex", True))))
        elif kind == "Digits":
            out.append(("digits", bool(step.get("individual_digits", False))))
        else:
            out.append((str(kind), json.dumps(step, sort_keys=True)))
    return tuple(out)


def identify_pre_tokenizer(pre: dict[str, Any] | None) -> str:
    """Our name for a byte-level BPE pre-tokenizer, or a ValueError naming the unknown one."""
    signature = pre_tokenizer_signature(pre)
    if signature in PRE_TOKENIZERS:
        return PRE_TOKENIZERS[signature]
    described = "; ".join(f"{kind} {setting!r}" for kind, setting in signature) or "none"
    raise ValueError(f"unknown BPE pre-tokenizer ({described}): edgellm knows "
                     f"{', '.join(sorted(PRE_TOKENIZERS.values()))}; converting it under "
                     "another name would change every tokenization")


def looks_special(text: str) -> bool:
    """Added tokens that act as control tokens even when not marked special (<|...|>)."""
    return ((text.startswith("<|") and text.endswith("|>"))
            or (text.startswith("<｜") and text.endswith("｜>"))
            or text in ("<pad>", "<mask>")
            or (text.startswith("<unused") and text.endswith(">")))


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


#: token ids beyond this are refused: one hostile id would otherwise make the converter
#: pad the vocabulary to that length (the largest real vocabularies hold ~260k tokens)
MAX_TOKEN_ID = 1 << 22


def read_tokenizer_json(path: Path) -> dict[str, Any]:
    """tokenizer.json, with the fields the converter reads checked for their types and the
    token ids for their range: a damaged or hostile file is one ValueError naming the field."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read it ({exc}); re-download the model folder") \
            from None

    def bad(what: str) -> ValueError:
        return ValueError(f"{path}: {what}; re-download the model folder")

    def is_id(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < MAX_TOKEN_ID

    if not isinstance(data, dict):
        raise bad("not a JSON object")
    model = data.get("model", {})
    if not isinstance(model, dict):
        raise bad("'model' is not an object")
    vocab = model.get("vocab", {})
    if isinstance(vocab, dict):
        if not all(is_id(i) for i in vocab.values()):
            raise bad(f"model.vocab holds ids that are not integers in 0..{MAX_TOKEN_ID - 1}")
    elif not isinstance(vocab, list):  # Unigram vocabularies are [piece, score] lists
        raise bad("model.vocab is neither an object nor a list")
    merges = model.get("merges", [])
    if not isinstance(merges, list) or not all(
            isinstance(m, str) or (isinstance(m, list) and len(m) == 2
                                   and all(isinstance(x, str) for x in m)) for m in merges):
        raise bad("model.merges is not a list of merges ('a b' or ['a', 'b'])")
    added = data.get("added_tokens", [])
    if not isinstance(added, list) or not all(
            isinstance(a, dict) and is_id(a.get("id")) and isinstance(a.get("content"), str)
            for a in added):
        raise bad("added_tokens is not a list of {id, content} with ids in range")
    if data.get("pre_tokenizer") is not None and not isinstance(data["pre_tokenizer"], dict):
        raise bad("pre_tokenizer is not an object")
    return data


def tokenizer_metadata(folder: HFFolder, vocab_size: int) -> dict[str, Any]:
    """Every ``tokenizer.*`` key for the folder's tokenizer, in llama.cpp's order."""
    path = folder.path
    if (path / "tokenizer.json").is_file():
        data = read_tokenizer_json(path / "tokenizer.json")
        model = data.get("model", {})
        steps = pre_tokenizer_signature(data.get("pre_tokenizer"))
        if model.get("type") == "BPE" and any(step[0] == "bytelevel" for step in steps):
            if not isinstance(model.get("vocab"), dict) or not model["vocab"]:
                raise ValueError(f"{path / 'tokenizer.json'}: a byte-level BPE model without "
                                 "its vocabulary (model.vocab); re-download the model folder")
            meta, ids = _byte_level_bpe(data, vocab_size)
        elif (path / "tokenizer.model").is_file():
            meta, ids = _sentencepiece(folder, vocab_size)
        else:
            raise ValueError(f"{path / 'tokenizer.json'}: a {model.get('type')} tokenizer "
                             "without byte-level pre-tokenization and no tokenizer.model; "
                             "edgellm converts byte-level BPE and SentencePiece tokenizers")
    elif (path / "tokenizer.model").is_file():
        meta, ids = _sentencepiece(folder, vocab_size)
    else:
        raise FileNotFoundError(f"{path}: no tokenizer.json or tokenizer.model; copy the "
                                "tokenizer files into the model folder")
    meta.update(_special_tokens(folder, ids))
    template = chat_template(folder)
    if template:
        meta["tokenizer.chat_template"] = template
    return meta


def _byte_level_bpe(data: dict[str, Any], vocab_size: int) -> tuple[dict[str, Any], dict]:
    model = data["model"]
    pre = identify_pre_tokenizer(data.get("pre_tokenizer"))
    by_id: dict[int, str] = {i: t for t, i in model["vocab"].items()}
    types: dict[int, int] = {}
    for added in data.get("added_tokens", []):
        i, text = int(added["id"]), added["content"]
        by_id[i] = text
        special = added.get("special") or looks_special(text)
        types[i] = TokenType.CONTROL if special else TokenType.USER_DEFINED
    n = max(vocab_size, max(by_id) + 1)
    tokens, token_types = [], []
    for i in range(n):
        if i in by_id:
            tokens.append(by_id[i])
            token_types.append(int(types.get(i, TokenType.NORMAL)))
        else:
            tokens.append(f"[PAD{i}]")
            token_types.append(int(TokenType.UNUSED))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": token_types,
            "tokenizer.ggml.merges": merges}
    return meta, {t: i for i, t in by_id.items()}


def _sentencepiece(folder: HFFolder, vocab_size: int) -> tuple[dict[str, Any], dict]:
    try:
        from sentencepiece import SentencePieceProcessor
    except ImportError:
        raise RuntimeError("a SentencePiece tokenizer.model needs the sentencepiece package "
                           "(pip install sentencepiece)") from None
    sp = SentencePieceProcessor()
    sp.LoadFromFile(str(folder.path / "tokenizer.model"))
    n = max(vocab_size, sp.vocab_size())
    tokens = [f"[PAD{i}]" for i in range(n)]
    scores = [-10000.0] * n
    types = [int(TokenType.UNUSED)] * n
    for i in range(sp.vocab_size()):
        tokens[i], scores[i] = sp.IdToPiece(i), float(sp.GetScore(i))
        types[i] = int(TokenType.UNKNOWN if sp.IsUnknown(i) else TokenType.CONTROL
                       if sp.IsControl(i) else TokenType.UNUSED if sp.IsUnused(i)
                       else TokenType.BYTE if sp.IsByte(i) else TokenType.NORMAL)
    for key, added in folder.tokenizer_config.get("added_tokens_decoder", {}).items():
        i, text = int(key), added.get("content", "")
        if i >= n:
            continue
        if added.get("special") or looks_special(text):
            types[i] = int(TokenType.CONTROL)
        else:
            text = text.replace("\u2581", " ")
            types[i] = int(TokenType.USER_DEFINED)
        tokens[i], scores[i] = text, -1000.0
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types}
    if folder.config.get("model_type", "").startswith("gemma"):
        meta["tokenizer.ggml.add_space_prefix"] = False
    return meta, {t: i for i, t in enumerate(tokens)}


def _special_tokens(folder: HFFolder, ids: dict[str, int]) -> dict[str, Any]:
    tc, out = folder.tokenizer_config, {}
    for gguf_key, hf_key in SPECIAL_KEYS:
        text = _token_text(tc.get(hf_key))
        token_id = ids.get(text) if text is not None else None
        if token_id is None:  # fall back on config.json's ids
            raw = folder.config.get(f"{hf_key}_id")
            token_id = raw[0] if isinstance(raw, list) and raw else raw
        if isinstance(token_id, int):
            out[f"tokenizer.ggml.{gguf_key}_token_id"] = token_id
    for flag in ("add_bos_token", "add_eos_token"):
        if isinstance(tc.get(flag), bool):
            out[f"tokenizer.ggml.{flag}"] = tc[flag]
    return out


def chat_template(folder: HFFolder) -> str | None:
    """The chat template: ``chat_template.jinja`` or tokenizer_config's ``chat_template``."""
    jinja = Path(folder.path) / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = folder.tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None
