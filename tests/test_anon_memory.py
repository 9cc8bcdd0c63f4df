"""Large long-lived buffers (KV caches, repacked weights) live in mappings of their own, so
freeing them hands the memory back to the OS even after malloc has raised its mmap threshold
(the 0.5B's load/free cycles kept ~370 MB of repacked weights resident without this)."""

from __future__ import annotations

import gc
import mmap

import numpy as np
import pytest

from edgellm.backends import anon, available_backends, get_backend


def rss_kb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE // 1024


def _free_in_heap_first() -> None:
    """Raise glibc's mmap threshold the way a model load does: free one 30 MB block."""
    block = np.ones(30 << 20, dtype=np.uint8)
    del block


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_kv_storage_is_handed_back_when_freed(backend):
    if backend not in available_backends():
        pytest.skip(f"no {backend} backend")
    b = get_backend(backend)
    _free_in_heap_first()
    before = rss_kb()
    # 12 x 8 MiB: under the raised threshold, so np.zeros would take them from the heap
    arrays = [b.zeros((1024, 2, 1024), "float32") for _ in range(12)]
    for a in arrays:
        a[...] = 1.0  # touch every page
        assert _mapping_of(a) is not None and a.shape == (1024, 2, 1024)
    assert rss_kb() - before > 80 * 1024  # 96 MiB touched
    del arrays, a
    gc.collect()
    assert rss_kb() - before < 8 * 1024


def _mapping_of(a: np.ndarray) -> mmap.mmap | None:
    """The mmap under an array's chain of bases, if any."""
    base = a
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    base = base.obj if isinstance(base, memoryview) else base
    return base if isinstance(base, mmap.mmap) else None


def test_small_arrays_stay_ordinary_and_large_ones_are_mapped():
    small = anon.zeros((3, 1 << 18), np.int8)  # 768 KiB
    large = anon.zeros((5, 1 << 18), np.float32)  # 5 MiB
    assert _mapping_of(small) is None and _mapping_of(large) is not None
    assert not small.any() and not large.any()
    large[4, -1] = 7.0
    assert large.dtype == np.float32 and large.sum() == 7.0


def test_pinned_mmap_threshold_hands_back_plain_numpy_blocks():
    """After edgellm pins glibc's mmap threshold (at load), freeing a large block no longer
    moves later blocks of its size into the heap: plain numpy arrays go back when freed."""
    from edgellm.api import MMAP_THRESHOLD, _libc_function, pin_malloc_settings

    if _libc_function("mallopt") is None:
        pytest.skip("not glibc")
    pin_malloc_settings()
    _free_in_heap_first()
    before = rss_kb()
    # blocks just over the pinned threshold (96 MiB in all), under the 30 MB the free above
    # would have raised glibc's own threshold to
    size = MMAP_THRESHOLD + (4 << 20)
    arrays = [np.ones(size, np.uint8) for _ in range(-(-(96 << 20) // size))]
    later = np.ones(1000, np.uint8)  # a small block allocated after them, still alive at the end
    assert rss_kb() - before > 48 * 1024  # most of the 96 MiB (some may reuse free pages)
    del arrays
    gc.collect()
    assert rss_kb() - before < 8 * 1024
    assert later.sum() == 1000


ARENA_PROBE = """
import ctypes, sys, threading
import numpy as np
if sys.argv[2] == "pinned":
    from edgellm.api import pin_malloc_settings
    pin_malloc_settings()
together = threading.Barrier(8)
def work():
    blocks = [np.empty(1000 + i) for i in range(40)]  # 8 KB blocks: malloc's own
    together.wait()  # every thread alive and allocating at once, as a server's are
    for _ in range(20):
        blocks = [np.empty(1000 + i) for i in range(40)]
    del blocks
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
out = libc.fopen(sys.argv[1].encode(), b"w")
libc.malloc_info(0, ctypes.c_void_p(out))
libc.fclose(ctypes.c_void_p(out))
"""


def test_pinned_malloc_keeps_to_a_few_arenas(tmp_path):
    """Threads that allocate (the server's event loop, engine and kernel pool) share ARENA_MAX
    malloc arenas once edgellm has pinned its malloc settings; glibc's default gives each new
    thread an arena of its own (up to 8 per core), each keeping its own free pages."""
    import subprocess
    import sys

    from edgellm.api import ARENA_MAX, _libc_function

    if _libc_function("mallopt") is None or _libc_function("malloc_info") is None:
        pytest.skip("not glibc")
    counts = {}
    for mode in ("default", "pinned"):
        report = tmp_path / f"{mode}.xml"
        subprocess.run([sys.executable, "-c", ARENA_PROBE, str(report), mode], check=True,
                       timeout=120)
        counts[mode] = report.read_text().count("<heap nr=")
    assert counts["pinned"] <= ARENA_MAX
    assert counts["default"] > ARENA_MAX  # the probe does make glibc spread its threads


def test_freeing_drops_the_attribute_names_the_type_cache_holds():
    """CPython's type cache keeps a reference to each attribute name looked up on a type; a
    name built during a model's life would outlive it and pin a 1 MiB pymalloc arena."""
    import sys

    from edgellm.api import release_interpreter_caches

    class Weights:
        pass

    name = "".join(["attribute_built_", "at_run_time"])  # a new str, not an interned one
    before = sys.getrefcount(name)
    getattr(Weights, name, None)
    if sys.getrefcount(name) == before:
        pytest.skip("this Python's type cache keeps no reference to the name")
    release_interpreter_caches()
    assert sys.getrefcount(name) == before


def _rss_file_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))


def test_embedding_lookups_leave_no_file_pages_resident(model_path):
    """The 0.5B's token table is read from the file (its output matrix is separate and
    packed): a lookup preads its rows and maps no page, so a server's resident memory does
    not grow with every new token id (read through the mapping and kept: +90 MB for 21k ids
    across the table; the kernel maps a whole 2 MB folio per read)."""
    if "cpu" not in available_backends():
        pytest.skip("no CPU backend")
    import edgellm

    with edgellm.load(model_path("qwen2.5-coder-0.5b-instruct"), backend="cpu") as model:
        net = model.net
        if net.tok_embd is net.output or getattr(net.tok_embd, "packed", None) is not None:
            pytest.skip("this table is packed, not read from the file")
        ids = np.arange(0, net.tok_embd.rows, 7)
        want = net.backend.embed(net.tok_embd, ids[:50])
        before = _rss_file_kb()
        for chunk in np.array_split(ids, 40):
            net.backend.embed(net.tok_embd, chunk)
        grown = _rss_file_kb() - before
        again = net.backend.embed(net.tok_embd, ids[:50])  # pages come back from the cache
    assert grown < 8 * 1024, f"RssFile grew by {grown} kB"
    np.testing.assert_array_equal(again, want)


def test_file_rows_read_the_mapped_table_or_decline(tmp_path):
    """Rows preads from the file equal the mapped rows; a file that no longer holds what was
    mapped is declined (None: lookups go through the mapping), one cut short after opening
    gives an OSError that says so, and an id outside the table an IndexError."""
    import mmap

    from edgellm.backends.cpu.file_rows import FileRows

    path = tmp_path / "table.bin"
    data = np.random.default_rng(0).integers(0, 256, (64, 40), dtype=np.uint8)
    path.write_bytes(b"header--" + data.tobytes())
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    table = np.frombuffer(mapped, dtype=np.uint8, offset=8).reshape(64, 40)
    rows = FileRows.open(path, 8, table)
    assert rows is not None
    ids = np.array([5, 0, 63, 5])
    np.testing.assert_array_equal(rows.read(ids), data[ids])
    with pytest.raises(IndexError, match="out of range"):
        rows.read(np.array([64]))
    with pytest.raises(IndexError, match="out of range"):
        rows.read(np.array([-1]))
    other = tmp_path / "other.bin"
    other.write_bytes(b"header--" + (255 - data).tobytes())
    assert FileRows.open(other, 8, table) is None
    with open(path, "r+b") as f:
        f.truncate(8 + 40 * 10)
    with pytest.raises(OSError, match="cut short"):
        rows.read(np.array([20]))
    del table
    mapped.close()
