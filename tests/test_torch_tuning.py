"""The tuner that times kernel variants at their first use (``backends/torch/tuning.py``):
which candidate it keeps, what it writes and reads back, and what it does when timing is
not possible. A fake timer stands in for the GPU's (each call returns the next of a list)."""

from __future__ import annotations

import json
import logging

import pytest

from edgellm.backends.torch.tuning import Tuner, device_file


def fake_timer(times):
    """A timer that runs the launch and returns the next time of ``times``, in order."""
    it = iter(times)

    def timer(run):
        run()
        return next(it)

    return timer


def idle():
    return False


class PickingTuner(Tuner):
    """A tuner, in memory only, that keeps candidate ``index`` of every key (its timer makes
    that one the fastest); ``timed``: what the last key it timed timed, in order.
    ``launch_all=False`` launches only the kept candidate, once (a model test in the
    interpreter: the kernel tests run and time every candidate)."""

    def __init__(self, index: int, launch_all: bool = True):
        self.index, self.launch_all, self.timed = index, launch_all, []
        super().__init__(None, "test", self._time, idle)

    def _fastest(self, name, candidates, run):
        self.timed = []
        if not self.launch_all:
            run(candidates[self.index])
            return candidates[self.index]
        return super()._fastest(name, candidates, run)

    def _time(self, run) -> float:
        run()
        self.timed.append(len(self.timed))
        return 1.0 if self.timed[-1] == self.index else 2.0


def test_keeps_the_fastest_and_remembers_it(tmp_path):
    path = tmp_path / "gpu.json"
    launched = []
    tuner = Tuner(path, "card A", fake_timer([5.0, 2.0, 3.0]), idle)
    assert tuner.choose(("matvec", 5, 1792), ["a", (2, 8), (4, 16)], launched.append,
                        "default") == (2, 8)
    assert launched == ["a", "a", (2, 8), (2, 8), (4, 16), (4, 16)]  # a warm-up, then timed
    launched.clear()
    assert tuner.choose(("matvec", 5, 1792), ["a", (2, 8), (4, 16)], launched.append,
                        "default") == (2, 8)
    assert launched == []  # remembered: nothing timed again
    saved = json.loads(path.read_text())
    assert saved == {"version": "card A", "choices": {"matvec:5:1792": [2, 8]}}

    again = Tuner(path, "card A", fake_timer([]), idle)  # a later process: read, not timed
    assert again.choose(("matvec", 5, 1792), ["a"], launched.append, "default") == (2, 8)
    assert launched == []
    other = Tuner(path, "card B", fake_timer([1.0]), idle)  # another card: timed anew
    assert other.choose(("matvec", 5, 1792), ["a"], launched.append, "default") == "a"


def test_a_failing_candidate_is_skipped(tmp_path, caplog):
    def run(c):
        if c == "too big":
            raise RuntimeError("out of resources: shared memory")

    tuner = Tuner(tmp_path / "t.json", "v", fake_timer([4.0, 6.0]), idle)
    assert tuner.choose(("gemm", 1), ["too big", "x", "y"], run, "default") == "x"
    with caplog.at_level(logging.WARNING):
        assert tuner.choose(("gemm", 2), ["too big"], run, "default") == "default"
    assert "every candidate failed" in caplog.text
    assert tuner.choose(("gemm", 2), ["too big"], run, "default") == "default"
    assert "gemm:2" not in json.loads((tmp_path / "t.json").read_text())["choices"]


def test_no_timing_while_a_graph_is_captured(tmp_path):
    capturing = [True]
    launched = []
    tuner = Tuner(tmp_path / "t.json", "v", fake_timer([3.0, 1.0]), lambda: capturing[0])
    assert tuner.choose(("k",), ["a", "b"], launched.append, "default") == "default"
    assert launched == [] and not (tmp_path / "t.json").exists()
    capturing[0] = False
    assert tuner.choose(("k",), ["a", "b"], launched.append, "default") == "b"


def test_a_damaged_file_is_timed_again_and_replaced(tmp_path, caplog):
    path = tmp_path / "t.json"
    path.write_text('{"version": "v", "choices": {"k": [2, ')  # cut off mid-write
    with caplog.at_level(logging.WARNING):
        tuner = Tuner(path, "v", fake_timer([2.0, 1.0]), idle)
    assert "ignoring the tuning file" in caplog.text
    assert tuner.choose(("k",), ["a", "b"], lambda c: None, "default") == "b"
    assert json.loads(path.read_text())["choices"] == {"k": "b"}


def test_processes_sharing_a_file_keep_each_others_choices(tmp_path):
    path = tmp_path / "t.json"
    first = Tuner(path, "v", fake_timer([1.0]), idle)
    second = Tuner(path, "v", fake_timer([1.0]), idle)  # read before the first wrote
    first.choose(("one",), ["a"], lambda c: None, "default")
    second.choose(("two",), ["b"], lambda c: None, "default")
    assert json.loads(path.read_text())["choices"] == {"one": "a", "two": "b"}


def test_an_unwritable_home_keeps_choices_for_the_process(tmp_path, caplog):
    blocker = tmp_path / "tuning"
    blocker.write_text("a file where the folder should be")
    tuner = Tuner(blocker / "gpu.json", "v", fake_timer([2.0, 1.0]), idle)
    with caplog.at_level(logging.WARNING):
        assert tuner.choose(("k",), ["a", "b"], lambda c: None, "default") == "b"
    assert "could not save tuning choices" in caplog.text
    assert tuner.choose(("k",), ["a", "b"], lambda c: None, "default") == "b"


@pytest.mark.parametrize("name,file", [("NVIDIA H100 80GB HBM3", "nvidia-h100-80gb-hbm3.json"),
                                       ("../../etc", "etc.json"), ("", "gpu.json")])
def test_device_file_names(tmp_path, name, file):
    assert device_file(tmp_path, name) == tmp_path / "tuning" / file


def test_timing_keeps_its_flush_buffer_out_of_the_peak(monkeypatch):
    """cold_microseconds (the CUDA calls stubbed): do_bench's median in microseconds; the
    peak from before timing is kept, the timing's own (its 256 MiB L2 flush) is reset
    away, and its cached blocks are released."""
    torch = pytest.importorskip("torch")
    triton_testing = pytest.importorskip("triton.testing")
    from edgellm.backends.torch import tuning

    state = {"peak": 700, "resets": 0, "emptied": 0}

    def do_bench(run, warmup, rep, return_mode):
        assert return_mode == "median"
        run()
        state["peak"] = 700 + (256 << 20)  # the flush buffer
        return 0.0125  # ms

    def reset(device):
        state["peak"], state["resets"] = 300, state["resets"] + 1

    monkeypatch.setattr(tuning, "_peaks_before", {})
    monkeypatch.setattr(triton_testing, "do_bench", do_bench)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "empty_cache",
                        lambda: state.__setitem__("emptied", state["emptied"] + 1))
    ran = []
    assert tuning.cold_microseconds(lambda: ran.append(1)) == pytest.approx(12.5)
    assert ran == [1] and state["resets"] == 1 and state["emptied"] == 1
    assert tuning.peak_memory("cuda") == 700  # the model's peak, not the flush's
    state["peak"] = 900  # the model goes higher later: that counts
    assert tuning.peak_memory("cuda:0") == 900
