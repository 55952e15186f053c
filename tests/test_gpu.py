"""CUDA paths: gather kernels against the CPU, pinned + mapped arenas, the stale pipeline on GPU
streams (one GPU, and several when present) with proof that the stage streams overlap, and the
DALI mixed-decode -> echo -> GPU augmentation path when DALI is importable.

Every test here needs a CUDA device and skips without one (the development machine has none).
``bench/gpu/run.sh`` runs this file for real on a CUDA machine, after building with
``ECHOPIPE_REQUIRE_CUDA=ON``. When ``ECHOPIPE_GPU_EVIDENCE`` names a folder, the overlap test
writes the measured kernel intervals there (``stream_overlap.json``) as the evidence of overlap.
"""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from pipeline_support.jpegs import solid_jpegs
from pipeline_support.known_samples import KnownSource, known_image

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device (these run for real in bench/gpu/run.sh on a GPU machine)",
)

needs_two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs at least two CUDA devices"
)


def _native() -> Any:
    from echopipe.native import core as _C

    return _C


def _cache(**kw: Any) -> Any:
    from echopipe.echo import EchoCache

    args: dict[str, Any] = dict(capacity_bytes=8 << 20, capacity_samples=256, echo_factor=2.0)
    args.update(kw)
    return EchoCache(**args)


# ---------------------------------------------------------------------------------------------
# Build and memory
# ---------------------------------------------------------------------------------------------


def test_native_core_was_built_with_cuda_and_sees_the_devices() -> None:
    import echopipe

    _C = _native()
    assert _C.built_with_cuda(), "echopipe was built without CUDA kernels on a CUDA machine"
    assert _C.cuda_device_count() == torch.cuda.device_count()
    info = echopipe.build_info()
    assert info["cuda_compiled"] is True
    # build_info() predicts what a new cache allocates; a real allocation must agree (and be
    # mapped: test_auto_memory_is_pinned_and_mapped_into_the_device asks the driver).
    cache = _cache(memory="auto")
    try:
        assert cache.memory_kind == info["memory_kind"] == "pinned"
        assert cache.arena_device_ptr != 0
    finally:
        cache.close()


class _Driver:
    """The CUDA driver API through ctypes (libcuda ships with the driver)."""

    CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
    CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3
    CU_MEMORYTYPE_HOST = 1
    CU_MEMORYTYPE_DEVICE = 2

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
        self.lib.cuPointerGetAttribute.restype = ctypes.c_int

    def memory_type(self, ptr: int) -> int:
        out = ctypes.c_uint(0)
        err = self.lib.cuPointerGetAttribute(
            ctypes.byref(out), self.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr
        )
        assert err == 0, f"cuPointerGetAttribute(MEMORY_TYPE, {ptr:#x}) failed with {err}"
        return int(out.value)

    def device_pointer(self, ptr: int) -> int:
        out = ctypes.c_uint64(0)
        err = self.lib.cuPointerGetAttribute(
            ctypes.byref(out), self.CU_POINTER_ATTRIBUTE_DEVICE_POINTER, ptr
        )
        assert err == 0, f"cuPointerGetAttribute(DEVICE_POINTER, {ptr:#x}) failed with {err}"
        return int(out.value)


def test_auto_memory_is_pinned_and_mapped_into_the_device() -> None:
    torch.zeros(1, device="cuda")  # make the primary context current in this thread
    cache = _cache(memory="auto")
    try:
        assert cache.memory_kind == "pinned"
        assert cache.arena_device_ptr != 0
        cache.put(np.arange(4096, dtype=np.uint8).reshape(64, 64))
        (sample,) = cache.take(1, timeout=5)
        lease = sample._lease
        host, dev = lease.data_ptr(0), lease.device_ptr(0)
        assert dev != 0
        driver = _Driver()
        # The driver itself says: page-locked host memory, mapped at exactly this device address.
        assert driver.memory_type(host) == _Driver.CU_MEMORYTYPE_HOST
        assert driver.device_pointer(host) == dev
        # torch agrees that the copy torch() returns lives in pinned memory.
        assert sample.torch(0).is_pinned()
        np.testing.assert_array_equal(sample.array, np.arange(4096, dtype=np.uint8).reshape(64, 64))
        del sample, lease
    finally:
        cache.close()


def test_pageable_cache_is_rejected_by_the_device_gather() -> None:
    cache = _cache(memory="pageable")
    try:
        assert cache.memory_kind == "pageable" and cache.arena_device_ptr == 0
        cache.put(np.ones(128, dtype=np.uint8))
        samples = cache.take(1, timeout=5)
        dst = torch.empty(128, dtype=torch.uint8, device="cuda")
        with pytest.raises(RuntimeError, match="pinned"):
            cache.gather_to_device(samples, 0, dst)
    finally:
        cache.close()


# ---------------------------------------------------------------------------------------------
# Device arena (memory="device")
# ---------------------------------------------------------------------------------------------


def _ragged(k: int) -> np.ndarray:
    """Sample k: random bytes from seed k, ragged (not a multiple of 16 bytes)."""
    return np.random.default_rng(k).integers(0, 256, size=(3 + k % 5, 7, 3), dtype=np.uint8)


def test_device_cache_lives_in_device_memory_and_round_trips_byte_exact() -> None:
    """Puts copy into cudaMalloc'd memory, take_batch and save_state copy back out: what comes
    back is byte-exact, including after a restore into a second device cache."""
    cache = _cache(memory="device", echo_factor=1.0, capacity_samples=64)
    try:
        assert cache.memory_kind == "device" and cache.arena_device_ptr != 0
        # The driver says the arena is device memory (not host memory mapped into the GPU).
        assert _Driver().memory_type(cache.arena_device_ptr) == _Driver.CU_MEMORYTYPE_DEVICE
        for k in range(40):
            cache.put((_ragged(k), np.int64(k)))
        restored = _cache(memory="device", echo_factor=1.0, capacity_samples=64)
        try:
            restored.load_state_dict(cache.state_dict())
            for c in (cache, restored):
                batch = c.take_batch(40, timeout=5)
                assert batch is not None and len(batch) == 40
                for i in range(40):
                    k = int(batch.sample(i, 1))
                    np.testing.assert_array_equal(batch.sample(i, 0), _ragged(k))
        finally:
            restored.close()
    finally:
        cache.close()


def test_device_cache_has_no_host_view_and_gathers_device_to_device() -> None:
    cache = _cache(memory="device", echo_factor=2.0, capacity_samples=64)
    try:
        for k in range(20):
            cache.put((_ragged(k), np.int64(k)))
        samples = cache.take(30, timeout=5)
        with pytest.raises(ValueError, match=r"GPU memory \(memory='device'\): no host view"):
            samples[0].array  # noqa: B018
        labels = torch.empty(30, dtype=torch.int64, device="cuda")
        cache.gather_to_device(samples, 1, labels)
        total = sum(int(np.prod(s._lease.shape(0))) for s in samples)
        images = torch.full((total,), 7, dtype=torch.uint8, device="cuda")
        cache.gather_to_device(samples, 0, images)
        torch.cuda.synchronize()
        expected = np.concatenate([_ragged(int(k)).reshape(-1) for k in labels.cpu().numpy()])
        np.testing.assert_array_equal(images.cpu().numpy(), expected)
        # Sample k was put k-th, so its id is k: the labels came out in the samples' order.
        assert labels.cpu().tolist() == [s.sample_id for s in samples]
    finally:
        cache.close()


@pytest.mark.parametrize("mode", ["gather", "batch", "each"])
@pytest.mark.parametrize("memory", ["pinned", "device"])
def test_copy_ranges_paths_match_the_cpu(memory: str, mode: str) -> None:
    """The GPU source's three copy paths (one scatter launch, cudaMemcpyBatchAsync, one
    cudaMemcpyAsync per range) on ragged ranges into scattered, unaligned destinations."""
    _C = _native()
    if mode == "batch" and not _C.copy_batch_supported():
        pytest.skip("built with CUDA < 12.8: no cudaMemcpyBatchAsync")
    cache = _cache(memory=memory, echo_factor=1.0, capacity_samples=64)
    try:
        for k in range(50):
            cache.put(_ragged(k))
        samples = cache.take(50, timeout=5)
        sizes = [int(np.prod(s._lease.shape(0))) for s in samples]
        out = torch.full((sum(sizes) + 3 * len(sizes) + 64,), 7, dtype=torch.uint8, device="cuda")
        base, dst, at = out.data_ptr(), [], 1  # odd offsets: unaligned destinations
        for n in sizes:
            dst.append(base + at)
            at += n + 3
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        src = [s._lease.device_ptr(0) for s in samples]
        _C.copy_ranges(mode, src, dst, sizes, stream.cuda_stream)
        stream.synchronize()
        got = out.cpu().numpy()
        for s, d, n in zip(samples, dst, sizes, strict=True):
            k = s.sample_id  # put order = sample id
            np.testing.assert_array_equal(got[d - base : d - base + n], _ragged(k).reshape(-1))
            assert got[d - base + n] == 7  # nothing written past the range
    finally:
        cache.close()


# ---------------------------------------------------------------------------------------------
# Gather kernels against the CPU
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_side_stream", [False, True])
def test_gather_bytes_matches_cpu_for_ragged_unaligned_samples(use_side_stream: bool) -> None:
    rng = np.random.default_rng(0)
    cache = _cache(memory="pinned", echo_factor=2.0, capacity_samples=512)
    try:
        # Sizes 1..5000 bytes, most not multiples of 16, so both kernel paths (16-byte vectors
        # and the byte tail, aligned and unaligned starts) are exercised.
        sizes = rng.integers(1, 5000, size=200)
        for i, n in enumerate(sizes):
            cache.put((rng.integers(0, 256, size=int(n), dtype=np.uint8), np.int64(i)))
        samples = cache.take(300, timeout=5)
        expected = np.concatenate([s[0] for s in samples])
        dst = torch.full((expected.size,), 7, dtype=torch.uint8, device="cuda")
        stream = torch.cuda.Stream() if use_side_stream else torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())  # the fill above must land first
        cache.gather_to_device(samples, 0, dst, stream=stream if use_side_stream else None)
        stream.synchronize()
        np.testing.assert_array_equal(dst.cpu().numpy(), expected)
        # Field 1 (the int64 labels) through the same kernel.
        labels = torch.empty(len(samples), dtype=torch.int64, device="cuda")
        cache.gather_to_device(samples, 1, labels, stream=0)
        torch.cuda.synchronize()
        np.testing.assert_array_equal(labels.cpu().numpy(), [int(s[1]) for s in samples])
    finally:
        cache.close()


def test_gathers_larger_than_one_pointer_table_span_several_launches() -> None:
    """5000 samples: three launches of the byte gather (2030 per table with CUDA >= 12.1) and
    two of gather+normalise (4061 per table); the chunks' offsets must join up exactly."""
    rng = np.random.default_rng(5)
    n = 5000
    cache = _cache(memory="pinned", echo_factor=1.0, capacity_samples=n, capacity_bytes=16 << 20)
    try:
        images = rng.integers(0, 256, size=(n, 2, 3, 3), dtype=np.uint8)
        cache.put_batch(images, timeout=10)
        samples = cache.take(n, timeout=10)
        drawn = np.stack([s.array for s in samples])
        raw = torch.zeros(drawn.size, dtype=torch.uint8, device="cuda")
        cache.gather_to_device(samples, 0, raw)
        norm = torch.zeros((n, 3, 2, 3), dtype=torch.float32, device="cuda")
        mean, std = [10.0, 20.0, 30.0], [2.0, 4.0, 8.0]
        cache.gather_to_device(samples, 0, norm, normalize=(mean, std), layout="CHW")
        torch.cuda.synchronize()
        np.testing.assert_array_equal(raw.cpu().numpy(), drawn.reshape(-1))
        expected = ((drawn.astype(np.float32) - np.float32(mean)) / np.float32(std)).transpose(
            0, 3, 1, 2
        )
        np.testing.assert_allclose(norm.cpu().numpy(), expected, rtol=1e-5, atol=1e-5)
    finally:
        cache.close()


def test_gather_keeps_the_slots_until_the_kernel_has_read_them() -> None:
    """The caller drops its samples right after queueing the gather (behind a ~20 ms spin) and
    the producer refills the cache at once: the new samples may only take the slots after the
    kernel read them, so the batch holds the old bytes."""
    import time

    from echopipe.echo import inflight as _inflight

    cache = _cache(memory="pinned", echo_factor=1.0, capacity_samples=8, min_fill=0)
    try:
        cache.put_batch(np.stack([np.full(4096, i, np.uint8) for i in range(8)]))
        samples = cache.take(8, timeout=5)
        expected = np.concatenate([s.array for s in samples])  # a copy: the slots' bytes now
        dst = torch.zeros(expected.size, dtype=torch.uint8, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(40_000_000)
        cache.gather_to_device(samples, 0, dst, stream=side)
        del samples
        # Every slot is full, so each put waits for a slot the gather still holds.
        cache.put_batch(np.stack([np.full(4096, 200 + i, np.uint8) for i in range(8)]), timeout=10)
        side.synchronize()
        np.testing.assert_array_equal(dst.cpu().numpy(), expected)
        deadline = time.monotonic() + 5
        while _inflight.pending() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _inflight.pending() == 0, "the leases were not released after the kernel ran"
    finally:
        cache.close()


# 37 x 29: one partial tile of 16-pixel groups and a leftover pixel; 70 x 66: a full tile of 256
# groups, a partial one and 12 leftover pixels (each read byte by byte).
@pytest.mark.parametrize("hw", [(37, 29), (70, 66)])
@pytest.mark.parametrize("to_chw", [True, False])
@pytest.mark.parametrize("channels", [1, 3, 4])
def test_gather_normalize_matches_cpu(to_chw: bool, channels: int, hw: tuple[int, int]) -> None:
    rng = np.random.default_rng(channels)
    h, w = hw
    cache = _cache(memory="pinned", echo_factor=1.0)
    try:
        images = rng.integers(0, 256, size=(40, h, w, channels), dtype=np.uint8)
        cache.put_batch(images)
        samples = cache.take(40, timeout=5)
        mean = [float(v) for v in rng.uniform(0, 255, channels)]
        std = [float(v) for v in rng.uniform(10, 80, channels)]
        got = torch.empty(
            (40, channels, h, w) if to_chw else (40, h, w, channels),
            dtype=torch.float32,
            device="cuda",
        )
        cache.gather_to_device(
            samples, 0, got, normalize=(mean, std), layout="CHW" if to_chw else "HWC"
        )
        torch.cuda.synchronize()
        drawn = np.stack([s.array for s in samples]).astype(np.float32)
        expected = (drawn - np.float32(mean)) / np.float32(std)
        if to_chw:
            expected = expected.transpose(0, 3, 1, 2)
        np.testing.assert_allclose(got.cpu().numpy(), expected, rtol=1e-5, atol=1e-5)
    finally:
        cache.close()


def test_gather_normalize_rejects_bad_inputs_with_clear_errors() -> None:
    cache = _cache(memory="pinned", echo_factor=1.0)
    try:
        cache.put_batch(np.zeros((2, 4, 4, 3), dtype=np.uint8))
        samples = cache.take(2, timeout=5)
        dst = torch.empty((2, 3, 4, 4), device="cuda")
        with pytest.raises(ValueError, match="per channel"):
            cache.gather_to_device(samples, 0, dst, normalize=([0.0], [1.0]), layout="CHW")
        with pytest.raises(ValueError, match="non-zero"):
            cache.gather_to_device(
                samples, 0, dst, normalize=([0.0] * 3, [1.0, 0.0, 1.0]), layout="CHW"
            )
        # The native entry point checks the same (for callers that bypass the wrapper).
        leases = [s._lease for s in samples]
        with pytest.raises(ValueError, match="one per channel"):
            _native().gather_normalize_to_device(leases, 0, [0.0], [1.0], True, dst.data_ptr(), 0)
    finally:
        cache.close()


# ---------------------------------------------------------------------------------------------
# Stale pipeline on GPU streams
# ---------------------------------------------------------------------------------------------


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Linear(16, 32), nn.Tanh()),
        nn.Sequential(nn.Linear(32, 32), nn.Tanh()),
        nn.Sequential(nn.Linear(32, 32), nn.Tanh()),
        nn.Linear(32, 4),
    ).double()


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(8, 16, generator=g, dtype=torch.float64),
            torch.randint(0, 4, (8,), generator=g),
        )
        for _ in range(steps)
    ]


def _train(devices: list[str], balance: list[int], steps: int = 12) -> dict[str, torch.Tensor]:
    from echopipe.pipeline import StalePipeline

    model = _mlp()
    batches = _batches(steps)
    with StalePipeline(
        model,
        balance=balance,
        devices=devices,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
        loss_fn=nn.functional.cross_entropy,
    ) as pipe:
        assert pipe.staleness()[0] == 2 * (len(balance) - 1)
        pipe.run_epoch(batches, step_schedulers=False)
        pipe.drain()
        assert pipe.steps_applied == steps
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-9, atol=1e-11, msg=f"parameter {k}")


def test_stale_pipeline_on_two_streams_of_one_gpu_matches_cpu() -> None:
    cpu = _train(["cpu", "cpu"], [2, 2])
    gpu = _train(["cuda:0", "cuda:0"], [2, 2])
    _assert_same_weights(cpu, gpu)


def test_stale_pipeline_four_stages_on_one_gpu_matches_cpu() -> None:
    cpu = _train(["cpu"] * 4, [1, 1, 1, 1])
    gpu = _train(["cuda:0"] * 4, [1, 1, 1, 1])
    _assert_same_weights(cpu, gpu)


def test_batches_made_on_the_callers_gpu_stream_are_waited_for() -> None:
    """The caller makes each batch on its own (default) stream behind a ~10 ms spin kernel, as
    DALI's copy into a torch tensor does; the stages' streams must wait for it, not read the
    half-written batch. Same weights as CPU training on the same numbers."""
    from echopipe.pipeline import StalePipeline

    expected = _train(["cpu", "cpu"], [2, 2], steps=8)
    model = _mlp()
    resident = [(x.cuda(), y.cuda()) for x, y in _batches(8)]
    torch.cuda.synchronize()
    with StalePipeline(
        model, balance=[2, 2], devices=["cuda:0", "cuda:0"],
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
        loss_fn=nn.functional.cross_entropy,
    ) as pipe:  # fmt: skip
        for x, y in resident:
            torch.cuda._sleep(20_000_000)  # the batch is written only after this spin
            pipe.train_step(x * 1.0, y + 0)
        pipe.drain()
    got = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    _assert_same_weights(expected, got)


# About 10 ms of spinning at ~2 GHz: thousands of times longer than the tiny kernels around it,
# so a stage that did not wait for its neighbour would read a half-written tensor.
_WAIT_CYCLES = 20_000_000


class _LateOutput(nn.Module):
    """A linear layer whose output is written only after a long spin on the current stream."""

    def __init__(self, fin: int, fout: int) -> None:
        super().__init__()
        self.fc = nn.Linear(fin, fout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            torch.cuda._sleep(_WAIT_CYCLES)
        return self.fc(x)


class _LateGradFn(torch.autograd.Function):
    """Identity forward; the gradient is written only after a long spin (on CUDA)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if grad.is_cuda:
            torch.cuda._sleep(_WAIT_CYCLES)
        return grad * 1.0


class _LateGrad(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LateGradFn.apply(x)


def _late_model(stages: int) -> nn.Sequential:
    """One child per stage: each writes its activation late (forward edge) and the gradient
    of its input late (backward edge), so every edge between stages is a real race."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(_LateGrad(), _LateOutput(16, 16), nn.Tanh()) for _ in range(stages - 1)]
    blocks.append(nn.Sequential(_LateGrad(), nn.Linear(16, 4)))
    return nn.Sequential(*blocks).double()


def _train_late(devices: list[str], steps: int = 6) -> dict[str, torch.Tensor]:
    from echopipe.pipeline import StalePipeline

    model = _late_model(len(devices))
    with StalePipeline(
        model, balance=[1] * len(devices), devices=devices,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
        loss_fn=nn.functional.cross_entropy,
    ) as pipe:  # fmt: skip
        pipe.run_epoch(_batches(steps), step_schedulers=False)
        pipe.drain()
        assert pipe.steps_applied == steps
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def test_a_missing_wait_would_be_visible_with_these_spins() -> None:
    """The control: a consumer stream that does NOT wait reads a different value, so the
    weight-equality test below can fail when the pipeline's waits are missing."""
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    x = torch.randn(64, 16, dtype=torch.float64, device="cuda")
    w = torch.randn(16, 16, dtype=torch.float64, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(producer):
        torch.cuda._sleep(_WAIT_CYCLES)
        y = x @ w
    with torch.cuda.stream(consumer):
        early = y.clone()  # no consumer.wait_stream(producer)
    torch.cuda.synchronize()
    assert not torch.equal(early, x @ w), "the spin did not delay the producer"


@pytest.mark.parametrize("stages", [2, 3])
def test_stage_waits_hold_when_every_edge_is_a_race(stages: int) -> None:
    cpu = _train_late(["cpu"] * stages)
    gpu = _train_late(["cuda:0"] * stages)
    _assert_same_weights(cpu, gpu)


@needs_two_gpus
def test_stale_pipeline_across_gpus_matches_cpu() -> None:
    n = min(torch.cuda.device_count(), 4)
    balance = [1] * n if n == 4 else ([2, 2] if n == 2 else [2, 1, 1])
    cpu = _train(["cpu"] * n, balance)
    gpu = _train([f"cuda:{i}" for i in range(n)], balance)
    _assert_same_weights(cpu, gpu)


class _Spin(nn.Module):
    """A linear layer whose forward first keeps its stream busy for ``cycles`` GPU clock cycles
    with a single-block kernel, so two stages' kernels can only overlap by running concurrently.
    """

    def __init__(self, cycles: int) -> None:
        super().__init__()
        self.cycles = cycles
        self.fc = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(self.cycles)
        return self.fc(x)


def test_busy_timer_times_gpu_work_not_kernel_launches() -> None:
    """``echopipe train``'s t_down (the stages' busy timers) must see the GPU time of a stage's
    work (here a spin of ~20 ms), not the microseconds it takes to queue the kernels."""
    from echopipe.pipeline.stream import BusyTimer, DeviceStream

    stream = DeviceStream(torch.device("cuda"))
    timer = BusyTimer(stream)
    stage = _Spin(40_000_000).cuda().train()  # ~20 ms at ~2 GHz
    x = torch.randn(8, 64, device="cuda")
    with stream.use():
        for _ in range(3):
            with timer.span():
                stage(x)
    stream.synchronize()
    seconds, spans = timer.take()
    assert spans == 3
    assert 3 * 0.005 < seconds < 3 * 0.5  # launches alone take microseconds


def _kernel_intervals(trace: dict[str, Any]) -> list[tuple[int, float, float, str]]:
    out = []
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") == "X" and ev.get("cat") == "kernel":
            stream = int(ev.get("args", {}).get("stream", -1))
            out.append((stream, float(ev["ts"]), float(ev["ts"]) + float(ev["dur"]), ev["name"]))
    return out


def _overlap_us(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total = 0.0
    for s0, e0 in a:
        for s1, e1 in b:
            total += max(0.0, min(e0, e1) - max(s0, s1))
    return total


def test_stage_streams_overlap_on_one_gpu(tmp_path: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    from echopipe.pipeline import StalePipeline

    # About 2 ms of spinning per stage forward at ~1.5-2 GHz.
    cycles = 3_000_000
    model = nn.Sequential(_Spin(cycles), _Spin(cycles), nn.Linear(64, 4)).cuda()
    x = torch.randn(32, 64)
    y = torch.randint(0, 4, (32,))
    batches = [(x, y)] * 16
    with StalePipeline(
        model,
        balance=[1, 2],
        devices=["cuda:0", "cuda:0"],
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01),
        loss_fn=nn.functional.cross_entropy,
    ) as pipe:
        pipe.run_epoch(batches[:4], step_schedulers=False)  # warm up (allocator, cuBLAS)
        pipe.drain()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            pipe.run_epoch(batches, step_schedulers=False)
            pipe.drain()
            torch.cuda.synchronize()
    trace_path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace_path))
    kernels = _kernel_intervals(json.loads(trace_path.read_text()))
    spins = [k for k in kernels if "spin" in k[3].lower() or "sleep" in k[3].lower()]
    by_stream: dict[int, list[tuple[float, float]]] = {}
    for stream, start, end, _ in spins:
        by_stream.setdefault(stream, []).append((start, end))
    assert len(by_stream) == 2, f"spin kernels ran on streams {sorted(by_stream)}, expected 2"
    # Stage 0's stream is the one whose first spin came first.
    s0, s1 = sorted(by_stream, key=lambda s: min(start for start, _ in by_stream[s]))
    first, second = sorted(by_stream[s0]), sorted(by_stream[s1])
    # Step i's stage-1 forward reads stage 0's output of step i, written after stage 0's spin:
    # with the wait in place its spin cannot start before that one ended. (Overlap alone
    # would pass more easily without the wait.)
    early = [i for i in range(min(len(first), len(second))) if second[i][0] < first[i][1]]
    overlap = _overlap_us(first, second)
    busy = sum(e - s for s, e in first) + sum(e - s for s, e in second)
    evidence = {
        "streams": {str(s): len(v) for s, v in by_stream.items()},
        "spin_kernels": len(spins),
        "busy_us": busy,
        "overlap_us": overlap,
        "overlap_fraction_of_busy": overlap / busy if busy else 0.0,
        "stage1_spins_started_before_their_input": early,
        "device": torch.cuda.get_device_name(0),
    }
    out_dir = os.environ.get("ECHOPIPE_GPU_EVIDENCE")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "stream_overlap.json").write_text(json.dumps(evidence, indent=1))
    assert len(first) == len(second) == len(batches), evidence
    assert not early, evidence
    # Each stage's forward spins on its own stream; pipelining must run them at the same time.
    assert overlap > 0.2 * min(sum(e - s for s, e in first), sum(e - s for s, e in second)), (
        evidence
    )


# ---------------------------------------------------------------------------------------------
# DALI on the GPU (only where DALI and the plugin are present)
# ---------------------------------------------------------------------------------------------


def _dali_or_skip() -> Any:
    pytest.importorskip("nvidia.dali")
    import echopipe

    if not echopipe.build_info()["dali_plugin_built"]:
        pytest.skip("the echopipe DALI plugin was not built (DALI not importable at build time)")
    return pytest.importorskip("echopipe.dali", exc_type=ImportError)


def test_dali_mixed_decode_echo_gpu_augment(tiny_imagenet: Path) -> None:
    _dali_or_skip()
    from echopipe.dali import EchoIterator, LastBatchPolicy
    from echopipe.dali.builders import imagenet_train_pipeline

    pipe = imagenet_train_pipeline(
        tiny_imagenet,
        batch_size=8,
        image_size=24,
        echo_factor=2.0,
        decode_device="mixed",
        device_id=0,
        epochs=1,
        num_threads=2,
        upstream_threads=2,
        seed=0,
    )
    with EchoIterator(pipe, ["data", "label"], last_batch_policy=LastBatchPolicy.PARTIAL) as it:
        batches = list(it)
        stats = it.stats
    # memory="auto" with a mixed decode: the decoded images are echoed from device memory.
    assert pipe.cache.memory_kind == "device"
    images = torch.cat([b[0]["data"] for b in batches])
    assert images.is_cuda
    assert images.shape == (64, 3, 24, 24)  # 32 files, each handed out twice
    assert torch.isfinite(images).all()
    assert stats.fresh == 32 and stats.echoed == 32


def _check_emissions(batches: list[tuple[Any, Any, np.ndarray]], expected: Any) -> dict[int, int]:
    """Every valid emission byte-exact against ``expected(label)``; one label per sample id."""
    label_of: dict[int, int] = {}
    for images, labels, info in batches:
        for i in np.flatnonzero(info[:, 0] == 1):
            label = int(np.array(labels.at(i)).reshape(-1)[0])
            np.testing.assert_array_equal(
                np.array(images.at(i)), expected(label), err_msg=f"sample id {info[i, 1]}"
            )
            # A slot reused under a lease would show another sample under the same id.
            assert label_of.setdefault(int(info[i, 1]), label) == label, info[i]
    assert len(set(label_of.values())) == len(label_of), "two sample ids carry the same sample"
    return label_of


@pytest.mark.parametrize(
    ("memory", "copy"),
    # cudaMemcpyBatchAsync is checked on raw ranges (test_copy_ranges_paths_match_the_cpu):
    # each DALI variant costs two pipeline builds of test_gpu's step budget.
    # "auto": the trace finds the input on the GPU and the cache moves to the device arena.
    [("pinned", "gather"), ("device", "gather"), ("device", "each"), ("auto", "gather")],
)  # fmt: skip
def test_dali_gpu_echo_returns_known_arrays_byte_exact(
    memory: str, copy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Known arrays enter on the GPU, a GPU flip writes them on DALI's stream, the GPU sink
    copies them into the cache (pinned host or device memory) and the GPU source hands them out
    twice (one scatter launch per batch, or a copy per sample): each
    emission must be exactly the flipped array of its label, and each sample id must always be
    the same sample (no copy racing the flip, no stale slot, no image/label mispairing)."""
    _dali_or_skip()
    from nvidia.dali import fn

    import echopipe.dali as edali

    monkeypatch.setenv("ECHOPIPE_GPU_SOURCE_COPY", copy)  # read when the source is built

    @edali.echo_pipeline_def(
        batch_size=8, upstream_batch_size=8, num_threads=2, device_id=0, echo_factor=2.0,
        cache_samples=48, shuffle_buffer=16, seed=1, memory=memory,
    )  # fmt: skip
    def known() -> tuple[Any, Any]:
        images, labels = fn.external_source(
            source=KnownSource(8), num_outputs=2, batch=True, device="gpu", layout=["HWC", ""]
        )
        images = fn.flip(images, horizontal=1)
        images, labels = edali.echo(images, labels)
        return images, labels

    batches = []
    with known() as pipe:
        for _ in range(16):
            outputs, info = pipe.next_batch()
            assert outputs[0].__class__.__name__ == "TensorListGPU"
            batches.append((outputs[0].as_cpu(), outputs[1].as_cpu(), info.copy()))
        assert pipe.cache.memory_kind == ("device" if memory == "auto" else memory)
    label_of = _check_emissions(batches, lambda k: known_image(k)[:, ::-1])
    emissions = np.concatenate([info[info[:, 0] == 1] for _, _, info in batches])
    assert len(emissions) == 16 * 8 and set(emissions[:, 2]) <= {0, 1}
    assert len(label_of) >= 40  # a cache of 48 slots was cycled through, not a few samples


def test_dali_cpu_source_refuses_a_device_cache_in_one_line() -> None:
    """The CPU source would read GPU memory on the host: building it names the cache instead."""
    _dali_or_skip()
    from nvidia.dali import fn

    import echopipe.dali as edali

    @edali.echo_pipeline_def(
        batch_size=4, num_threads=2, device_id=0, echo_factor=2.0, cache_samples=16,
        shuffle_buffer=4, memory="device",
    )  # fmt: skip
    def to_cpu() -> tuple[Any, Any]:
        images, labels = fn.external_source(
            source=KnownSource(4), num_outputs=2, batch=True, device="gpu", layout=["HWC", ""]
        )
        return edali.echo(images, labels, device="cpu")

    message = r"keeps its samples in GPU memory \(memory='device'\)"
    with pytest.raises(RuntimeError, match=message), to_cpu() as pipe:
        pipe.next_batch()


@pytest.fixture(scope="module")
def flat_jpegs(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """16 JPEGs, file i filled with the value 12 * i + 20 (decodes to within a few levels)."""
    root = tmp_path_factory.mktemp("flat_jpegs")
    return solid_jpegs(root, 16, lambda i: (40 + 8 * (i % 3), 48), lambda i: 12 * i + 20)


def test_dali_mixed_decode_echo_keeps_each_image_with_its_label(flat_jpegs: list[str]) -> None:
    """nvJPEG decodes on DALI's stream, the sink copies the decoded image into the cache. A copy
    racing the decode or a stale slot would show pixels of another value (or of no image)."""
    _dali_or_skip()
    from nvidia.dali import fn

    import echopipe.dali as edali

    n = len(flat_jpegs)

    @edali.echo_pipeline_def(
        batch_size=4, num_threads=2, device_id=0, echo_factor=2.0, epochs=1,
        cache_samples=16, shuffle_buffer=4, seed=2,
    )  # fmt: skip
    def decoded(files: list[str]) -> tuple[Any, Any]:
        jpegs, labels = fn.readers.file(
            files=files, labels=list(range(n)), random_shuffle=True, pad_last_batch=True
        )
        images = fn.decoders.image(jpegs, device="mixed")
        images, labels = edali.echo(images, labels.gpu())  # both fields on the GPU sink
        return fn.resize(images, size=(16, 16), interp_type=0), labels  # nearest: no blending

    batches = []
    with decoded(flat_jpegs) as pipe:
        while True:
            try:
                outputs, info = pipe.next_batch()
            except StopIteration:
                break
            batches.append((outputs[0].as_cpu(), outputs[1].as_cpu(), info.copy()))
    first: dict[int, np.ndarray] = {}
    for images, labels, info in batches:
        for i in np.flatnonzero(info[:, 0] == 1):
            image = np.array(images.at(i)).astype(np.int16)
            label = int(np.array(labels.at(i)).reshape(-1)[0])
            assert image.shape == (16, 16, 3)
            assert np.abs(image - (12 * label + 20)).max() <= 4, (label, image.min(), image.max())
            # Both copies of a sample come from one cached decode: byte-identical.
            sid = int(info[i, 1])
            np.testing.assert_array_equal(image, first.setdefault(sid, image))
    emitted = sum(int((info[:, 0] == 1).sum()) for _, _, info in batches)
    assert len(first) == n and emitted == 2 * n
