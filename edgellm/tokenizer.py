"""Tokenizer built from GGUF metadata that reproduces llama.cpp's tokenization exactly.

Two vocabulary kinds are supported, named by ``tokenizer.ggml.model``:

* ``gpt2``: byte-level BPE with ranked merges (Qwen2 and friends). The pre-tokenizer regex is
  chosen by ``tokenizer.ggml.pre``; HF ``tokenizers`` runs the regex split, the byte-level
  mapping and the BPE merges, which are the same algorithm llama.cpp uses.
* ``llama``: SentencePiece-style BPE driven by token scores with ``<0xXX>`` byte fallback
  (Gemma, Llama 2). llama.cpp merges *any* adjacent pair whose concatenation is a vocab token,
  best score first, so this is implemented directly with a heap; an HF BPE built from a merge
  list cannot express "every split of every token is a merge" cheaply.

Before either engine runs, the text is cut at special-token strings the way llama.cpp's
``tokenizer_st_partition`` does: user-defined tokens are always cut out, control and unknown
tokens only when ``parse_special`` is set, longest token text first.
"""

from __future__ import annotations

import heapq
from array import array
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence
from enum import IntEnum
from typing import Any

import numpy as np

from edgellm.converters.gguf_reader import StringArray

SUPPORTED_MODELS = ("gpt2", "llama")

# Byte-level BPE pre-tokenizer regexes by tokenizer.ggml.pre, as used by llama.cpp
# (LLAMA_VOCAB_PRE_TYPE_QWEN2: the case-insensitive contractions are spelled out).
_QWEN2_PATTERN = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# LLAMA_VOCAB_PRE_TYPE_LLAMA3 ("llama-bpe"): digits in runs of up to three
_LLAMA3_PATTERN = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BPE_PRE_PATTERNS = {
    "qwen2": _QWEN2_PATTERN,
    "deepseek-r1-qwen": _QWEN2_PATTERN,
    "llama-bpe": _LLAMA3_PATTERN,
}

# Token texts llama.cpp treats as end-of-generation (its special_eog_ids list), plus the
# fill-in-the-middle tokens it also adds to that set.
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
})
_FIM_EOG_TEXTS = frozenset({
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]",
    "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>",
    "<|file_sep|>",
})
# FIM prefix/suffix/middle markers: llama.cpp forces these to control type (not EOG).
_FIM_CONTROL_TEXTS = frozenset({
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
    "<|code_prefix|>", "<|prefix|>",
    "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
    "<|code_suffix|>", "<|suffix|>",
    "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
    "<|code_middle|>", "<|middle|>",
})
_EOG_ID_KEYS = (
    "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id",
    "tokenizer.ggml.fim_pad_token_id", "tokenizer.ggml.fim_rep_token_id",
    "tokenizer.ggml.fim_sep_token_id",
)

_SPM_SPACE = "\u2581"  # "▁", SentencePiece's visible space


class TokenType(IntEnum):
    """GGUF ``tokenizer.ggml.token_type`` values."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabs."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_DECODER = {ch: b for b, ch in _bytes_to_unicode().items()}


# --------------------------------------------------------------------------- vocabulary


class Vocabulary(Sequence[str]):
    """Token texts by id, and ids by text, without a Python object per token.

    The texts stay as the GGUF reader gives them (a ``StringArray``: the file's bytes,
    decoded on use); empty ones read as llama.cpp's ``[EMPTY_i]`` placeholder. Ids by text go
    through the texts' hashes, sorted: 12 bytes a token where Python strings and a dict took
    ~100 (Gemma 3's 262,144 tokens: ~35 MB). A lookup costs ~1 us against a dict's 50 ns,
    which tokenizing a prompt does not notice. As with a dict built in id order, a text
    that appears twice maps to its later id.
    """

    def __init__(self, texts: Sequence[str]):
        n = len(texts)
        lengths = getattr(texts, "lengths", None)
        empty = (np.flatnonzero(lengths == 0).tolist() if lengths is not None
                 else [i for i, t in enumerate(texts) if not t])
        self._texts = texts
        self._empty = {i: f"[EMPTY_{i}]" for i in empty}
        hashes = np.fromiter((hash(t) for t in self), dtype=np.int64, count=n)
        order = np.argsort(hashes, kind="stable")  # equal hashes stay in id order
        self._hashes = array("q", hashes[order].tobytes())  # (n,) sorted
        self._ids = array("i", order.astype(np.int32).tobytes())  # (n,) id of each hash

    def __reduce__(self):
        # str hashes are salted per process: another process (unpickling) rebuilds the table
        return (Vocabulary, (self._texts,))

    def __len__(self) -> int:
        return len(self._texts)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        placeholder = self._empty.get(i)
        return self._texts[i] if placeholder is None else placeholder

    def __iter__(self) -> Iterator[str]:
        return (self[i] for i in range(len(self)))

    def first_difference(self, other: Sequence[str], n: int) -> int | None:
        """The first id below n whose text differs between self and other, or None: at once
        where both keep the file's bytes (``StringArray.first_difference``), else text by
        text."""
        mine, theirs = self._texts, getattr(other, "_texts", None)
        if hasattr(mine, "first_difference") and type(theirs) is type(mine):
            return mine.first_difference(theirs, n)
        return next((i for i in range(n) if self[i] != other[i]), None)

    def id_of(self, text: str) -> int | None:
        """The id of a token's text, or None."""
        h = hash(text)
        hashes = self._hashes
        k = bisect_right(hashes, h) - 1
        while k >= 0 and hashes[k] == h:  # the later id first, then any hash collisions
            token_id = self._ids[k]
            if self[token_id] == text:
                return token_id
            k -= 1
        return None


# --------------------------------------------------------------------------- engines


class _SpmEngine:
    """llama.cpp's ``llm_tokenizer_spm``: greedy best-score merging with byte fallback."""

    def __init__(self, vocab: Vocabulary, scores: Sequence[float], unk_id: int | None):
        self._lookup = vocab.id_of
        self._scores = scores
        # Characters that are not vocab tokens fall back to one <0xXX> token per UTF-8 byte.
        byte_ids = (vocab.id_of(f"<0x{b:02X}>") for b in range(256))
        self._byte_ids = [unk_id if i is None else i for i in byte_ids]

    def encode(self, text: str, out: list[int]) -> None:
        """Append the ids of one raw-text fragment (spaces not yet escaped) to ``out``."""
        text = text.replace(" ", _SPM_SPACE)
        lookup = self._lookup
        n = len(text)
        if n == 0:
            return
        scores = self._scores
        # Symbol i starts at character i; merged symbols keep the start of their left part.
        length = [1] * n
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        # Heap of (-score, left, right, size): best score first, then the leftmost pair,
        # which is the order of llama.cpp's priority queue.
        heap = []
        for i in range(n - 1):
            tid = lookup(text[i:i + 2])
            if tid is not None:
                heap.append((-scores[tid], i, i + 1, 2))
        heapq.heapify(heap)
        pop, push = heapq.heappop, heapq.heappush
        while heap:
            _, left, right, size = pop(heap)
            left_len, right_len = length[left], length[right]
            # Stale entry: one side has been merged away or grown since it was queued.
            if left_len == 0 or right_len == 0 or left_len + right_len != size:
                continue
            length[left] = size
            length[right] = 0
            after = nxt[right]
            nxt[left] = after
            if after >= 0:
                prv[after] = left
            before = prv[left]
            if before >= 0:
                merged = length[before] + size
                tid = lookup(text[before:before + merged])
                if tid is not None:
                    push(heap, (-scores[tid], before, left, merged))
            if after >= 0:
                merged = size + length[after]
                tid = lookup(text[left:left + merged])
                if tid is not None:
                    push(heap, (-scores[tid], left, after, merged))
        i = 0
        while i >= 0:
            piece = text[i:i + length[i]]
            tid = lookup(piece)
            if tid is not None:
                out.append(tid)
            else:
                # Only single characters can be missing: merges always produce vocab tokens.
                for b in piece.encode("utf-8", "surrogatepass"):
                    byte_id = self._byte_ids[b]
                    if byte_id is None:
                        raise ValueError(f"cannot tokenize {piece!r}: the vocabulary has no "
                                         f"<0x{b:02X}> byte token and no unknown token")
                    out.append(byte_id)
            i = nxt[i]


class _BpeEngine:
    """Byte-level BPE (``gpt2`` vocab) on HF ``tokenizers``: regex split, byte map, merges."""

    def __init__(self, tokens: Sequence[str], merges: Sequence[str], pattern: str):
        from tokenizers import Regex, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        vocab = {text: i for i, text in enumerate(tokens)}  # HF copies it: gone after __init__
        pairs = []
        for merge in merges:
            # Like llama.cpp, split at the first space after the first character.
            cut = merge.find(" ", 1)
            if cut < 0:
                raise ValueError(f"malformed BPE merge {merge!r} in tokenizer.ggml.merges")
            pairs.append((merge[:cut], merge[cut + 1:]))
        try:
            bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
        except Exception as exc:  # tokenizers raises a bare Exception for a bad merge list
            message = str(exc).splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"tokenizer.ggml.merges does not fit the vocabulary: {message}") \
                from None
        hf = HFTokenizer(bpe)
        hf.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ])
        self._hf = hf

    def encode(self, text: str, out: list[int]) -> None:
        """Append the ids of one raw-text fragment to ``out``."""
        out.extend(self._hf.encode(text, add_special_tokens=False).ids)


# --------------------------------------------------------------------------- tokenizer


class Tokenizer:
    """Text <-> token ids for a GGUF model, identical to llama.cpp's ``llama_tokenize``."""

    def __init__(
        self,
        *,
        model: str,
        tokens: Vocabulary,
        token_types: bytes,
        engine: _SpmEngine | _BpeEngine,
        bos_id: int | None,
        eos_id: int | None,
        eos_ids: frozenset[int],
        add_bos: bool,
        add_eos: bool,
        add_space_prefix: bool,
        control_ids: frozenset[int],
    ):
        self.model = model
        self.vocab_size = len(tokens)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.eos_ids = eos_ids
        self.add_bos = add_bos
        self.add_eos = add_eos  # informational: encode() never appends EOS
        self.add_space_prefix = add_space_prefix
        self._tokens = tokens
        self._types = token_types
        self._engine = engine
        self._control_ids = control_ids
        self._piece_cache: dict[int, bytes] = {}
        self._special_all, self._special_user = self._special_tables()

    @property
    def tokens(self) -> Sequence[str]:
        """Every token's text by id (empty ones as llama.cpp's ``[EMPTY_i]`` placeholder)."""
        return self._tokens

    # ----------------------------------------------------------------- construction

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any]) -> Tokenizer:
        """Build the tokenizer from a GGUF metadata dict (``read_gguf(path).metadata``)."""
        model = metadata.get("tokenizer.ggml.model")
        if not isinstance(model, str) or model not in SUPPORTED_MODELS:
            raise ValueError(
                f"unsupported tokenizer.ggml.model {model!r}; supported: "
                + ", ".join(SUPPORTED_MODELS)
            )
        tokens = _vocabulary(metadata)
        n = len(tokens)
        types = _token_types(metadata.get("tokenizer.ggml.token_type"), n)
        eos_ids, control_ids = _eog_ids(metadata, tokens, types)

        engine = _build_engine(model, metadata, tokens)
        if model == "llama":
            # SPM: BOS and a prefix space by default; Gemma's metadata turns the space off.
            add_bos_default = True
            add_space_prefix = _flag(metadata, "tokenizer.ggml.add_space_prefix", True)
        else:
            add_bos_default, add_space_prefix = False, False  # byte-level BPE never prefixes
        return cls(
            model=model,
            tokens=tokens,
            token_types=types,
            engine=engine,
            bos_id=_opt_id(metadata, "tokenizer.ggml.bos_token_id", n),
            eos_id=_opt_id(metadata, "tokenizer.ggml.eos_token_id", n),
            eos_ids=eos_ids,
            add_bos=_flag(metadata, "tokenizer.ggml.add_bos_token", add_bos_default),
            add_eos=_flag(metadata, "tokenizer.ggml.add_eos_token", False),
            add_space_prefix=add_space_prefix,
            control_ids=control_ids,
        )

    def _special_tables(self) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
        """Special-token strings in llama.cpp's partition order: longest UTF-8 text first.

        Returns (all special tokens, user-defined only): user-defined tokens are cut out of
        the text even when ``parse_special`` is off; control/unknown ones only when it is on.
        """
        specials = []
        kinds = np.frombuffer(self._types, dtype=np.uint8)
        special_kinds = (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED)
        candidates = set(np.flatnonzero(np.isin(kinds, special_kinds)).tolist())
        for i in sorted(candidates | self._control_ids):
            text, kind = self._tokens[i], self._types[i]
            is_control = kind in (TokenType.CONTROL, TokenType.UNKNOWN) or i in self._control_ids
            specials.append((len(text.encode("utf-8")), i, text, is_control))
        specials.sort(key=lambda s: (-s[0], s[1]))
        every = [(text, i) for _, i, text, _ in specials]
        user = [(text, i) for _, i, text, is_control in specials if not is_control]
        return every, user

    # ----------------------------------------------------------------- encoding

    def encode(
        self, text: str, add_bos: bool | None = None, parse_special: bool = False
    ) -> list[int]:
        """Tokenize ``text``.

        ``add_bos=None`` follows the model's metadata (``tokenizer.ggml.add_bos_token``);
        ``parse_special=True`` turns special-token text such as ``<|im_start|>`` into that
        token, otherwise it is tokenized as plain text (user-defined tokens are always cut
        out, as in llama.cpp).
        """
        if add_bos is None:
            add_bos = self.add_bos
        out: list[int] = []
        if add_bos:
            if self.bos_id is None:
                raise ValueError("this model has no BOS token (tokenizer.ggml.bos_token_id)")
            out.append(self.bos_id)
        prev_special = True  # SPM puts a prefix space on text that follows a special token
        for fragment in self._partition(text, parse_special):
            if isinstance(fragment, int):
                out.append(fragment)
                prev_special = True
                continue
            if self.add_space_prefix and prev_special:
                fragment = " " + fragment
            self._engine.encode(fragment, out)
            prev_special = False
        return out

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Cut ``text`` at special-token strings (llama.cpp ``tokenizer_st_partition``).

        Each special token, longest first, claims all its non-overlapping occurrences in the
        remaining text fragments, left to right.
        """
        if not text:
            return []
        fragments: list[str | int] = [text]
        for tok_text, tok_id in self._special_all if parse_special else self._special_user:
            if tok_text not in text:  # cheap filter: can't be in a fragment if not in the text
                continue
            cut: list[str | int] = []
            for frag in fragments:
                if isinstance(frag, int) or tok_text not in frag:
                    cut.append(frag)
                    continue
                parts = frag.split(tok_text)
                for k, part in enumerate(parts):
                    if k:
                        cut.append(tok_id)
                    if part:
                        cut.append(part)
            fragments = cut
        return fragments

    # ----------------------------------------------------------------- decoding

    def id_to_piece(self, token_id: int) -> str:
        """The token's vocab string as stored in the GGUF (``Ġ``/``▁`` and all)."""
        return self._tokens[token_id]

    def token_bytes(self, token_id: int, special: bool = False) -> bytes:
        """The raw bytes ``token_id`` stands for; control tokens give ``b""`` unless ``special``.

        A byte-fallback or byte-level token may be part of a multi-byte UTF-8 character, so
        the result need not be valid UTF-8 on its own.
        """
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} out of range [0, {self.vocab_size})")
        kind = self._types[token_id]
        if kind in (TokenType.CONTROL, TokenType.UNKNOWN) or token_id in self._control_ids:
            return self._tokens[token_id].encode("utf-8") if special else b""
        piece = self._piece_cache.get(token_id)
        if piece is None:
            piece = self._piece_bytes(token_id, kind)
            self._piece_cache[token_id] = piece
        return piece

    def _piece_bytes(self, token_id: int, kind: int) -> bytes:
        """Bytes of a non-control token, following llama.cpp's ``token_to_piece``."""
        text = self._tokens[token_id]
        if kind == TokenType.USER_DEFINED:
            return text.encode("utf-8")  # user-defined tokens are literal text in both vocabs
        if kind == TokenType.NORMAL:
            if self.model == "llama":
                return text.replace(_SPM_SPACE, " ").encode("utf-8")
            try:
                return bytes(_BYTE_DECODER[ch] for ch in text)
            except KeyError:  # not byte-level text: llama.cpp would flag it, keep it readable
                return text.encode("utf-8")
        if kind == TokenType.BYTE:
            try:
                return bytes([int(text[3:-1], 16)])  # "<0xAB>"
            except ValueError:  # a byte token whose text is not <0xXX>: print it as it is
                return text.encode("utf-8")
        return b""  # unused / undefined tokens print nothing, as in llama.cpp

    def decode(self, ids: Iterable[int], special: bool = False) -> str:
        """Detokenize ``ids``; invalid UTF-8 (e.g. a cut multi-byte character) becomes U+FFFD."""
        ids = list(ids)
        data = b"".join(self.token_bytes(i, special) for i in ids)
        return self._strip_prefix_space(ids, data).decode("utf-8", errors="replace")

    def _strip_prefix_space(self, ids: Sequence[int], data: bytes) -> bytes:
        """Undo the SPM prefix space when the text starts a sequence (llama.cpp detokenize).

        llama.cpp strips one leading space from the first piece when ``add_space_prefix`` is
        set, unless the sequence starts with BOS (whose empty piece absorbs the stripping).
        """
        if not self.add_space_prefix or not ids or ids[0] == self.bos_id:
            return data
        return data[1:] if data.startswith(b" ") else data

    def detokenizer(self, special: bool = False) -> StreamingDetokenizer:
        """A fresh incremental decoder for streaming generated tokens."""
        return StreamingDetokenizer(self, special)


class StreamingDetokenizer:
    """Turns a token stream into text without ever emitting half a UTF-8 character.

    Byte-level and byte-fallback tokens can split a character across tokens; the trailing
    incomplete bytes are held back until the character is complete.
    """

    def __init__(self, tokenizer: Tokenizer, special: bool = False):
        self._tok = tokenizer
        self._special = special
        self._pending = b""
        self._first = True
        self.text = ""

    def add(self, token_id: int) -> str:
        """Feed one token; return the text it completed (possibly "")."""
        data = self._tok.token_bytes(token_id, self._special)
        if self._first:
            data = self._tok._strip_prefix_space([token_id], data)
            self._first = False
        buf = self._pending + data
        cut = _complete_prefix_len(buf)
        self._pending = buf[cut:]
        new = buf[:cut].decode("utf-8", errors="replace")
        self.text += new
        return new

    def flush(self) -> str:
        """Emit whatever is still held (an incomplete character decodes to U+FFFD)."""
        new = self._pending.decode("utf-8", errors="replace")
        self._pending = b""
        self.text += new
        return new


def _complete_prefix_len(buf: bytes) -> int:
    """Length of the longest prefix of ``buf`` that does not end inside a UTF-8 sequence."""
    n = len(buf)
    # Look back at most 3 bytes for the lead byte of the last (possibly partial) sequence.
    for back in range(1, min(4, n) + 1):
        byte = buf[n - back]
        if byte & 0xC0 == 0x80:  # continuation byte: keep looking for the lead
            continue
        if byte >= 0xF0:
            need = 4
        elif byte >= 0xE0:
            need = 3
        elif byte >= 0xC0:
            need = 2
        else:
            need = 1
        return n - back if back < need and byte < 0xF8 else n
    return n


# --------------------------------------------------------------------------- metadata helpers


def _vocabulary(metadata: dict[str, Any]) -> Vocabulary:
    """The vocab strings; empty ones get llama.cpp's placeholder so lookups stay unique."""
    tokens = metadata.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError("GGUF metadata has no tokenizer.ggml.tokens")
    _require_strings(tokens, "tokenizer.ggml.tokens")
    if not len(tokens):
        raise ValueError("GGUF metadata has an empty tokenizer.ggml.tokens")
    return Vocabulary(tokens)


def _require_strings(values: Any, key: str) -> None:
    """``values`` must be a GGUF string array (a crafted file may put anything there)."""
    if isinstance(values, StringArray):
        return
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ValueError(f"{key} should be an array of strings, not {type(values).__name__}: "
                         "the file is corrupt")


def _numbers(values: Any, key: str) -> np.ndarray:
    """A GGUF numeric array (the reader gives numpy arrays), or a ValueError naming ``key``."""
    if not isinstance(values, np.ndarray) or values.dtype.kind not in "iufb":
        raise ValueError(f"{key} should be an array of numbers, not {type(values).__name__}: "
                         "the file is corrupt")
    return values


def _flag(metadata: dict[str, Any], key: str, default: bool) -> bool:
    """A boolean (or integer) metadata flag."""
    value = metadata.get(key, default)
    if not isinstance(value, bool | int | np.integer | np.bool_):
        raise ValueError(f"{key} should be a boolean, not {type(value).__name__}: "
                         "the file is corrupt")
    return bool(value)


def _token_types(values: Any, n: int) -> bytes:
    """Each token's ``TokenType`` as one byte (NORMAL where the metadata has none)."""
    if values is None:
        return bytes([TokenType.NORMAL]) * n
    kinds = _numbers(values, "tokenizer.ggml.token_type").astype(np.int64)
    if len(kinds) < n:
        raise ValueError("tokenizer.ggml.token_type is shorter than tokenizer.ggml.tokens")
    if len(kinds) and (kinds.min() < 0 or kinds.max() > 255):
        raise ValueError("tokenizer.ggml.token_type holds values outside 0..255")
    return kinds[:n].astype(np.uint8).tobytes()


def _opt_id(metadata: dict[str, Any], key: str, n: int) -> int | None:
    """A token id from metadata, or None when absent or out of range."""
    value = metadata.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{key} should be a token id, not {type(value).__name__}: "
                         "the file is corrupt")
    value = int(value)
    return value if 0 <= value < n else None


def _eog_ids(
    metadata: dict[str, Any],
    tokens: Vocabulary,
    types: bytes,
) -> tuple[frozenset[int], frozenset[int]]:
    """End-of-generation ids the way llama.cpp collects them, and tokens it forces to control.

    llama.cpp marks every token whose text is a known end-of-turn / FIM marker as control
    even if the GGUF says otherwise, which changes how it is partitioned and printed.
    """
    eog: set[int] = set()
    forced_control: set[int] = set()
    for text in _EOG_TEXTS | _FIM_EOG_TEXTS | _FIM_CONTROL_TEXTS:
        tid = tokens.id_of(text)
        if tid is None:
            continue
        if text not in _FIM_CONTROL_TEXTS:
            eog.add(tid)
        if types[tid] != TokenType.CONTROL:
            forced_control.add(tid)
    for key in _EOG_ID_KEYS:
        tid = _opt_id(metadata, key, len(tokens))
        if tid is not None:
            eog.add(tid)
    return frozenset(eog), frozenset(forced_control)


def _build_engine(
    model: str, metadata: dict[str, Any], tokens: Vocabulary
) -> _SpmEngine | _BpeEngine:
    """The subword engine for ``model`` ("llama" -> SPM, "gpt2" -> byte-level BPE)."""
    n = len(tokens)
    if model == "llama":
        raw_scores = metadata.get("tokenizer.ggml.scores")
        # a flat array of f32 (the file's own values): 4 bytes a score, not a 32-byte float
        # object (262k in Gemma)
        scores = array("f", bytes(4 * n) if raw_scores is None else
                       _numbers(raw_scores, "tokenizer.ggml.scores").astype(np.float32)
                       .tobytes())
        if len(scores) < n:
            raise ValueError("tokenizer.ggml.scores is shorter than tokenizer.ggml.tokens")
        unk_id = _opt_id(metadata, "tokenizer.ggml.unknown_token_id", n)
        return _SpmEngine(tokens, scores, unk_id)
    pre = metadata.get("tokenizer.ggml.pre")
    if not isinstance(pre, str) or pre not in _BPE_PRE_PATTERNS:
        raise ValueError(
            f"unsupported tokenizer.ggml.pre {pre!r} for a gpt2 vocab; supported: "
            + ", ".join(sorted(_BPE_PRE_PATTERNS))
        )
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is None:
        raise ValueError("gpt2 tokenizer without tokenizer.ggml.merges")
    _require_strings(merges, "tokenizer.ggml.merges")
    if not len(merges):
        raise ValueError("gpt2 tokenizer with an empty tokenizer.ggml.merges")
    return _BpeEngine(tokens, merges, _BPE_PRE_PATTERNS[pre])
