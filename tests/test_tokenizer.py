"""Tokenizer vs llama.cpp: reference token ids for the three real models, decoding, streaming."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from edgellm.converters.gguf_reader import read_gguf
from edgellm.tokenizer import StreamingDetokenizer, Tokenizer

# catalog name -> reference file prefix
MODELS = {
    "qwen2.5-coder-0.5b-instruct": "qwen05",
    "qwen2.5-coder-1.5b-instruct": "qwen15",
    "gemma-3-270m": "gemma3",
}
QWEN, GEMMA = "qwen2.5-coder-0.5b-instruct", "gemma-3-270m"

# Texts whose characters span several tokens: CJK, emoji with modifiers and ZWJ sequences,
# and characters Gemma only has as <0xXX> byte-fallback tokens (Fraktur, new emoji, ꙮ).
MULTIBYTE_TEXTS = [
    "日本語のテキストと中文文本",
    "emoji 😀👍🏽 🇫🇷 family 👨\u200d👩\u200d👧",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \U0001fae8 ꙮ 𓀀 \U00031350",
    "naïve café — “quotes” …",
]


class _Loaded:
    """Tokenizers and metadata loaded once per module: metadata parsing is the slow part."""

    def __init__(self, model_path) -> None:
        self._model_path = model_path
        self._cache: dict[str, tuple[dict, Tokenizer, float]] = {}

    def get(self, name: str) -> tuple[dict, Tokenizer, float]:
        """(metadata, tokenizer, seconds spent in from_gguf_metadata)."""
        if name not in self._cache:
            metadata = read_gguf(self._model_path(name)).metadata
            start = time.perf_counter()
            tok = Tokenizer.from_gguf_metadata(metadata)
            self._cache[name] = (metadata, tok, time.perf_counter() - start)
        return self._cache[name]

    def tok(self, name: str) -> Tokenizer:
        return self.get(name)[1]


@pytest.fixture(scope="module")
def loaded(model_path) -> _Loaded:
    return _Loaded(model_path)


def _reference(reference_dir: Path, name: str, kind: str) -> dict:
    return json.loads((reference_dir / f"{MODELS[name]}.{kind}.json").read_text())


def _reference_texts(reference_dir: Path) -> list[str]:
    texts = []
    for name in MODELS:
        texts += [e["text"] for e in _reference(reference_dir, name, "tokenize")["tokenize"]]
    return list(dict.fromkeys(texts))


# --------------------------------------------------------------------------- encoding


@pytest.mark.parametrize("name", MODELS)
def test_reference_tokenize(loaded, reference_dir, name):
    """Every reference text in all three modes gives llama.cpp's ids exactly."""
    tok = loaded.tok(name)
    entries = _reference(reference_dir, name, "tokenize")["tokenize"]
    modes = {
        "ids_add_bos": {},  # add_special=True: BOS only where the metadata asks for it
        "ids_no_bos": {"add_bos": False},
        "ids_special": {"add_bos": False, "parse_special": True},
    }
    mismatches = [
        (entry["text"], field)
        for entry in entries
        for field, kwargs in modes.items()
        if tok.encode(entry["text"], **kwargs) != entry[field]
    ]
    assert len(entries) >= 20
    assert not mismatches, f"{len(mismatches)} mismatches, first: {mismatches[:3]}"


@pytest.mark.parametrize("name", MODELS)
def test_reference_prompt_ids(loaded, reference_dir, name):
    """Raw prompts as llama.cpp's tools tokenize them: metadata BOS rule, special tokens parsed."""
    tok = loaded.tok(name)
    for entry in _reference(reference_dir, name, "greedy")["generate"]:
        ids = tok.encode(entry["prompt"], parse_special=True)
        assert ids == entry["prompt_ids"], entry["prompt"]


def test_gemma_long_text(loaded, reference_dir):
    """The GPL-3 text (35 KB, many lines and space runs) matches llama.cpp's ids."""
    ref = json.loads((reference_dir / "gemma3.long-gpl3.json").read_text())
    path = Path(ref["text"])
    if not path.is_file():
        pytest.skip(f"{path} not present on this system")
    ids = loaded.tok(GEMMA).encode(path.read_text())
    assert len(ref["ids"]) == 2048 and len(ids) > len(ref["ids"])
    assert ids[: len(ref["ids"])] == ref["ids"]


@pytest.mark.parametrize("name", [QWEN, GEMMA])
def test_user_defined_tokens_split_without_parse_special(loaded, name):
    """llama.cpp cuts user-defined tokens out even with parse_special off; control ones not."""
    tok = loaded.tok(name)
    if name == QWEN:
        assert tok.encode("x<tool_call>y") == [87, 151657, 88]
        assert 151644 not in tok.encode("<|im_start|>")
    else:
        assert tok.encode("<table>hi</table>", add_bos=False) == [168, 2202, 176]
        assert 105 not in tok.encode("<start_of_turn>", add_bos=False)
        assert tok.encode("<start_of_turn>", add_bos=False, parse_special=True) == [105]


@pytest.mark.parametrize("name", MODELS)
def test_special_token_metadata(loaded, reference_dir, name):
    """BOS/EOS match llama.cpp, and end-of-turn tokens count as end of generation."""
    tok = loaded.tok(name)
    meta = _reference(reference_dir, name, "tokenize")["meta"]
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (meta["bos"], meta["eos"], meta["n_vocab"])
    if name == GEMMA:
        assert tok.add_bos and {1, 106} <= tok.eos_ids  # <eos>, <end_of_turn>
    else:
        assert not tok.add_bos and {151643, 151645} <= tok.eos_ids  # <|endoftext|>, <|im_end|>


def test_load_and_encode_speed(loaded):
    """Building the 262k-entry Gemma tokenizer and encoding 35 KB both stay well under 2 s."""
    _, tok, load_seconds = loaded.get(GEMMA)
    text = Path("/usr/share/common-licenses/GPL-3")
    text = text.read_text() if text.is_file() else "The GNU General Public License. " * 1100
    start = time.perf_counter()
    tok.encode(text)
    encode_seconds = time.perf_counter() - start
    assert load_seconds < 2.0, f"load took {load_seconds:.2f}s"
    assert encode_seconds < 2.0, f"encode took {encode_seconds:.2f}s"


@pytest.mark.parametrize("field", ["tokenizer.ggml.model", "tokenizer.ggml.pre"])
def test_unsupported_tokenizer_raises(loaded, field):
    metadata = dict(loaded.get(QWEN)[0])
    metadata[field] = "bert" if field == "tokenizer.ggml.model" else "falcon"
    with pytest.raises(ValueError, match="supported"):
        Tokenizer.from_gguf_metadata(metadata)


# --------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("name", MODELS)
def test_round_trip(loaded, reference_dir, name):
    """decode(encode(x)) == x, with and without BOS and with special tokens kept."""
    tok = loaded.tok(name)
    for text in _reference_texts(reference_dir) + MULTIBYTE_TEXTS:
        assert tok.decode(tok.encode(text)) == text
        assert tok.decode(tok.encode(text, add_bos=False)) == text
        parsed = tok.encode(text, add_bos=False, parse_special=True)
        assert tok.decode(parsed, special=True) == text


def test_control_tokens_decode(loaded):
    """Control tokens print nothing unless asked; id_to_piece shows the raw vocab string."""
    tok = loaded.tok(QWEN)
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>", parse_special=True)
    assert ids == [151644, 872, 198, 6023, 151645]
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, special=True) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.token_bytes(151644) == b"" and tok.token_bytes(151644, special=True)
    assert tok.id_to_piece(21927) == "ĠHello" and tok.token_bytes(21927) == b" Hello"
    gemma = loaded.tok(GEMMA)
    assert gemma.id_to_piece(26352) == "▁Hello" and gemma.token_bytes(26352) == b" Hello"
    assert gemma.token_bytes(gemma.encode("<0xF0>", add_bos=False)[0]) != b"\xf0"  # plain text
    assert gemma.token_bytes(478) == b"\xf0"  # the <0xF0> byte-fallback token


def _stream(det: StreamingDetokenizer, ids: list[int]) -> tuple[list[str], str]:
    chunks = [det.add(i) for i in ids]
    return chunks, det.flush()


@pytest.mark.parametrize("name", [QWEN, GEMMA])
def test_streaming_detokenizer_whole_characters(loaded, name):
    """Streaming never emits a partial character and adds up to decode()."""
    tok = loaded.tok(name)
    held_back = 0
    for text in MULTIBYTE_TEXTS:
        ids = tok.encode(text)
        det = tok.detokenizer()
        chunks, rest = _stream(det, ids)
        assert rest == ""
        assert all("\ufffd" not in chunk for chunk in chunks)
        assert "".join(chunks) == det.text == tok.decode(ids) == text
        # Tokens that are only part of a character must have been held back.
        pairs = zip(ids, chunks, strict=True)
        held_back += sum(1 for i, chunk in pairs if chunk == "" and tok.token_bytes(i))
    assert held_back > 0


def test_streaming_flush_incomplete(loaded):
    """An unfinished character stays pending until flush(), which replaces it."""
    tok = loaded.tok(GEMMA)
    ids = tok.encode("a\U0001fae8", add_bos=False)  # "a" then four <0xXX> tokens
    det = tok.detokenizer()
    assert det.add(ids[0]) == "a"
    assert [det.add(i) for i in ids[1:3]] == ["", ""]
    assert det.flush() == "\ufffd"
    assert det.text == "a\ufffd"


def test_vocabulary_maps_texts_to_ids_like_a_dict():
    """Ids by text as ``{text: i for i, text in enumerate(tokens)}`` would give them (a
    repeated text maps to its later id), with empty texts as llama.cpp's placeholders."""
    from edgellm.tokenizer import Vocabulary

    texts = ["a", "", "▁the", "a", "<0x0A>", "[EMPTY_1]x", "é"]
    vocab = Vocabulary(texts)
    expected = {t: i for i, t in enumerate(vocab)}
    assert vocab[1] == "[EMPTY_1]" and list(vocab)[2:] == texts[2:] and len(vocab) == 7
    assert all(vocab.id_of(t) == i for t, i in expected.items())
    assert vocab.id_of("a") == 3 and vocab.id_of("") is None and vocab.id_of("b") is None


def test_vocabulary_survives_a_trip_to_another_process(tmp_path):
    """Python salts str hashes per process: a pickled vocabulary must rebuild its lookup."""
    import pickle
    import subprocess
    import sys

    from edgellm.converters.gguf_reader import read_gguf
    from tests.tiny_models import write_tiny_llama

    vocab = Tokenizer.from_gguf_metadata(read_gguf(write_tiny_llama(
        tmp_path / "t.gguf")).metadata).tokens
    (tmp_path / "v.pkl").write_bytes(pickle.dumps(vocab))
    probe = [vocab[i] for i in (0, 5, len(vocab) - 1)]
    code = ("import pickle, sys; v = pickle.load(open(sys.argv[1], 'rb')); "
            "print([v.id_of(t) for t in sys.argv[2:]])")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "v.pkl"), *probe],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == str([vocab.id_of(t) for t in probe])
