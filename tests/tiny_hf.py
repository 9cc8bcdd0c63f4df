"""Tiny random Hugging Face model folders, written by transformers itself, for converter tests.

Each architecture gets a real ``config.json`` and ``model.safetensors`` from
``save_pretrained`` and a real tokenizer: byte-level BPE trained with ``tokenizers`` (with the
architecture's own pre-tokenizer regex) or a SentencePiece model trained with
``sentencepiece`` (Gemma 3). Needs torch, transformers, tokenizers (and sentencepiece).
"""

from __future__ import annotations

import json
from pathlib import Path

QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
            r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
             r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

#: calibration/training text: English, code, digits, odd whitespace, non-ASCII
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2024; we'll see 12345 items.",
    "def hello(world):\n    return world + 1  # comment\n\n\nclass Foo:\n\tpass\n",
    "Hello, world! Ünïcödé tëxt — naïve café. 東京 and Москва.   spaces   here",
    "for i in range(10):\n    print(i * 3.14159)\n",
    "You are a helpful assistant. The user asks about the weather in Paris today.",
] * 20

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog 1234567",
    "def f(x):\n    return x*2\n\n\n",
    "  leading spaces and trailing   ",
    "Ünïcödé 東京 Москва ok",
    "<|im_start|>user\nhi<|im_end|>",
    "it's we'll THEY'RE",
]

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")

#: name -> (HF config class, model class, extra config, tokenizer kind)
ARCHS = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, "qwen2"),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, "llama3"),
    # Llama 3.x RoPE scaling, the window set so the 8 frequencies of a 16-wide head fall in
    # all three bands (kept, blended, divided by the factor)
    "llama3_rope": ("LlamaConfig", "LlamaForCausalLM",
                    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 128}}, "llama3"),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 6}, "llama3"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}, "qwen2"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 512}, "spm"),
}


def write_bpe_tokenizer(folder: Path, regex: str, vocab_size: int) -> int:
    """A byte-level BPE tokenizer.json trained on CORPUS; returns its vocabulary size."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIALS), special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens(SPECIALS)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "chat_template": CHAT_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size()


def write_spm_tokenizer(folder: Path, vocab_size: int) -> int:
    """A SentencePiece BPE tokenizer.model with byte fallback trained on CORPUS."""
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=model, vocab_size=vocab_size,
        model_type="bpe", byte_fallback=True, character_coverage=1.0, bos_id=2, eos_id=1,
        unk_id=3, pad_id=0, minloglevel=2, add_dummy_prefix=False, hard_vocab_limit=False,
        normalization_rule_name="identity", remove_extra_whitespaces=False)  # as Gemma's
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
              "add_bos_token": True, "add_eos_token": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    return sp.vocab_size()


def make_hf_folder(folder: Path, arch: str, seed: int = 0, vocab_size: int = 384,
                   n_layers: int = 2, init_range: float = 0.02, head_gain: float = 30.0,
                   hidden: int = 64):
    """Write a tiny random ``arch`` checkpoint into ``folder``; returns the transformers model.

    The output matrix is ``head_gain`` times larger than the rest, so the logits have clear
    winners as a trained model's do (a top-1 comparison then measures the conversion, not
    noise between near-ties), while the layers stay at a trained model's scale.
    """
    import torch
    import transformers

    config_cls, model_cls, extra, tok_kind = ARCHS[arch]
    folder.mkdir(parents=True, exist_ok=True)
    if tok_kind == "spm":
        n_tokens = write_spm_tokenizer(folder, vocab_size)
    else:
        n_tokens = write_bpe_tokenizer(folder, QWEN2_RE if tok_kind == "qwen2" else LLAMA3_RE,
                                       vocab_size)
    config = getattr(transformers, config_cls)(
        vocab_size=max(vocab_size, n_tokens), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
        initializer_range=init_range, **extra)
    if tok_kind != "spm":
        config.eos_token_id = n_tokens - 1  # <|im_end|>
        config.bos_token_id = None
    config.architectures = [model_cls]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # random (not unit) norms, so a wrong norm transform shows
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else p)
        model.lm_head.weight.mul_(head_gain)
    model.save_pretrained(folder, safe_serialization=True)
    return model
