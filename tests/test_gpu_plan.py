"""The parts of the GPU path that run without a GPU: the gather kernels' launch plan (compiled
with the host compiler), the keeper that holds leases until a GPU read is done, and the step
selection and per-test timeout of ``bench/gpu/run.sh``."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest

from echopipe._inflight import InFlight

REPO = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------------------------------------
# Gather plan (csrc/cuda/gather_plan.h): chunks of the by-value pointer tables
# ---------------------------------------------------------------------------------------------

_PLAN_CHECK = textwrap.dedent(
    r"""
    #include <cstdio>
    #include <vector>
    #include "cuda/gather_plan.h"
    using namespace echopipe::cuda;

    int main() {
      // Ragged sizes, 11 samples in chunks of 4: 4 + 4 + 3, offsets running across chunks.
      std::vector<int64_t> sizes = {5, 0, 17, 64, 3, 100, 1, 2, 33, 9, 16};
      std::vector<const void*> src;
      for (size_t i = 0; i < sizes.size(); ++i)
        src.push_back(reinterpret_cast<void*>(0x1000 * (i + 1)));
      int64_t total = for_each_bytes_chunk<4>(src.data(), sizes.data(), (int64_t)sizes.size(),
          [&](const BytesTable<4>& t, int64_t max_size) {
            std::printf("B %d %lld", t.count, (long long)max_size);
            for (int i = 0; i < t.count; ++i)
              std::printf(" %llx:%lld", (unsigned long long)(uintptr_t)t.src[i],
                          (long long)t.offset[i]);
            std::printf(" end:%lld\n", (long long)t.offset[t.count]);
          });
      std::printf("total %lld\n", (long long)total);
      for_each_image_chunk<3>(src.data(), 7, [&](const ImageTable<3>& t) {
        std::printf("I %d %lld", t.count, (long long)t.first);
        for (int i = 0; i < t.count; ++i)
          std::printf(" %llx", (unsigned long long)(uintptr_t)t.src[i]);
        std::printf("\n");
      });
      std::printf("entries %d %d param %zu\n", kBytesEntries, kImageEntries, kParamBytes);
      std::printf("bps %u %u %u\n", blocks_per_sample(0, 16384), blocks_per_sample(150528, 16384),
                  blocks_per_sample(int64_t(1) << 30, 16384));
      return 0;
    }
    """
)


def _run_plan(tmp_path: Path, *defines: str) -> list[str]:
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler to build the plan check")
    src = tmp_path / "plan.cc"
    src.write_text(_PLAN_CHECK)
    exe = tmp_path / "plan"
    cmd = [cxx, "-std=c++20", "-O1", f"-I{REPO / 'csrc'}", *defines, str(src), "-o", str(exe)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split("\n")


def test_bytes_chunks_cover_the_batch_in_order_with_running_offsets(tmp_path: Path) -> None:
    lines = _run_plan(tmp_path)
    assert lines[:4] == [
        "B 4 64 1000:0 2000:5 3000:5 4000:22 end:86",
        "B 4 100 5000:86 6000:89 7000:189 8000:190 end:192",
        "B 3 33 9000:192 a000:225 b000:234 end:250",
        "total 250",
    ]
    assert lines[4:7] == [
        "I 3 0 1000 2000 3000",
        "I 3 3 4000 5000 6000",
        "I 1 6 7000",
    ]
    # One block for an empty or small sample, 10 for a 224 px RGB image, capped at 64.
    assert lines[8] == "bps 1 10 64"


@pytest.mark.parametrize(
    ("defines", "param_bytes"), [((), 4096), (("-DCUDART_VERSION=12010",), 32764)]
)
def test_tables_fit_one_kernel_parameter(
    tmp_path: Path, defines: tuple[str, ...], param_bytes: int
) -> None:
    """Toolkits from 12.1 pass up to 32764 bytes of parameters (older ones 4096): the tables
    are sized from that (the header's static_asserts check the struct sizes at compile time)."""
    (line,) = [ln for ln in _run_plan(tmp_path, *defines) if ln.startswith("entries")]
    _, bytes_entries, image_entries, _, param = line.split()
    assert int(param) == param_bytes
    # 16 bytes per ragged sample (pointer + offset), 8 per image (pointer), 256 bytes reserved.
    assert int(bytes_entries) == (param_bytes - 256 - 16) // 16
    assert int(image_entries) == (param_bytes - 256 - 16) // 8
    assert int(bytes_entries) >= 128  # even a 4 KB table gathers a batch of 256 in two launches


# ---------------------------------------------------------------------------------------------
# Leases held until the GPU read is done (echopipe._inflight)
# ---------------------------------------------------------------------------------------------


class _Payload:
    """Stands for the leases of one gather: only its lifetime matters."""


def _alive(ref: weakref.ref) -> bool:
    gc.collect()
    return ref() is not None


def test_payload_is_kept_until_its_wait_returns_then_dropped() -> None:
    keeper = InFlight("test-keeper")
    fired = [threading.Event() for _ in range(3)]
    refs = []
    for ev in fired:
        p = _Payload()
        refs.append(weakref.ref(p))
        keeper.hold(ev.wait, p)
        del p
    time.sleep(0.05)
    assert all(_alive(r) for r in refs) and keeper.pending() == 3
    fired[0].set()
    assert _wait_for(lambda: not _alive(refs[0]))
    assert _alive(refs[1]) and _alive(refs[2]) and keeper.pending() == 2
    # FIFO: the third fires first, but is dropped only after the second's wait returned.
    fired[2].set()
    time.sleep(0.05)
    assert _alive(refs[2])
    fired[1].set()
    assert keeper.drain(timeout=5)
    assert not any(_alive(r) for r in refs) and keeper.pending() == 0
    keeper.close()


def test_a_failing_wait_still_releases_and_close_refuses_new_holds() -> None:
    keeper = InFlight("test-keeper")

    def broken() -> None:
        raise RuntimeError("context is gone")

    p = _Payload()
    ref = weakref.ref(p)
    keeper.hold(broken, p)
    del p
    assert keeper.drain(timeout=5)
    assert not _alive(ref)
    keeper.close(timeout=1)
    with pytest.raises(RuntimeError, match="closed"):
        keeper.hold(lambda: None, _Payload())


def test_close_waits_boundedly_for_a_wait_that_never_returns() -> None:
    keeper = InFlight("test-keeper")
    never = threading.Event()
    keeper.hold(never.wait, _Payload())
    t0 = time.monotonic()
    keeper.close(timeout=0.3)
    assert 0.25 < time.monotonic() - t0 < 3
    never.set()  # let the daemon thread finish


def _wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


# ---------------------------------------------------------------------------------------------
# bench/gpu/run.sh: which steps a pass runs, and the per-test timeout of its pytest steps
# ---------------------------------------------------------------------------------------------

RUN_SH = REPO / "bench" / "gpu" / "run.sh"
PASS1 = ["environment", "build", "test_gpu", "bench_gather_bw", "train_mixed"]
PASS2 = ["test_echo_pinned", "train_mixed_amp", "bench_pipeline", "bench_dali_gpu"]


def _plan(steps: str | None, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("ECHOPIPE_GPU_")}
    if steps is not None:
        full["ECHOPIPE_GPU_STEPS"] = steps
    full.update(env)
    return subprocess.run(
        ["bash", str(RUN_SH), "--plan"], env=full, capture_output=True, text=True, timeout=30
    )


@pytest.mark.parametrize(
    ("steps", "expected", "budget"),
    [
        (None, PASS1, 210),
        ("pass1", PASS1, 210),
        ("pass2", ["environment", "build", *PASS2], 210),
        ("all", PASS1 + PASS2, 440),
        ("pass2,pass1", PASS1 + PASS2, 440),  # run order, not the order named
        ("build,test_gpu", ["environment", "build", "test_gpu"], 210),
        # A step that needs the installed package brings the build (skipped there if current).
        (" bench_dali_gpu ", ["environment", "build", "bench_dali_gpu"], 210),
        ("environment", ["environment"], 210),
        ("test_gpu,test_gpu", ["environment", "build", "test_gpu"], 210),
    ],
)
def test_step_filter_selects_steps_in_run_order(
    steps: str | None, expected: list[str], budget: int
) -> None:
    got = _plan(steps)
    assert got.returncode == 0, got.stderr
    assert got.stdout.splitlines() == [f"steps: {' '.join(expected)}", f"budget: {budget}s"]


def test_step_filter_budget_can_be_set() -> None:
    got = _plan("test_gpu", ECHOPIPE_GPU_BUDGET_S="100")
    assert got.returncode == 0 and got.stdout.splitlines()[1] == "budget: 100s"


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        ("test_gpu,tset_echo", "unknown step 'tset_echo'"),
        ("pass3", "unknown step 'pass3'"),
        (",,", "names no step"),
    ],
)
def test_step_filter_rejects_a_bad_name_in_one_line(steps: str, message: str) -> None:
    got = _plan(steps)
    assert got.returncode == 2 and got.stdout == ""
    assert message in got.stderr and len(got.stderr.strip().splitlines()) == 1


_SLOW_TESTS = textwrap.dedent(
    """
    import signal
    import time

    def test_sleeps_past_the_timeout():
        time.sleep(30)

    def test_cannot_be_interrupted():
        # As if stuck in C code: the soft timeout's signal never reaches Python code.
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
        time.sleep(30)

    def test_after_the_hang():
        assert 1 + 1 == 2
    """
)


def test_a_hung_test_costs_only_itself(tmp_path: Path) -> None:
    (tmp_path / "test_slow.py").write_text(_SLOW_TESTS)
    work = tmp_path / "work"
    env = dict(
        os.environ,
        PY=sys.executable,
        ECHOPIPE_TEST_TIMEOUT_S="1",
        ECHOPIPE_TEST_HARD_GRACE_S="1",
    )
    env.pop("PYTEST_ADDOPTS", None)
    t0 = time.monotonic()
    got = subprocess.run(
        ["bash", str(REPO / "bench/gpu/pytest_steps.sh"), "demo", str(work), "test_slow.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert got.returncode == 1, got.stdout + got.stderr
    assert time.monotonic() - t0 < 60
    progress = (work / "demo.progress.tsv").read_text().splitlines()
    # The soft timeout failed the first test; the second ended the process; the third ran.
    assert "call\tfailed\ttest_slow.py::test_sleeps_past_the_timeout" in "\n".join(progress)
    assert "start\ttest_slow.py::test_cannot_be_interrupted" in progress
    assert not any("\ttest_slow.py::test_cannot_be_interrupted\t" in ln for ln in progress)
    assert any(ln.startswith("call\tpassed\ttest_slow.py::test_after_the_hang") for ln in progress)
    # The log shows where the uninterruptible test was stuck.
    assert "ended the process" in got.stdout and "in test_cannot_be_interrupted" in got.stdout
    rest = (work / "demo.rest.xml").read_text()
    assert 'name="test_after_the_hang"' in rest and 'failures="0"' in rest


def test_a_forked_child_gets_a_keeper_of_its_own() -> None:
    """The parent's keeper thread does not exist in a forked child: holds there still end."""
    import multiprocessing as mp

    from echopipe import _inflight

    never = threading.Event()
    _inflight.hold_until(lambda: never.wait(5), _Payload())  # busy in the parent at fork time
    ctx = mp.get_context("fork")
    child = ctx.Process(target=_hold_and_drain_in_child)
    child.start()
    child.join(30)
    never.set()
    assert child.exitcode == 0


def _hold_and_drain_in_child() -> None:
    from echopipe import _inflight

    _inflight.hold_until(lambda: None, _Payload())
    os._exit(0 if _inflight._KEEPER.drain(timeout=5) else 3)


# ---------------------------------------------------------------------------------------------
# The GPU scripts' behaviour without a GPU
# ---------------------------------------------------------------------------------------------


def test_packed_packages_that_the_interpreter_has_too_are_named(tmp_path: Path) -> None:
    """env_info lists what .gpu/site would shadow: here a packed numpy (the interpreter has
    one) and a package only the packed folder has."""
    site = tmp_path / ".gpu" / "site"
    for name in ("numpy", "zz_only_packed"):
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text("")
    (site / "nvidia").mkdir()
    (site / "numpy-9.9.dist-info").mkdir()
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2]);"
        "import env_info; print(env_info.shadowed_packages())"
    )
    got = subprocess.run(
        [sys.executable, "-c", code, str(REPO / "bench" / "gpu"), str(site)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "['numpy']"


def test_cuda_only_pipeline_bench_says_in_one_line_that_it_needs_a_device(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: bench/gpu/run.sh runs the real thing")
    got = subprocess.run(
        [sys.executable, str(REPO / "bench" / "pipeline.py"), "--cuda-only",
         "--results-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert got.returncode == 1
    assert got.stderr.strip() == "--cuda-only needs a CUDA device; torch sees none"
    assert not any(tmp_path.iterdir())


def test_the_script_runs_its_steps_in_the_order_the_plan_prints() -> None:
    import re

    ran = re.findall(r"^step (\w+) ", RUN_SH.read_text(), re.MULTILINE)
    assert ran == PASS1 + PASS2
