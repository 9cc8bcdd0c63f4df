"""The torch backend's triton kernels as ptxas compiles them for a Hopper GPU (sm_90), here
without one (``tests/offline_sm90.py``): decode's kernels keep their values in registers at
the three models' shapes, and programmatic dependent launches wait before they read.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # the recorded steps run in triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton.backends.nvidia")

from edgellm.quants import Q  # noqa: E402
from tests import offline_sm90  # noqa: E402

#: query heads, KV heads, head dim: Qwen2.5-Coder 1.5B, Qwen2.5-Coder 0.5B, Gemma 3 270M
HEADS = {"qwen-1.5b": (12, 2, 128), "qwen-0.5b": (14, 2, 64), "gemma-270m": (4, 1, 256)}


@pytest.mark.parametrize("sequences", [1, 4], ids=["one", "batch"])
@pytest.mark.parametrize("storage", [656, 4096], ids=["bench", "chat"])
@pytest.mark.parametrize("model", list(HEADS))
def test_decode_attention_keeps_to_registers(model, storage, sequences):
    """A decode step's attention as a graph launches it, over the bench's cache (656
    slots) and a chat's default (4,096), one sequence's or a batch graph's (each token
    over its own cache: APART): nothing spilt to local memory. Its combine once loaded
    every split's values as one (splits, head dim) tile: 255 registers and 64 (1.5B) and
    88 (Gemma) bytes spilt per thread at 4,096 slots."""
    compiled = offline_sm90.compile_launch(*offline_sm90.attention_launch(
        *HEADS[model], storage, sequences=sequences))
    print(f"{model} {storage} slots, {sequences} sequences: {compiled.registers} registers")
    assert compiled.spilt_bytes == 0, compiled.registers


@pytest.mark.parametrize("model", list(HEADS))
def test_decode_attention_waits_for_memory_once_a_tile(model):
    """A decode step's attention as a graph launches it (the bench's 656 slots: 21 splits,
    a combine of two blocks of 16): a split's key and value tiles, and the step's new rows,
    are loaded before the first barrier after them (loaded where they were used, after the
    scores' reductions, the values waited for memory a second time: so they did before
    2026-11-28). The combine's loads come in two runs, each before the first instruction
    that waits for them (a barrier or a warp shuffle: a reduction's): the first block's
    maximums, sums and values with every split's maximum, then, in the loop, the next
    block's (before, every split's maximum came alone, and each block's sums and values
    only after its maximums had been reduced)."""
    compiled = offline_sm90.compile_launch(*offline_sm90.attention_launch(*HEADS[model], 656))
    barriers = compiled.lines(r"bar\.sync")
    tiles = compiled.lines(r"ld\.global\.v\d")  # the query, the cache's tiles, new rows
    assert len(tiles) >= 3 and min(b for b in barriers if b > tiles[0]) > tiles[-1]
    runs = compiled.load_runs(r"ld\.global\.cg", *compiled.last_to_finish())  # the combine
    values = set(compiled.lines(r"ld\.global\.cg\.v\d"))
    assert len(runs) == 2, runs
    assert all(values & set(run) and set(run) - values for run in runs), (runs, values)


@pytest.mark.parametrize("width", [1536, 640], ids=["qwen-1.5b", "gemma-270m"])
def test_residual_and_rope_load_before_they_reduce(width):
    """The chained blocks' residual add (with the next norm and its 8-bit blocks; with
    Gemma's norm of the branch first, and without) and Gemma's RoPE with its heads' norms:
    every global load comes before the first instruction that waits on a reduction (a
    barrier or a warp shuffle). Before 2026-11-28 the residual loaded x's row again after
    the sum's store (a store the compiler keeps later loads of x behind) and its norm's
    weights after the reduction, and the RoPE its norm's weights and its angles: a second
    wait for memory each."""
    from edgellm.backends.torch import kernels

    x, w = torch.zeros((1, width)), torch.zeros(width)
    launches = [offline_sm90._recorded(lambda post=post: kernels.residual(
        x, x, 1e-6, h_norm=w if post else None, out_norm=w, quantize=True), 0)[0]
        for post in (False, True)]
    q, k, angles = torch.zeros((1, 4, 256)), torch.zeros((1, 1, 256)), torch.zeros((1, 128))
    norms = (torch.zeros(256), torch.zeros(256), 1e-6)  # (Gemma's heads of 256)
    launches += offline_sm90._recorded(lambda: kernels.rope_qk(q, k, angles, angles, True,
                                                               norms=norms), 0)
    compiled = offline_sm90.compile_specs([offline_sm90.launch_spec(*la) for la in launches])
    for c in compiled:
        loads = c.lines(r"ld\.global")
        waits = c.lines(r"bar\.sync|shfl\.sync")
        assert loads and waits and max(loads) < min(waits), (c.name, loads, waits)


def test_split_k_combine_loads_every_partial_at_once():
    """The last program of a split mat-vec's row block adds the splits' partial sums with
    one load each unrolled (a power of two of them, those past the last masked off), not
    in a loop that ptxas unrolled by four: the 1.5B's Q6_K down projection in the tile an
    H100 kept splits K 18 ways, which were five waits for memory in turn."""
    (kernel, args, meta), _ = offline_sm90.tuned_matvec_launch("matvec", 7, 1536, 140,
                                                                (16, 8, 4, 16))
    assert meta["SPLIT_K"] and meta["SPLITS"] == 32
    compiled = offline_sm90.compile_launch(kernel, args, meta)
    first, last = compiled.last_to_finish()
    partials = [i for i in compiled.lines(r"ld\.global\.cg") if first < i < last]
    assert len(partials) == meta["SPLITS"]


@pytest.mark.parametrize("rope", [False, True], ids=["", "rope"])
def test_matvec_bias_loads_before_the_loop(rope):
    """Qwen's Q+K mat-vec (1,792 rows of Q4_K with their biases, one token, as PDL mode 2
    launches it; ``rope``: rotating them, NEOX, in its epilogue): no global load after the
    loop over K (its bias, loaded after the sums, was a wait for memory of its own before
    2026-11-28; the angles load with it)."""
    from edgellm.backends.torch import kernels

    planes, xq, xd = offline_sm90._zero_matvec_inputs(1792, 1536, Q.Q4_K, 1)
    bias = torch.zeros(1792)
    angles = (torch.zeros(1, 64), torch.zeros(1, 64), 1792, True) if rope else None
    launch = offline_sm90._recorded(lambda: kernels.qmatvec(xq, xd, planes, bias,
                                                            rope=angles), 2)[0]
    assert launch[2]["HAS_BIAS"] and launch[2]["ROPE"] == (1 if rope else 0)
    compiled = offline_sm90.compile_launch(*launch)
    lines = compiled.ptx.splitlines()
    labels = {line.split(":")[0].strip(): i for i, line in enumerate(lines)
              if line.startswith("$L__BB")}
    back = [i for i, line in enumerate(lines) if (jump := re.search(r"bra\S*\s+(\$L__BB\w+)",
            line)) and labels.get(jump.group(1), i) < i]  # (a loop's branch back)
    assert back
    assert not [i for i in compiled.lines(r"ld\.global") if i > max(back)]


@pytest.mark.parametrize("tokens", [1, 8], ids=["decode", "speculative"])
@pytest.mark.parametrize("rows,cols,qtype", [(17920, 1536, Q.Q4_K), (1536, 8960, Q.Q6_K),
                                             (9728, 896, Q.Q5_0), (896, 4864, Q.Q8_0)],
                         ids=["gate-up-1.5b", "down-1.5b", "gate-up-0.5b", "down-0.5b"])
def test_decode_matvec_keeps_to_registers(rows, cols, qtype, tokens):
    """The models' largest mat-vecs with the default tiles, for one token and for a
    speculative check's 8: nothing spilt."""
    compiled = offline_sm90.compile_launch(*offline_sm90.matvec_launch(rows, cols, qtype,
                                                                       tokens))
    assert compiled.spilt_bytes == 0, compiled.registers


@pytest.mark.parametrize("op,kind,rows,tile", [
    ("matvec_glu", 5, 17920, (16, 8, 4, 4)), ("matvec", 7, 151936, (8, 8, 4, 2)),
    ("matvec", 7, 151936, (16, 8, 4, 4))], ids=["gate-up-1.5b", "output-1.5b", "output-16"])
def test_looping_matvecs_keep_to_registers(op, kind, rows, tile):
    """Looping tiles (fewer programs than row blocks, each looping over blocks: the 1.5B's
    gate+up GLU and output projection, as a GPU's tuner may keep them) as a tuning file's
    tile compiles: the loop is compiled in, nothing spilt, and each block's L2 requests for
    the next block's weights come after the wait for the launch before (PDL 2: those of
    the first block before it)."""
    (kernel, args, meta), programs = offline_sm90.tuned_matvec_launch(op, kind, rows, 24, tile)
    assert meta["LOOP"] and programs == tile[3] * offline_sm90.MULTIPROCESSORS
    looped, apart = offline_sm90.compile_specs([
        offline_sm90.launch_spec(kernel, args, {**meta, "PDL": 2, "launch_pdl": True}),
        offline_sm90.launch_spec(kernel, args, {**meta, "LOOP": False, "PDL": 2,
                                                "launch_pdl": True})])
    print(f"{op} {rows} rows in {tile}: {looped.registers} registers looping, "
          f"{apart.registers} a program a block")
    assert looped.spilt_bytes == 0, looped.registers
    wait = min(looped.lines(r"griddepcontrol\.wait"))
    assert looped.lines(r"prefetch\.global\.L2")[0] < wait < looped.lines(
        r"prefetch\.global\.L2")[-1]


@pytest.mark.parametrize("tokens", [1, 8], ids=["decode", "speculative"])
@pytest.mark.parametrize("a,b,cols,hd", [((Q.Q4_K, 1792), (Q.Q6_K, 256), 1536, 128),
                                         ((Q.Q5_0, 1024), (Q.Q8_0, 128), 896, 64)],
                         ids=["qkv-1.5b", "qkv-0.5b"])
def test_joined_matvec_keeps_to_registers(a, b, cols, hd, tokens):
    """Q+K and V of two block types in one launch (``qmatvec_joined``, with the biases,
    PDL mode 2, the default tile; both types' loops compiled in, one runs), and rotating Q
    and K in it: nothing spilt. (It may take more registers than either alone: at the
    1.5B's default tile 56 against 48 and 48 for one token under triton 3.9, 2026-11-29.)"""
    from edgellm.backends.torch import kernels

    (pa, xq, xd), (pb, _, _) = (offline_sm90._zero_matvec_inputs(rows, cols, q, tokens)
                                for q, rows in (a, b))
    bias = torch.zeros(pa.rows + pb.rows)
    angles = torch.zeros(tokens, hd // 2)
    joined, rotating, alone_a, alone_b = offline_sm90.compile_specs([
        offline_sm90.launch_spec(*offline_sm90._recorded(work, 2)[0]) for work in (
            lambda: kernels.qmatvec_joined(xq, xd, pa, pb, bias),
            lambda: kernels.qmatvec_joined(xq, xd, pa, pb, bias,
                                           rope=(angles, angles, pa.rows, True)),
            lambda: kernels.qmatvec(xq, xd, pa, bias[:pa.rows]),
            lambda: kernels.qmatvec(xq, xd, pb, bias[pa.rows:]))])
    print(f"joined {joined.registers} registers ({rotating.registers} rotating Q and K), "
          f"alone {alone_a.registers} and {alone_b.registers}")
    assert joined.spilt_bytes == 0 and rotating.spilt_bytes == 0, joined.registers


@pytest.mark.parametrize("model", list(HEADS))
def test_prompt_attention_has_tiles_that_keep_to_registers(model):
    """The flash prompt attention's tiles a GPU times, over a 512-token prompt at each
    model's heads: the 1.5B's and 0.5B's spill nothing in any of them, and Gemma's (heads of
    256, where four of the five spill 296-456 bytes a thread) in the wide-head tiles."""
    from edgellm.backends.torch import kernels

    hd = HEADS[model][2]
    tiles = kernels.WIDE_HEAD_FLASH_TILES if hd >= 256 else kernels.flash_tiles(hd)
    specs = [offline_sm90.launch_spec(*offline_sm90.flash_launch(*HEADS[model], 512, tile))
             for tile in tiles]
    spilt = [c.spilt_bytes for c in offline_sm90.compile_specs(specs)]
    assert spilt == [0] * len(tiles), dict(zip(tiles, spilt, strict=True))


def test_dependent_launches_wait_before_they_read(tmp_path, monkeypatch):
    """Every triton kernel, compiled as a programmatic dependent launch with the weights
    prefetched (EDGELLM_PDL=2) from its first launch in a tiny model's prompt and decode
    step (launch fusions on, V in another block type, joined to Q and K's launch; then
    off, the KV write its own launch, with the fused dequantize-GEMM; and a prompt's flash
    attention): the PTX waits for the launch before
    (``griddepcontrol.wait``) before any load, store or atomic, only L2 prefetches come
    before the wait, and the next launch is let in after it. As plain launches (0), in the
    tiles a GPU launches (the interpreter's take more rows a program): no grid dependency
    control at all."""
    from edgellm.backends.torch import kernels
    from tests.test_torch_models import _graph_backend, _tiny_net

    def prompt_and_step():
        net.forward(np.arange(1, 17), net.make_cache(64))
        net.forward(np.array([5]), cache)

    launches, as_gpu = {}, {}
    for fused in (True, False):
        monkeypatch.setenv("EDGELLM_FUSE_LAUNCHES", str(int(fused)))
        monkeypatch.setenv("EDGELLM_FUSED_GEMM", str(int(not fused)))
        monkeypatch.setenv("EDGELLM_UNFUSE", "" if fused else "kv_write")
        backend = _graph_backend(triton=True)  # (no GPU: the graphs' steps run eagerly)
        net = _tiny_net(tmp_path, Q.Q4_0, backend, small=True,
                        v_qtype=Q.Q8_0 if fused else None)
        cache = net.make_cache(64)
        net.forward(np.arange(1, 9), cache)
        for kernel, args, meta in offline_sm90._recorded(prompt_and_step, pdl=2, run=True):
            launches.setdefault(kernel.__name__, (kernel, args, meta))
        for kernel, args, meta in offline_sm90._recorded(prompt_and_step, pdl=0):  # (not run)
            as_gpu.setdefault(kernel.__name__, (kernel, args, meta))
    for pdl, kept in ((2, launches), (0, as_gpu)):
        kernel, args, meta = offline_sm90.flash_launch(4, 2, 32, 16, kernels.FLASH_TILES[0],
                                                       pdl=pdl)
        kept.setdefault(kernel.__name__, (kernel, args, meta))
    assert set(launches) == set(as_gpu) == {n for n in dir(kernels) if n.endswith("_kernel")}
    assert as_gpu["_round_kernel"][2]["ROWS"] == 1 < launches["_round_kernel"][2]["ROWS"]
    specs = [offline_sm90.launch_spec(*launch) for launch in launches.values()]
    plain = [offline_sm90.launch_spec(*launch) for launch in as_gpu.values()]
    compiled = offline_sm90.compile_specs(specs + plain)
    for c in compiled[:len(specs)]:
        wait = c.lines(r"griddepcontrol\.wait")
        assert len(wait) == 1, c.name
        touches = c.lines(r"^\s*(@%p\d+\s+)?(ld|st|atom|red)\.global")
        assert touches and min(touches) > wait[0], c.name
        assert all(i < wait[0] for i in c.lines(r"prefetch\.global"))
        assert min(c.lines(r"griddepcontrol\.launch_dependents")) > wait[0], c.name
    for c in compiled[len(specs):]:
        assert not c.lines("griddepcontrol"), c.name


def test_another_triton_compiles_in_a_child(tmp_path, monkeypatch):
    """EDGELLM_SM90_TRITON=DIR: the compiles run in a child process that imports triton from
    DIR first (``benchmarks/sm90_preflight.sh``'s way to the lent GPUs' older triton); here
    DIR holds a link to this machine's own, and the kernel says which compiled it."""
    import triton

    (tmp_path / "triton").symlink_to(os.path.dirname(triton.__file__))
    monkeypatch.setenv(offline_sm90.OTHER_TRITON, str(tmp_path))
    compiled = offline_sm90.compile_launch(*offline_sm90.matvec_launch(256, 256, Q.Q8_0))
    assert compiled.compiler == f"triton {triton.__version__} in {tmp_path / 'triton'}"
    assert compiled.registers > 0 and compiled.spilt_bytes == 0


def test_programs_per_multiprocessor():
    """An sm_90 multiprocessor's share: 64K registers given out a warp at a time in units
    of 256, at most 64 warps and 32 programs, 228 KB of shared memory with 1 KB a program
    beside its own."""
    fit = offline_sm90.programs_per_multiprocessor
    assert fit(121, 4) == 4  # 128 a thread: 16,384 a program
    assert fit(128, 4) == 4 and fit(129, 4) == 3
    assert fit(48, 4) == 10  # 6,144 a program: 10 of them, not the 16 warps allow
    assert fit(32, 1) == 32  # the programs' cap, before registers' (64) or warps' (64)
    assert fit(16, 8) == 8  # the warps' cap
    assert fit(40, 4, shared_bytes=100 * 1024) == 2  # shared memory's


def test_occupancy_report_reads_a_tuning_files_matvec_tiles(tmp_path):
    """``python -m tests.offline_sm90 --tuning FILE``: a line per mat-vec a tuning file keeps
    a tile for (others skipped), with the grid the launcher makes of that tile on a
    132-multiprocessor GPU: the 1.5B's gate+up in (8, 16, 4) is 8,960 / 8 programs; its
    Q6_K down in (16, 8, 4) aiming at 16 programs a multiprocessor splits K 18 ways (140
    chunks, 8 a step: 96 x 18 programs). A tile kept for the plain loop (a key ending
    ":unpipelined") is compiled with that loop."""
    import json

    tuning = tmp_path / "gpu.json"
    tuning.write_text(json.dumps({"version": "v", "choices": {
        "matvec_glu:5:17920:24": [8, 16, 4, 0], "matvec:7:1536:140": [16, 8, 4, 16],
        "matvec:7:1536:140:unpipelined": [16, 8, 4, 16], "gemm:0:128:896:512": [128, 64, 2, 8]}}))
    lines = offline_sm90.occupancy_report(str(tuning))
    assert [line.split()[0] for line in lines] == [
        "matvec:7:1536:140", "matvec:7:1536:140:unpipelined", "matvec_glu:5:17920:24"]
    for mode in (0, 1):
        (_, _, meta), _ = offline_sm90.tuned_matvec_launch("matvec", 7, 1536, 140,
                                                            (16, 8, 4, 16), mode)
        assert meta["PIPELINE"] == mode
    for line, programs in zip(lines, (1728, 1728, 1120), strict=True):
        fit = int(line.split(" a multiprocessor")[0].split()[-1])
        assert f" {programs} programs: {programs / (fit * 132):.2f} waves" in line, line
        assert ", 0 bytes spilt" in line
