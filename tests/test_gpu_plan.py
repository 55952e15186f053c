"""The parts of the GPU path that run without a GPU: the gather kernels' launch plan (compiled
with the host compiler), the keeper that holds leases until a GPU read is done, and the step
selection and per-test timeout of ``bench/gpu/run.sh``."""

from __future__ import annotations

import gc
import shutil
import subprocess
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
