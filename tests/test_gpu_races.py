"""Race-provoking GPU tests: each wait or hold of the GPU paths is checked by delaying the work
it guards with a spin kernel (~50 ms) on the stream that does it, so that without the wait or
hold the result is visibly wrong, not just occasionally.

* The DALI GPU source keeps its slots leased until its copy has ended: with the copy behind a
  spin (``ECHOPIPE_GPU_TEST_SOURCE_SPIN_US``), e = 1 and a cache of the smallest allowed size,
  every slot given back early would be refilled by the blocked sink before the copy read it.
* The DALI GPU sink commits a slot only after its copy into it has landed: with the sink's copy
  behind a spin (``ECHOPIPE_GPU_TEST_SINK_SPIN_US``), a commit before the sync would let the
  source (on another pipeline's stream, no spin) read the slot's old bytes.
* A CPU batch reaches a stage's compute stream only after the copy stream's copy: the copy is
  queued behind a spin into memory that held a sentinel; a control with the wait removed
  (``DeviceStream.wait`` made a no-op) must read the sentinel.
* A gather on a side stream marks its output as used there (``record_stream``): the output is
  freed right after the (spun) launch and a new tensor allocated; a control with
  ``record_stream`` made a no-op must find the gathered bytes in the new tensor.

The controls run the same code with the wait or hold removed, so the GPU run itself shows that
each test can fail. Everything here skips without a CUDA device; ``bench/gpu/run.sh`` runs it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from pipeline_support.known_samples import KnownSource, known_image

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device (these run for real in bench/gpu/run.sh on a GPU machine)",
)

SPIN_US = 50_000  # the delay queued before the guarded copy
SPIN_CYCLES = 100_000_000  # torch.cuda._sleep: about 50 ms at the H200's ~2 GHz


def _dali_or_skip() -> Any:
    pytest.importorskip("nvidia.dali")
    import echopipe

    if not echopipe.build_info()["dali_plugin_built"]:
        pytest.skip("the echopipe DALI plugin was not built (DALI not importable at build time)")
    return pytest.importorskip("echopipe.dali", exc_type=ImportError)


def _run_echo(memory: str, echo_factor: float, cache_samples: int, steps: int) -> list[Any]:
    """GPU external source -> GPU sink -> GPU source; every output copied to the host."""
    from nvidia.dali import fn

    import echopipe.dali as edali

    @edali.echo_pipeline_def(
        batch_size=8, upstream_batch_size=8, num_threads=2, device_id=0, seed=3,
        echo_factor=echo_factor, cache_samples=cache_samples, shuffle_buffer=8, memory=memory,
    )  # fmt: skip
    def known() -> tuple[Any, Any]:
        images, labels = fn.external_source(
            source=KnownSource(8), num_outputs=2, batch=True, device="gpu", layout=["HWC", ""]
        )
        return edali.echo(images, labels)

    batches = []
    with known() as pipe:
        for _ in range(steps):
            outputs, info = pipe.next_batch()
            batches.append((outputs[0].as_cpu(), outputs[1].as_cpu(), info.copy()))
    return batches


def _assert_every_emission_exact(batches: list[Any]) -> int:
    checked = 0
    for images, labels, info in batches:
        for i in np.flatnonzero(info[:, 0] == 1):
            label = int(np.array(labels.at(i)).reshape(-1)[0])
            np.testing.assert_array_equal(
                np.array(images.at(i)), known_image(label), err_msg=f"sample id {info[i, 1]}"
            )
            checked += 1
    return checked


@pytest.mark.parametrize("memory", ["pinned", "device"])
def test_dali_gpu_source_keeps_its_slots_until_its_copy_ended(
    memory: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """e = 1 and 16 slots (max(shuffle_buffer, batch) + upstream batch, the smallest allowed):
    every slot the source gives back is refilled at once by the sink, which waits for space.
    The source's copy runs 50 ms behind a spin, so a slot given back at launch would be copied
    with the next sample's bytes. (Also the D1 case: two held batches fill the cache.)"""
    _dali_or_skip()
    monkeypatch.setenv("ECHOPIPE_GPU_TEST_SOURCE_SPIN_US", str(SPIN_US))
    batches = _run_echo(memory, echo_factor=1.0, cache_samples=16, steps=12)
    assert _assert_every_emission_exact(batches) == 12 * 8


@pytest.mark.parametrize("memory", ["pinned", "device"])
def test_dali_gpu_sink_commits_only_after_its_copy_landed(
    memory: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sink's copies into the cache run 50 ms behind a spin on the upstream stream; the
    source copies on the downstream stream at once. A commit before the sink's sync would hand
    out slots whose bytes have not arrived (zeros, or an earlier sample's)."""
    _dali_or_skip()
    monkeypatch.setenv("ECHOPIPE_GPU_TEST_SINK_SPIN_US", str(SPIN_US))
    batches = _run_echo(memory, echo_factor=2.0, cache_samples=32, steps=8)
    assert _assert_every_emission_exact(batches) == 8 * 8


@pytest.mark.parametrize("remove_wait", [False, True], ids=["wait", "control-no-wait"])
def test_cpu_batch_is_read_on_the_compute_stream_only_after_its_copy(
    remove_wait: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from echopipe.pipeline.stream import DeviceStream, StreamEvent, transfer

    if remove_wait:
        monkeypatch.setattr(DeviceStream, "wait", lambda self, event: None)
    dev = torch.device("cuda", 0)
    copy, compute = DeviceStream(dev), DeviceStream(dev)
    n = 1 << 20
    src = torch.arange(n, dtype=torch.int32).pin_memory()  # pinned: the copy is truly async
    with copy.use():
        # The block the copy will land in holds a sentinel until the copy writes it.
        torch.full((n,), -1, dtype=torch.int32, device=dev)
        torch.cuda._sleep(SPIN_CYCLES)
    moved = transfer(src, StreamEvent(), copy, compute)
    with compute.use():
        seen = moved.clone()
    compute.synchronize()
    copy.synchronize()
    exact = torch.equal(seen.cpu(), src)
    if remove_wait:
        assert not exact, "the spin did not delay the copy past the read: this test is blind"
    else:
        assert exact


@pytest.mark.parametrize("remove_record", [False, True], ids=["record", "control-no-record"])
def test_gather_output_is_not_reused_while_a_side_stream_writes_it(
    remove_record: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from echopipe.echo import EchoCache

    if remove_record:
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    nbytes = 1 << 20
    cache = EchoCache(
        capacity_bytes=32 << 20, capacity_samples=16, echo_factor=1.0, memory="pinned"
    )
    try:
        cache.put_batch(np.full((16, nbytes), 200, np.uint8))
        samples = cache.take(16, timeout=5)
        out = torch.empty(16 * nbytes, dtype=torch.uint8, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(SPIN_CYCLES)
        cache.gather_to_device(samples, 0, out, stream=side)
        del out, samples
        # Same size, same stream: the caching allocator hands back out's block unless it is
        # marked as still used by the side stream.
        fresh = torch.full((16 * nbytes,), 7, dtype=torch.uint8, device="cuda")
        side.synchronize()
        torch.cuda.synchronize()
        intact = bool((fresh == 7).all())
        if remove_record:
            assert not intact, "the new tensor did not reuse the block: this test is blind"
        else:
            assert intact
    finally:
        cache.close()
