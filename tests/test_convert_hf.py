"""`edgellm convert` on tiny random Hugging Face checkpoints made by transformers itself.

Per architecture: the f32 conversion's logits equal transformers' on the folder; the q8_0
conversion equals transformers run on the same q8_0-rounded weights (so the converter adds
nothing but the quantization) and agrees with its f32 top-1; tokenization equals HF
`tokenizers` / sentencepiece on the source folder. Then every refusal, the kill-mid-write
case, and the imatrix path. Skipped without torch/transformers (`pip install -e .[hf]`).
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import edgellm  # noqa: E402
from edgellm.apps.convert import main as convert_main  # noqa: E402
from edgellm.converters.hf_convert import convert, plan_conversion  # noqa: E402
from tests.tiny_hf import ARCHS, TEXTS, make_hf_folder  # noqa: E402

ARCH_NAMES = list(ARCHS)
N_TOKENS = 96


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One tiny checkpoint per architecture (and its transformers model), made once."""
    made = {}
    for arch in ARCH_NAMES:
        if ARCHS[arch][3] == "spm":
            pytest.importorskip("sentencepiece")
        folder = tmp_path_factory.mktemp(arch)
        made[arch] = (folder, make_hf_folder(folder, arch, seed=ARCH_NAMES.index(arch)))
    return made


def tokens_for(model) -> list[int]:
    rng = np.random.default_rng(7)
    return rng.integers(0, model.config.vocab_size, N_TOKENS).tolist()


def hf_logits(model, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


def our_logits(path: Path, tokens: list[int]) -> np.ndarray:
    """Prefill half, decode the rest one by one (both paths), numpy backend, f32 KV."""
    model = edgellm.load(path, backend="numpy")
    cache = model.make_cache(len(tokens) + 8, dtype="float32")
    split = len(tokens) // 2
    first = model.net.forward(np.array(tokens[:split]), cache, all_logits=True)
    rest = [model.net.forward(np.array([t]), cache) for t in tokens[split:]]
    return np.concatenate([first, *rest])


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_f32_conversion_matches_transformers(folders, tmp_path, arch):
    folder, model = folders[arch]
    out = convert(folder, tmp_path / "f32.gguf", "f32")
    assert out.kind.name == "f32" and (tmp_path / "f32.gguf").is_file()
    tokens = tokens_for(model)
    np.testing.assert_allclose(our_logits(tmp_path / "f32.gguf", tokens),
                               hf_logits(model, tokens), atol=1e-3, rtol=0)


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_q8_0_conversion_is_the_quantization_and_nothing_else(folders, tmp_path, arch):
    from gguf import GGMLQuantizationType as Q

    from edgellm.quants import dequantize, quantize

    folder, model = folders[arch]
    convert(folder, tmp_path / "q8.gguf", "q8_0")
    tokens = tokens_for(model)
    ours = our_logits(tmp_path / "q8.gguf", tokens)
    reference = hf_logits(model, tokens)
    rounded = type(model)(model.config).eval()  # the same weights, q8_0-rounded
    state = {}
    for name, p in model.state_dict().items():
        w = p.numpy()
        if w.ndim == 2:
            w = dequantize(quantize(w, Q.Q8_0), Q.Q8_0).reshape(w.shape)
        state[name] = torch.from_numpy(np.ascontiguousarray(w))
    rounded.load_state_dict(state)
    same_weights = hf_logits(rounded, tokens)
    np.testing.assert_allclose(ours, same_weights, atol=1e-3, rtol=0)
    assert (ours.argmax(-1) == same_weights.argmax(-1)).mean() >= 0.99
    # against f32 transformers: tiny random models amplify rounding (measured 0.90-1.0)
    assert (ours.argmax(-1) == reference.argmax(-1)).mean() >= 0.85


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_tokenization_matches_the_source_tokenizer(folders, tmp_path, arch):
    folder, _ = folders[arch]
    convert(folder, tmp_path / "t.gguf", "q8_0")
    ours = edgellm.load(tmp_path / "t.gguf", backend="numpy").tokenizer
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        hf = Tokenizer.from_file(str(folder / "tokenizer.json"))
        for text in TEXTS:
            expected = hf.encode(text, add_special_tokens=False).ids
            assert ours.encode(text, add_bos=False, parse_special=True) == expected, text
    else:
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
        for text in TEXTS:
            assert ours.encode(text, add_bos=False) == sp.encode(text), text


def test_info_tokenize_and_bench_take_a_folder(folders, capsys):
    """Every command that takes a model takes a folder: info and tokenize read no weights."""
    from tokenizers import Tokenizer

    from edgellm.apps.info import main as info_main
    from edgellm.apps.tokenize import main as tokenize_main
    from edgellm.bench import bench_model

    folder, model = folders["qwen2"]
    n_params = sum(p.numel() for p in model.parameters())
    assert info_main([str(folder), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["source"] == "hf folder as q8_0" and info["architecture"] == "qwen2"
    assert info["parameters"] == n_params and set(info["quant_mix"]) == {"Q8_0", "F32"}
    text = TEXTS[1]
    assert tokenize_main(["-m", str(folder), "--ids-only", text]) == 0
    ids = json.loads(capsys.readouterr().out)
    hf = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert ids == hf.encode(text, add_special_tokens=False).ids
    pp, tg = bench_model(str(folder), "numpy", n_prompt=8, n_gen=4, repetitions=1)
    assert (pp.test, tg.test, pp.params, pp.quant) == ("pp8", "tg4", n_params, "Q8_0")
    assert pp.size == info["weight_bytes"] and tg.mean > 0


def test_chat_template_and_special_ids_survive(folders, tmp_path):
    folder, _ = folders["qwen2"]
    convert(folder, tmp_path / "c.gguf", "q8_0")
    model = edgellm.load(tmp_path / "c.gguf", backend="numpy")
    prompt = model.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert model.tokenizer.id_to_piece(model.tokenizer.eos_id) == "<|im_end|>"


# ------------------------------------------------------------------------- refusals


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    from edgellm.apps.common import run_guarded

    code = run_guarded(lambda: convert_main(argv))
    return code, capsys.readouterr().err


def copy_folder(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def refused(folder: Path, tmp_path: Path, capsys, needle: str, extra: list[str] = ()) -> None:
    out = tmp_path / "out.gguf"
    code, err = run_cli([str(folder), "-o", str(out), "--type", "q8_0", *extra], capsys)
    assert code == 1, err
    assert err.startswith("edgellm: error: ") and err.count("\n") == 1, err
    assert needle in err, err
    assert not out.exists() and not Path(str(out) + ".partial").exists()


def test_refuses_unknown_architecture(folders, tmp_path, capsys):
    folder = copy_folder(folders["qwen2"][0], tmp_path / "m")
    edit_json(folder / "config.json", architectures=["MambaForCausalLM"])
    refused(folder, tmp_path, capsys, "unsupported architecture 'MambaForCausalLM'")


def test_refuses_missing_config(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    refused(tmp_path / "m", tmp_path, capsys, "no config.json")


def test_refuses_missing_weights(folders, tmp_path, capsys):
    folder = copy_folder(folders["qwen2"][0], tmp_path / "m")
    (folder / "model.safetensors").unlink()
    refused(folder, tmp_path, capsys, "no .safetensors weights")


def test_refuses_missing_shard_and_wrong_index(folders, tmp_path, capsys):
    folder = copy_folder(folders["qwen2"][0], tmp_path / "m")
    names = json.loads(_header(folder / "model.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names if n != "__metadata__"}
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    index = folder / "model.safetensors.index.json"
    missing = {**weight_map, "lm_head.weight": "model-00002-of-00002.safetensors"}
    index.write_text(json.dumps({"weight_map": missing}))
    refused(folder, tmp_path, capsys, "model-00002-of-00002.safetensors: shard named by")
    weight_map["model.extra.weight"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps({"weight_map": weight_map}))
    refused(folder, tmp_path, capsys, "'model.extra.weight' is not in")


def _header(path: Path) -> bytes:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(n)


def test_sharded_checkpoint_converts_like_a_single_file(folders, tmp_path):
    """The same tensors split over two shards with an index give the same file."""
    from safetensors.numpy import load_file, save_file

    folder = copy_folder(folders["llama"][0], tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for shard, part in halves.items():
        save_file({n: tensors[n] for n in part}, folder / shard)
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: s for s, part in halves.items() for n in part}}))
    convert(folder, tmp_path / "sharded.gguf", "q8_0", name="tiny")
    convert(folders["llama"][0], tmp_path / "single.gguf", "q8_0", name="tiny")
    assert (tmp_path / "sharded.gguf").read_bytes() == (tmp_path / "single.gguf").read_bytes()


def test_refuses_truncated_or_unsupported_dtype(folders, tmp_path, capsys):
    folder = copy_folder(folders["qwen2"][0], tmp_path / "m")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-1000])
    refused(folder, tmp_path, capsys, "truncated")
    from safetensors.numpy import save_file

    save_file({"model.embed_tokens.weight": np.zeros((4, 4), dtype=np.int32)}, weights)
    refused(folder, tmp_path, capsys, "dtype I32")


def test_refuses_shapes_that_contradict_the_config(folders, tmp_path, capsys):
    folder = copy_folder(folders["qwen2"][0], tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    edit_json(folder / "config.json", intermediate_size=config["intermediate_size"] * 2)
    refused(folder, tmp_path, capsys, "config and weights do not match")
    edit_json(folder / "config.json", intermediate_size=config["intermediate_size"],
              num_hidden_layers=config["num_hidden_layers"] + 1)
    refused(folder, tmp_path, capsys, "checkpoint lacks the tensor for blk.2.attn_q.weight")


def test_refuses_rope_scalings_it_cannot_write(folders, tmp_path, capsys):
    folder = copy_folder(folders["qwen2"][0], tmp_path / "m")
    edit_json(folder / "config.json", rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                        "original_max_position_embeddings": 64})
    refused(folder, tmp_path, capsys, "RoPE scaling 'yarn' is not supported")
    edit_json(folder / "config.json", rope_parameters={"rope_type": "llama3", "factor": 8.0})
    refused(folder, tmp_path, capsys, "Llama 3 RoPE scaling on Qwen2ForCausalLM")


def test_llama3_rope_scaling_becomes_the_rope_freqs_tensor(folders, tmp_path):
    from edgellm.converters.gguf_reader import read_gguf

    convert(folders["llama3_rope"][0], tmp_path / "l3.gguf", "q8_0")
    tensors = read_gguf(tmp_path / "l3.gguf").tensors
    assert next(iter(tensors)) == "rope_freqs.weight"  # first, where llama.cpp writes it
    factors = tensors["rope_freqs.weight"].dequantize()
    # 16-wide heads, theta 1e4, window 128/4..128/1: 2 kept, 1 blended, 5 divided by 8
    assert factors.dtype == np.float32 and factors.shape == (8,)
    np.testing.assert_array_equal(factors[:2], 1.0)
    assert 1.0 < factors[2] < 8.0
    np.testing.assert_array_equal(factors[3:], 8.0)


def test_refuses_unknown_pre_tokenizer_naming_it(folders, tmp_path, capsys):
    folder = copy_folder(folders["qwen2"][0], tmp_path / "m")
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\p{L}+|\s+"
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    refused(folder, tmp_path, capsys, r"unknown BPE pre-tokenizer (split '\\p{L}+|\\s+'")


def test_refuses_unwritable_output_before_reading(folders, tmp_path, capsys):
    folder = folders["qwen2"][0]
    code, err = run_cli([str(folder), "-o", str(tmp_path / "nodir" / "x.gguf")], capsys)
    assert code == 1 and "no such directory" in err
    code, err = run_cli([str(folder), "-o", str(tmp_path)], capsys)
    assert code == 1 and "is a directory" in err
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "ro"
        locked.mkdir(mode=0o500)
        code, err = run_cli([str(folder), "-o", str(locked / "x.gguf")], capsys)
        assert code == 1 and "not writable" in err


def test_dry_run_prints_the_plan_and_writes_nothing(folders, tmp_path, capsys):
    folder = folders["qwen2"][0]
    out = tmp_path / "x.gguf"
    code, _ = run_cli([str(folder), "-o", str(out), "--type", "q4_k_m", "--dry-run"], capsys)
    assert code == 0 and not out.exists()
    code = convert_main([str(folder), "--type", "q4_k_m", "--dry-run"])
    captured = capsys.readouterr()
    assert "blk.0.attn_q.weight" in captured.out and "bits per weight" in captured.out
    # width 64 is not a multiple of 256: every K-quant matrix falls back, each one listed
    plan = plan_conversion(folder, "q4_k_m")
    assert plan.fallbacks and all(f"fallback: {t.name}:" in captured.err
                                  for t in plan.fallbacks)


def test_kill_mid_write_leaves_nothing_under_the_final_name(folders, tmp_path):
    folder = folders["qwen2"][0]
    out = tmp_path / "killed.gguf"
    script = textwrap.dedent(f"""
        import os, signal
        from edgellm.converters.hf_convert import plan_conversion, write_gguf
        def die(done, total, nbytes, total_bytes):
            if done == 5:
                os.kill(os.getpid(), signal.SIGKILL)
        write_gguf(plan_conversion({str(folder)!r}, "q8_0"), {str(out)!r}, progress=die)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parents[1])
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists()
    partial = Path(str(out) + ".partial")
    assert partial.exists() and partial.stat().st_size > 0  # it was killed mid-write
    convert(folder, out, "q8_0")  # a rerun replaces the stale partial
    assert out.exists() and not partial.exists()


# ------------------------------------------------------------------------- imatrix


def test_imatrix_from_our_runtime_round_trips_and_weights_the_search(folders, tmp_path):
    from edgellm.converters.imatrix import read_imatrix, write_imatrix
    from edgellm.imatrix import compute_imatrix
    from tests.tiny_hf import CORPUS

    folder, _ = folders["llama"]
    convert(folder, tmp_path / "f32.gguf", "f32")
    imatrix = compute_imatrix(tmp_path / "f32.gguf", "".join(CORPUS), ctx=64, chunks=3,
                              backend="numpy")
    assert imatrix.chunk_count == 3 and "output.weight" not in imatrix.sums
    assert imatrix.counts["blk.0.attn_q.weight"] == 3 * 64
    assert set(imatrix.sums) == {f"blk.{i}.{w}.weight" for i in range(2) for w in (
        "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    write_imatrix(imatrix, tmp_path / "imatrix.gguf")
    back = read_imatrix(tmp_path / "imatrix.gguf")
    assert back.counts == imatrix.counts
    for name, sums in imatrix.sums.items():
        np.testing.assert_allclose(back.sums[name], sums, rtol=1e-6)
    # q4_0 (width 64 fits its blocks): the imatrix changes the weighted search's result
    plain = plan_conversion(folder, "q4_0")
    weighted = plan_conversion(folder, "q4_0", imatrix=back)
    assert not weighted.imatrix_missing
    # the file records which imatrix made it, under llama-quantize's keys
    assert {k: v for k, v in weighted.metadata.items() if k.startswith("quantize.")} == {
        "quantize.imatrix.file": str(tmp_path / "imatrix.gguf"),
        "quantize.imatrix.dataset": "calibration text", "quantize.imatrix.entries_count": 14,
        "quantize.imatrix.chunks_count": 3}
    assert not any(k.startswith("quantize.") for k in plain.metadata)
    from edgellm.converters.hf_convert import converted_tensors

    changed = [a.name for (a, x), (_, y) in zip(converted_tensors(plain),
                                                converted_tensors(weighted), strict=True)
               if a.name.startswith("blk.") and x.shape == y.shape and not np.array_equal(x, y)]
    assert len(changed) >= 10


def test_imatrix_command_takes_a_folder(folders, tmp_path, capsys):
    """`edgellm imatrix -m FOLDER --quant f32` runs the checkpoint converted in memory: the
    same matrix as from the f32 file written by convert, and no model file written."""
    from edgellm.apps.imatrix import main
    from edgellm.converters.imatrix import read_imatrix
    from tests.tiny_hf import CORPUS

    folder, _ = folders["llama"]
    text = tmp_path / "calib.txt"
    text.write_text("".join(CORPUS))
    convert(folder, tmp_path / "f32.gguf", "f32")
    for model, out in ((folder, "from_folder.gguf"), (tmp_path / "f32.gguf", "from_file.gguf")):
        assert main(["-m", str(model), "--quant", "f32", "-f", str(text), "-c", "64",
                     "--chunks", "2", "--backend", "numpy", "-o", str(tmp_path / out)]) == 0
    a, b = (read_imatrix(tmp_path / n) for n in ("from_folder.gguf", "from_file.gguf"))
    assert a.counts == b.counts and set(a.sums) == set(b.sums)
    for name in a.sums:
        np.testing.assert_array_equal(a.sums[name], b.sums[name])
    assert "wrote" in capsys.readouterr().out
    assert not list(folder.glob("*.gguf"))


def test_a_folder_loads_directly_quantized_in_memory(folders, tmp_path):
    """edgellm.load(folder, quant=...) is the converted file, without the file."""
    folder, model = folders["qwen3"]
    convert(folder, tmp_path / "q4.gguf", "q4_0")
    tokens = tokens_for(model)[:24]
    from_file = edgellm.load(tmp_path / "q4.gguf", backend="numpy")
    from_folder = edgellm.load(folder, backend="numpy", quant="q4_0")
    assert from_folder.encode("Hello world") == from_file.encode("Hello world")
    logits = [m.net.forward(np.array(tokens), m.make_cache(32, dtype="float32"), all_logits=True)
              for m in (from_file, from_folder)]
    np.testing.assert_array_equal(logits[0], logits[1])


def test_verify_reports_tokenization_and_logits(folders, tmp_path, capsys):
    folder, _ = folders["llama"]
    code = convert_main([str(folder), "-o", str(tmp_path / "v.gguf"), "--type", "f32",
                         "--verify"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "tokenization 5/5 texts equal" in out
    assert "top-1 agreement" in out
