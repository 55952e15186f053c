"""The parts of the GPU path that run without a GPU: the gather kernels' launch plan (compiled
with the host compiler), the keeper that holds leases until a GPU read is done, and the step
selection and per-test timeout of ``bench/gpu/run.sh``."""

from __future__ import annotations

import gc
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from echopipe.echo.inflight import InFlight

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


def _run_plan(tmp_path: Path, *defines: str, program: str = _PLAN_CHECK) -> list[str]:
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler to build the plan check")
    src = tmp_path / "plan.cc"
    src.write_text(program)
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


# The GPU echo source's batch: one scatter table per chunk (each range with its own destination),
# the copy mode from ECHOPIPE_GPU_SOURCE_COPY, and the fallback when a source is host-only.
_SCATTER_CHECK = textwrap.dedent(
    r"""
    #include <cstdio>
    #include <stdexcept>
    #include <vector>
    #include "cuda/copy_mode.h"
    #include "cuda/gather_plan.h"
    using namespace echopipe::cuda;

    static void* p(int k) { return reinterpret_cast<void*>(uintptr_t(0x100) * k); }

    int main() {
      // Two fields of 3 samples plus the info rows, as the source plans them; the empty field
      // of sample 1 is left out.
      CopyPlan plan;
      plan.add(p(1), p(91), p(11), 150528);
      plan.add(p(2), p(92), p(12), 0);
      plan.add(p(3), p(93), p(13), 150528);
      plan.add(p(4), p(94), p(14), 4);
      plan.add(p(5), p(95), p(15), 72);
      std::printf("plan %lld %d %s\n", (long long)plan.count(), plan.device_readable,
                  copy_mode_name(plan.effective(CopyMode::kGather)));
      int64_t total = for_each_scatter_chunk<3>(plan.src.data(), plan.dst.data(),
          plan.size.data(), plan.count(), [&](const ScatterTable<3>& t, int64_t max_size) {
            std::printf("S %d %lld", t.count, (long long)max_size);
            for (int i = 0; i < t.count; ++i)
              std::printf(" %llx>%llx:%lld", (unsigned long long)(uintptr_t)t.src[i],
                          (unsigned long long)(uintptr_t)t.dst[i], (long long)t.size[i]);
            std::printf("\n");
          });
      std::printf("total %lld\n", (long long)total);
      // A pageable arena: no device address, so the batch takes the per-copy path, which
      // reads the host address.
      CopyPlan host;
      host.add(p(1), p(91), p(11), 8);
      host.add(nullptr, p(92), p(12), 8);
      std::printf("host %d %s %llx\n", host.device_readable,
                  copy_mode_name(host.effective(CopyMode::kBatch)),
                  (unsigned long long)(uintptr_t)host.src[1]);
      host.clear();
      std::printf("cleared %lld %d\n", (long long)host.count(), host.device_readable);
      for (const char* name : {(const char*)nullptr, "", "gather", "batch", "each"})
        std::printf("mode %s\n", copy_mode_name(copy_mode_from_name(name)));
      try {
        copy_mode_from_name("memcpy");
      } catch (const std::invalid_argument& e) {
        std::printf("error %s\n", e.what());
      }
      std::printf("entries %d\n", kScatterEntries);
      for (const char* v : {(const char*)nullptr, "", "0", "50000", "10000000"})
        std::printf("spin %lld\n", (long long)spin_ns_from_env(kSourceSpinEnv, v));
      for (const char* v : {"-1", "5ms", "10000001", "99999999999999999999"}) {
        try {
          spin_ns_from_env(kSinkSpinEnv, v);
          std::printf("accepted %s\n", v);
        } catch (const std::invalid_argument& e) {
          std::printf("error %s\n", e.what());
        }
      }
      return 0;
    }
    """
)


def test_source_batch_is_one_scatter_table_per_chunk_with_its_own_destinations(
    tmp_path: Path,
) -> None:
    lines = _run_plan(tmp_path, program=_SCATTER_CHECK)
    assert lines[0] == "plan 4 1 gather"
    assert lines[1:4] == [
        "S 3 150528 100>b00:150528 300>d00:150528 400>e00:4",
        "S 1 72 500>f00:72",
        f"total {2 * 150528 + 4 + 72}",
    ]
    assert lines[4] == "host 0 each 5c00"
    assert lines[5] == "cleared 0 1"
    assert lines[6:11] == ["mode gather", "mode gather", "mode gather", "mode batch", "mode each"]
    assert lines[11] == (
        "error ECHOPIPE_GPU_SOURCE_COPY must be 'gather', 'batch' or 'each', got 'memcpy'"
    )
    # The race tests' spin hooks: whole microseconds up to 10 s, else one line naming both.
    assert lines[13:18] == ["spin 0", "spin 0", "spin 0", "spin 50000000", "spin 10000000000"]
    bad = ["-1", "5ms", "10000001", "99999999999999999999"]
    for line, value in zip(lines[18:22], bad, strict=True):
        assert line == (
            "error ECHOPIPE_GPU_TEST_SINK_SPIN_US must be whole microseconds in "
            f"[0, 10000000], got '{value}'"
        )


@pytest.mark.parametrize(
    ("defines", "param_bytes"), [((), 4096), (("-DCUDART_VERSION=12010",), 32764)]
)
def test_scatter_table_fits_one_kernel_parameter(
    tmp_path: Path, defines: tuple[str, ...], param_bytes: int
) -> None:
    """24 bytes per range (source, destination, size): a batch of 256 images with a label field
    and the info rows (513 ranges) is one launch from CUDA 12.1 on."""
    lines = _run_plan(tmp_path, *defines, program=_SCATTER_CHECK)
    (line,) = [ln for ln in lines if ln.startswith("entries")]
    entries = int(line.split()[1])
    assert entries == (param_bytes - 256 - 16) // 24
    if param_bytes > 4096:
        assert entries >= 2 * 256 + 1


# ---------------------------------------------------------------------------------------------
# Leases held until the GPU read is done (echopipe.echo.inflight)
# ---------------------------------------------------------------------------------------------


class _Payload:
    """Stands for the leases of one gather: only its lifetime matters."""


def _alive(ref: weakref.ref) -> bool:
    gc.collect()
    return ref() is not None


def test_payload_is_kept_until_its_wait_returns_then_dropped() -> None:
    keeper = InFlight("test-keeper")
    fired = [threading.Event() for _ in range(3)]
    entered = [threading.Event() for _ in range(3)]
    refs = []
    for ev, inside in zip(fired, entered, strict=True):
        p = _Payload()
        refs.append(weakref.ref(p))
        keeper.hold(lambda ev=ev, inside=inside: (inside.set(), ev.wait()), p)
        del p
    # The keeper is inside the first wait, so it can have dropped nothing yet.
    assert entered[0].wait(10)
    assert all(_alive(r) for r in refs) and keeper.pending() == 3
    fired[0].set()
    # It drops a payload before it starts the next wait.
    assert entered[1].wait(10)
    assert not _alive(refs[0])
    assert _alive(refs[1]) and _alive(refs[2]) and keeper.pending() == 2
    # FIFO: the third fires first, but the keeper is blocked in the second's wait, so the
    # third payload stays until that wait returns.
    fired[2].set()
    assert _alive(refs[2]) and keeper.pending() == 2
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
    never, inside = threading.Event(), threading.Event()
    keeper.hold(lambda: (inside.set(), never.wait()), _Payload())
    assert inside.wait(10)
    closer = threading.Thread(target=keeper.close, kwargs={"timeout": 0.3})
    closer.start()
    closer.join(60)  # a hang guard only: close is bounded by its own timeout
    assert not closer.is_alive()
    assert keeper.pending() == 1  # it returned with the wait still outstanding
    with pytest.raises(RuntimeError, match="closed"):
        keeper.hold(lambda: None, _Payload())
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
HEADLINE = ["unpack_dali", "environment", "build", "bench_dali_gpu", "bench_gather_bw",
            "test_overlap"]  # fmt: skip
TESTS = ["test_gpu_kernels", "test_gpu_streams", "test_gpu_dali", "test_gpu_races"]
EXTRAS = ["test_echo_pinned", "bench_pipeline", "train_mixed", "train_mixed_amp"]
BUDGETS = {"headline": 240, "tests": 150, "extras": 270}


def _plan(steps: str | None, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("ECHOPIPE_GPU_")}
    if steps is not None:
        full["ECHOPIPE_GPU_STEPS"] = steps
    full.update(env)
    return subprocess.run(
        ["bash", str(RUN_SH), "--plan"], env=full, capture_output=True, text=True, timeout=30
    )


def _plan_lines(got: subprocess.CompletedProcess[str]) -> tuple[dict[str, str], list[str], str]:
    """(pass -> its line, the steps, the budget line) of a --plan output."""
    lines = got.stdout.splitlines()
    passes = {ln.split(":")[0].split()[1]: ln for ln in lines if ln.startswith("pass ")}
    (steps,) = [ln for ln in lines if ln.startswith("steps: ")]
    (budget,) = [ln for ln in lines if ln.startswith("budget: ")]
    return passes, steps.split()[1:], budget


def test_plan_puts_the_headline_first_and_each_pass_within_its_budget() -> None:
    """The default run is ONE command: the headline pass (DALI echo vs plain DALI first, then
    gather vs memcpy and the stream overlap) before the tests, every pass's step timeouts
    adding up to at most its budget, and the whole under 7 minutes."""
    got = _plan(None)
    assert got.returncode == 0, got.stderr
    passes, steps, budget = _plan_lines(got)
    assert steps == HEADLINE + TESTS
    measuring = [s for s in steps if s not in ("environment", "unpack_dali", "build")]
    assert measuring[:3] == ["bench_dali_gpu", "bench_gather_bw", "test_overlap"]
    assert list(passes) == ["headline", "tests"]
    for name, line in passes.items():
        timeouts = [int(t) for t in re.findall(r" (\d+)s,?", line.split("=")[0])]
        total = int(re.search(r"= (\d+)s", line).group(1))
        assert sum(timeouts) == total <= BUDGETS[name], line
        assert line.endswith(f"within its budget of {BUDGETS[name]}s")
    # Per-test timeouts of 20 s fit in every pytest step.
    assert all(t >= 25 for t in (int(x) for x in re.findall(r"test_\w+ (\d+)s", got.stdout)))
    assert budget == "budget: 390s"


def test_plan_refuses_a_pass_whose_timeouts_exceed_its_budget(tmp_path: Path) -> None:
    script = tmp_path / "run.sh"
    script.write_text(RUN_SH.read_text().replace("[tests]=150", "[tests]=100"))
    got = subprocess.run(["bash", str(script), "--plan"], capture_output=True, text=True,
                         timeout=30, env={k: v for k, v in os.environ.items()
                                          if not k.startswith("ECHOPIPE_GPU_")})  # fmt: skip
    assert got.returncode == 3
    assert "pass tests:" in got.stdout and "= 150s, OVER its budget of 100s" in got.stdout


@pytest.mark.parametrize(
    ("steps", "expected", "budget"),
    [
        (None, HEADLINE + TESTS, 390),
        ("headline", HEADLINE, 240),
        ("tests", ["unpack_dali", "environment", "build", *TESTS], 390),
        ("all", HEADLINE + TESTS + EXTRAS, 660),
        ("extras,headline", HEADLINE + EXTRAS, 510),  # run order, not the order named
        ("test_gpu_races", ["unpack_dali", "environment", "build", "test_gpu_races"], 390),
        # A step that needs the installed package brings the build (skipped there if current).
        (" bench_gather_bw ", ["unpack_dali", "environment", "build", "bench_gather_bw"], 240),
        ("environment", ["environment"], 240),
        ("test_gpu_dali,test_gpu_dali", [*HEADLINE[:3], "test_gpu_dali"], 390),
    ],
)
def test_step_filter_selects_steps_in_run_order(
    steps: str | None, expected: list[str], budget: int
) -> None:
    got = _plan(steps)
    assert got.returncode == 0, got.stderr
    _, selected, budget_line = _plan_lines(got)
    assert selected == expected
    assert budget_line == f"budget: {budget}s"


def test_step_filter_budget_can_be_capped() -> None:
    got = _plan("test_gpu_races", ECHOPIPE_GPU_BUDGET_S="100")
    assert got.returncode == 0 and _plan_lines(got)[2] == "budget: 100s"


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        ("test_gpu,tset_echo", "unknown step 'test_gpu'"),
        ("pass3", "unknown step 'pass3'"),
        (",,", "names no step"),
    ],
)
def test_step_filter_rejects_a_bad_name_in_one_line(steps: str, message: str) -> None:
    got = _plan(steps)
    assert got.returncode == 2 and got.stdout == ""
    assert message in got.stderr and len(got.stderr.strip().splitlines()) == 1


def test_the_gpu_test_groups_cover_test_gpu_exactly_once() -> None:
    """run.sh runs tests/test_gpu.py in four processes (-k groups); every test is in one."""
    text = RUN_SH.read_text()
    streams = re.search(r'GPU_STREAM_TESTS="([^"]+)"', text).group(1)
    groups = [
        f"not dali and not ({streams}) and not stage_streams_overlap",
        streams,
        "dali",
        "stage_streams_overlap",
    ]
    assert "-k dali" in text and "::test_stage_streams_overlap_on_one_gpu" in text

    def collect(k: str | None) -> list[str]:
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
               str(REPO / "tests" / "test_gpu.py")] + (["-k", k] if k else [])  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO).stdout
        return [ln for ln in out.splitlines() if "::" in ln]

    everything = collect(None)
    parts = [collect(k) for k in groups]
    assert all(parts) and sorted(t for part in parts for t in part) == sorted(everything)


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
    got = subprocess.run(
        ["bash", str(REPO / "bench/gpu/pytest_steps.sh"), "demo", str(work), "test_slow.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert got.returncode == 1, got.stdout + got.stderr
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

    from echopipe.echo import inflight as _inflight

    never = threading.Event()
    _inflight.hold_until(lambda: never.wait(5), _Payload())  # busy in the parent at fork time
    ctx = mp.get_context("fork")
    child = ctx.Process(target=_hold_and_drain_in_child)
    child.start()
    child.join(30)
    never.set()
    assert child.exitcode == 0


class _LockingPayload:
    """Dropping it takes ``lock``, as dropping a lease takes its cache's locks."""

    def __init__(self, lock: threading.Lock) -> None:
        self.lock = lock

    def __del__(self) -> None:
        with self.lock:
            pass


def test_a_forked_child_does_not_drop_the_parents_payloads() -> None:
    """A lock the parent holds at the fork stays held in the child for ever: the child's fork
    handler must not drop a payload whose release takes it (it would hang there)."""
    import multiprocessing as mp

    from echopipe.echo import inflight as _inflight

    never, lock = threading.Event(), threading.Lock()
    _inflight.hold_until(lambda: never.wait(5), _Payload())  # busy in the parent
    _inflight.hold_until(lambda: None, _LockingPayload(lock))  # queued behind it
    child = None
    try:
        with lock:  # held by this thread at the fork
            child = mp.get_context("fork").Process(target=_hold_and_drain_in_child)
            child.start()
        child.join(20)
        assert child.exitcode == 0, "the forked child hung dropping its parent's payloads"
    finally:
        never.set()
        if child is not None and child.exitcode is None:
            child.kill()
            child.join(5)
    assert _inflight._KEEPER.drain(timeout=10)


def _hold_and_drain_in_child() -> None:
    from echopipe.echo import inflight as _inflight

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


def test_steps_after_the_unpack_see_the_packed_site(tmp_path: Path) -> None:
    """The first H200 run built the DALI plugin, then lost three pytest steps because only the
    DALI steps saw .gpu/site and the tests' conftest imports the plugin. Every step after the
    unpack sees it now; the environment step, run after the unpack, shows the path it got."""
    tree = tmp_path / "tree"
    (tree / "bench").mkdir(parents=True)
    shutil.copytree(REPO / "bench" / "gpu", tree / "bench" / "gpu")
    (tree / ".gpu" / "site" / "zz_only_packed").mkdir(parents=True)
    (tree / ".gpu" / "site" / "zz_only_packed" / "__init__.py").write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ECHOPIPE_GPU_", "PYTHON"))}
    env.update(ECHOPIPE_GPU_STEPS="environment", ECHOPIPE_GPU_WORK=str(tmp_path / "work"),
               ECHOPIPE_GPU_STATE=str(tmp_path / "state"), PYTHON=sys.executable)  # fmt: skip
    got = subprocess.run(["bash", str(tree / "bench" / "gpu" / "run.sh"), str(tmp_path / "out")],
                         env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    log = (tmp_path / "work" / "logs" / "environment.log").read_text()
    assert f"PYTHONPATH={tree / '.gpu' / 'site'}\n" in log, got.stdout + log
    assert ".gpu/site packages the image has too: none" in log


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
    ran = re.findall(r"^step (\w+) ", RUN_SH.read_text(), re.MULTILINE)
    assert ran == HEADLINE + TESTS + EXTRAS


# ---------------------------------------------------------------------------------------------
# Where the arena lives: memory="auto" decided from the input (echopipe.echo.memory)
# ---------------------------------------------------------------------------------------------

_GiB = 1 << 30


@pytest.mark.parametrize(
    ("input_device", "gpus", "arena", "free", "expected"),
    [
        ("gpu", 1, 8 * _GiB, 139 * _GiB, "device"),  # an H200 holds the echo buffer
        ("gpu", 1, 70 * _GiB, 139 * _GiB, "pinned"),  # more than half the free memory
        ("gpu", 1, 8 * _GiB, None, "pinned"),  # free memory unknown: never guess the device
        ("cpu", 1, 1 * _GiB, 139 * _GiB, "pinned"),  # CPU input on a GPU machine
        ("cpu", 0, 1 * _GiB, None, "pageable"),  # no GPU
        ("gpu", 0, 1 * _GiB, None, "pageable"),
    ],
)
def test_auto_memory_follows_the_input_and_the_free_device_memory(
    input_device: str, gpus: int, arena: int, free: int | None, expected: str
) -> None:
    from echopipe.echo.memory import choose_memory

    got = choose_memory(
        "auto", input_device=input_device, gpu_count=gpus, arena_bytes=arena, device_free_bytes=free
    )
    assert got == expected


def test_auto_memory_takes_the_device_up_to_half_the_free_memory_exactly() -> None:
    from echopipe.echo.memory import DEVICE_SHARE, choose_memory

    free = 10 * _GiB
    edge = int(DEVICE_SHARE * free)
    kw = dict(input_device="gpu", gpu_count=1, device_free_bytes=free)
    assert choose_memory("auto", arena_bytes=edge, **kw) == "device"
    assert choose_memory("auto", arena_bytes=edge + 1, **kw) == "pinned"


@pytest.mark.parametrize("memory", ["pageable", "pinned", "device"])
def test_explicit_memory_is_kept(memory: str) -> None:
    from echopipe.echo.memory import choose_memory

    got = choose_memory(
        memory, input_device="gpu", gpu_count=1, arena_bytes=1 << 40, device_free_bytes=1
    )
    assert got == memory


@pytest.mark.parametrize(
    ("memory", "input_device", "gpus", "message"),
    [
        ("device", "gpu", 0, "memory='device' needs a CUDA device, but echopipe sees none"),
        ("pinned", "cpu", 0, "memory='pinned' needs a CUDA device, but echopipe sees none"),
        ("device", "cpu", 1, "the echo input is on the CPU; decode with device='mixed'"),
        ("gpu", "gpu", 1, "one of 'auto', 'pageable', 'pinned', 'device', got 'gpu'"),
    ],
)
def test_memory_choice_errors_are_one_line_naming_the_value(
    memory: str, input_device: str, gpus: int, message: str
) -> None:
    from echopipe.echo.memory import choose_memory

    with pytest.raises(ValueError, match=re.escape(message)):
        choose_memory(
            memory, input_device=input_device, gpu_count=gpus, arena_bytes=1, device_free_bytes=None
        )


def test_without_a_gpu_the_machine_facts_give_host_memory_or_one_clear_error() -> None:
    """resolve_memory asks echopipe's core for the GPUs: on a machine without one, auto is
    pageable and device is refused in one line (the core refuses it too, see test_gpu.py)."""
    from echopipe.echo.memory import gpu_count, resolve_memory

    if gpu_count() > 0:
        pytest.skip("this machine has a GPU")
    kw = dict(input_device="gpu", arena_bytes=1 << 20, device_id=0)
    assert resolve_memory("auto", **kw) == "pageable"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_memory("device", **kw)


def test_echo_config_accepts_device_and_names_a_bad_memory() -> None:
    from echopipe.dali.config import EchoPipelineConfig
    from echopipe.echo import EchoConfig, EchoConfigError

    config = EchoPipelineConfig(batch_size=4, echo=EchoConfig(factor=2.0, memory="device"))
    assert config.resolved().echo.memory == "device"
    with pytest.raises(EchoConfigError, match="got 'host'"):
        EchoConfig(memory="host")


def test_a_device_cache_without_a_gpu_is_one_clear_error() -> None:
    from echopipe.echo import EchoCache
    from echopipe.native import core as _C

    if _C.cuda_available():
        pytest.skip("this machine has a GPU (tests/test_gpu.py uses the device arena)")
    with pytest.raises(RuntimeError) as err:
        EchoCache(capacity_bytes=1 << 20, capacity_samples=8, memory="device")
    assert str(err.value) in (
        "memory='device' needs a CUDA device, but the CUDA runtime found none",
        "memory='device' needs a CUDA device, but echopipe was built without CUDA",
    )
    with pytest.raises(ValueError, match="'pinned', 'device', got 'gpu'"):
        EchoCache(capacity_bytes=1 << 20, capacity_samples=8, memory="gpu")


def test_copy_ranges_names_a_bad_mode_or_mismatched_lists() -> None:
    from echopipe.native import core as _C

    with pytest.raises(ValueError, match="mode must be 'gather', 'batch' or 'each', got 'x'"):
        _C.copy_ranges("x", [], [], [], 0)
    with pytest.raises(ValueError, match="differ in length"):
        _C.copy_ranges("gather", [1], [], [1], 0)
    # No ranges: nothing is launched, so a CUDA build holds this on a machine without a GPU too.
    if _C.built_with_cuda():
        _C.copy_ranges("gather", [], [], [], 0)


# ---------------------------------------------------------------------------------------------
# The gather kernels' byte copy (csrc/cuda/copy_range.h) run on the CPU, thread by thread
# ---------------------------------------------------------------------------------------------

_COPY_RANGE_CHECK = textwrap.dedent(
    r"""
    #include <sys/mman.h>
    #include <unistd.h>
    #include <cstdio>
    #include <cstring>
    #include <vector>
    #include "cuda/copy_range.h"
    using namespace echopipe::cuda;

    // Every "thread" of a grid of `threads` copies its share, in a scrambled order.
    static void run_grid(const uint8_t* in, uint8_t* out, int64_t size, int threads) {
      for (int t = 0; t < threads; ++t) copy_range(in, out, size, (t * 5) % threads, threads);
    }

    int main() {
      const long page = sysconf(_SC_PAGESIZE);
      // Source pages: [guard][data][guard]. A read outside the 16-byte blocks the range
      // touches faults when the range starts at the data page's start or ends at its end.
      auto* map = static_cast<uint8_t*>(mmap(nullptr, 3 * page, PROT_READ | PROT_WRITE,
                                             MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
      uint8_t* data = map + page;
      for (long i = 0; i < page; ++i) data[i] = static_cast<uint8_t>(i * 131 + 7);
      mprotect(map, page, PROT_NONE);
      mprotect(data + page, page, PROT_NONE);
      std::vector<int64_t> sizes;
      for (int64_t s = 0; s <= 48; ++s) sizes.push_back(s);
      for (int64_t s : {63, 64, 65, 100, 255, 256, 257, 1000, 3001}) sizes.push_back(s);
      alignas(64) static uint8_t dst_buf[4096 + 128];
      long checks = 0, bad = 0;
      for (int threads : {1, 3, 8, 256}) {
        for (int src_off = 0; src_off < 16; ++src_off) {
          for (int dst_off = 0; dst_off < 16; ++dst_off) {
            for (int64_t size : sizes) {
              const int64_t span = (src_off + size + 15) / 16 * 16;
              for (int at_end = 0; at_end < 2; ++at_end) {
                const uint8_t* src = at_end ? data + page - span + src_off : data + src_off;
                std::memset(dst_buf, 0xA5, sizeof(dst_buf));
                uint8_t* dst = dst_buf + 32 + dst_off;
                run_grid(src, dst, size, threads);
                bool ok = std::memcmp(dst, src, size) == 0;
                for (uint8_t* p = dst_buf; p < dst; ++p) ok = ok && *p == 0xA5;
                for (uint8_t* p = dst + size; p < dst_buf + sizeof(dst_buf); ++p)
                  ok = ok && *p == 0xA5;
                ++checks;
                if (!ok && bad++ < 5)
                  std::printf("bad threads=%d src_off=%d dst_off=%d size=%lld end=%d\n",
                              threads, src_off, dst_off, (long long)size, at_end);
              }
            }
          }
        }
      }
      std::printf("checks %ld bad %ld\n", checks, bad);
      return 0;
    }
    """
)


def test_byte_copy_is_exact_at_every_alignment_and_reads_only_the_blocks_it_needs(
    tmp_path: Path,
) -> None:
    """DALI packs ragged samples back to back, so the gather's destinations are mostly
    unaligned: the copy must be byte-exact for all 16 x 16 source and destination
    misalignments, many sizes (below, at and above one vector) and grids of 1-256 threads, write
    nothing outside the range, and read no 16-byte block outside it (guard pages fault)."""
    lines = _run_plan(tmp_path, "-fno-strict-aliasing", program=_COPY_RANGE_CHECK)
    assert lines[-2] == f"checks {4 * 16 * 16 * 58 * 2} bad 0", lines[:6]


# ---------------------------------------------------------------------------------------------
# The DALI GPU source's draw gives back finished batches while it waits (csrc/dali/source_draw.h)
# ---------------------------------------------------------------------------------------------


def test_gpu_source_draw_on_a_minimum_cache_does_not_hang(tmp_path: Path) -> None:
    """tests/cpp/test_gpu_source_draw.cc (also run by ctest) against the built core: a cache of
    the smallest size echopipe.dali allows, two batches held whose copies end only once the next
    draw has started, e = 1 so their slots hold no tickets. Without the retire between draw
    attempts it hangs after 2 draws; its watchdog then closes the cache and it exits 1."""
    core = REPO / "python" / "echopipe" / "libechopipe_core.so"
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None or not core.exists():
        pytest.skip("needs a host C++ compiler and the built core (run the native build first)")
    exe = tmp_path / "draw"
    cmd = [cxx, "-std=c++20", "-O1", f"-I{REPO / 'csrc'}",
           str(REPO / "tests" / "cpp" / "test_gpu_source_draw.cc"), str(core),
           f"-Wl,-rpath,{core.parent}", "-pthread", "-o", str(exe)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    got = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "gpu source draw tests passed"


def test_recut_dali_joins_to_the_same_bytes_in_fewer_parts_that_fit_one_transfer(
    tmp_path: Path,
) -> None:
    """Four 0.75 MiB parts (as pack-dali cuts them, scaled down) under a 2 MiB transfer limit:
    two parts, each with the tree under the limit, the same bytes joined, sums that check."""
    repo = tmp_path / "repo"
    gpu = repo / ".gpu"
    gpu.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "tracked.txt").write_text("x" * 10_000)
    data = np.random.default_rng(0).bytes(3 * 1024 * 1024)
    for i in range(4):
        (gpu / f"dali.tar.xz.part-{i}").write_bytes(data[i * 786432 : (i + 1) * 786432])
    subprocess.run("sha256sum dali.tar.xz.part-* > SHA256SUMS", shell=True, cwd=gpu, check=True)
    (repo / ".git" / "info" / "exclude").write_text("/.gpu/\n")
    got = subprocess.run(["bash", str(REPO / "bench" / "gpu" / "recut-dali"), "2"], cwd=repo,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert got.returncode == 0, got.stderr
    parts = sorted(gpu.glob("dali.tar.xz.part-*"))
    assert len(parts) == 2 and "DALI in 2 parts" in got.stdout
    assert all(p.stat().st_size + 10_000 <= 2 * 1024 * 1024 for p in parts)
    assert b"".join(p.read_bytes() for p in parts) == data
    subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=gpu, check=True)


@pytest.mark.parametrize("scale", ["0", "x", "1.5", "100"])
def test_a_bad_timeout_scale_is_one_line(scale: str) -> None:
    got = _plan(None, ECHOPIPE_GPU_TIMEOUT_SCALE=scale)
    assert got.returncode == 2 and got.stdout == ""
    assert got.stderr.strip() == (
        f"ECHOPIPE_GPU_TIMEOUT_SCALE must be a whole number from 1 to 99, got '{scale}'"
    )
