"""A cache, an EchoLoader or an EchoPipeline made before a fork, used in the forked process: a
plain ``os.fork()`` child and real ``DataLoader`` workers of the ``fork`` start method. The
fork's copy is private to it (each worker would hand out the same samples again), so every use
there raises CacheForkedError; the parent's object is untouched, and the child can make its own.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from echopipe.echo import CacheForkedError, EchoCache
from echopipe.native import core
from echopipe.torch import EchoLoader

HANG_S = 60.0  # a child that has not answered by then hangs
FORK = multiprocessing.get_context("fork")


def in_fork(work: Callable[[], Any]) -> Any:
    """Runs ``work`` in an ``os.fork()`` child and returns what it returned (JSON), or raises
    AssertionError with the child's error; a child that hangs is killed and fails the test."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's teardown
        os.close(read_end)
        try:
            answer = {"ok": work()}
        except BaseException as exc:  # anything is the child's answer
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        os.write(write_end, json.dumps(answer).encode())
        os._exit(0)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], HANG_S)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"the forked child did not answer within {HANG_S:g}s")
        chunks = []
        while chunk := os.read(read_end, 1 << 16):
            chunks.append(chunk)
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
    answer = json.loads(b"".join(chunks) or b'{"error": "the child died without answering"}')
    assert "error" not in answer, answer["error"]
    return answer["ok"]


def refused(call: Callable[[], Any]) -> list[Any] | str:
    """In the child: the error's (creator_pid, pid) if ``call`` raised CacheForkedError, else
    what happened instead."""
    try:
        call()
    except CacheForkedError as exc:
        return [exc.creator_pid, exc.pid]
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "allowed"


def test_every_use_of_a_cache_in_a_forked_child_is_refused_and_the_parent_keeps_its_samples():
    cache = EchoCache(capacity_bytes=1 << 20, capacity_samples=16, echo_factor=1.0,
                      name="forked-cache")  # fmt: skip
    cache.put_batch(np.arange(4, dtype=np.int64).reshape(4, 1))

    def child() -> dict[str, Any]:
        out = np.empty((4, 1), dtype=np.int64)

        def set_factor() -> None:
            cache.echo_factor = 3.0

        uses = {
            "take": lambda: cache.take(1, timeout=0),
            "take_batch": lambda: cache.take_batch(1, timeout=0),
            "take_batch_into": lambda: cache.take_batch_into([out], timeout=0),
            "put": lambda: cache.put(np.zeros(1, dtype=np.int64), timeout=0),
            "put_batch": lambda: cache.put_batch(np.zeros((2, 1), dtype=np.int64), timeout=0),
            "wait_for_room": lambda: cache.wait_for_room(1, timeout=0),
            "stats": cache.stats,
            "state_dict": cache.state_dict,
            "end_of_input": cache.end_of_input,
            "echo_factor": set_factor,
            "layouts": lambda: cache.layouts,
            "check_process": lambda: cache.check_process(),
        }
        seen = {name: refused(use) for name, use in uses.items()}
        cache.close()  # allowed: it only lets go of the name here
        # The name is free in the child: a cache of its own works.
        own = EchoCache(capacity_bytes=1 << 20, capacity_samples=16, echo_factor=1.0,
                        name="forked-cache")  # fmt: skip
        own.put(np.array([7], dtype=np.int64))
        got = int(own.take(1)[0].array[0])
        names = core.cache_names()
        own.close()
        return {"seen": seen, "own": got, "names": names, "pid": os.getpid()}

    answer = in_fork(child)
    parent = os.getpid()
    assert answer["seen"] == {name: [parent, answer["pid"]] for name in answer["seen"]}
    assert answer["own"] == 7 and answer["names"] == ["forked-cache"]
    # The child's attempts took nothing from the parent's cache, nor closed or renamed it.
    assert core.find_cache("forked-cache") is not None and not cache.closed
    cache.end_of_input()
    got = sorted(int(s.array[0]) for s in iter(cache))
    assert got == [0, 1, 2, 3]
    cache.close()


class TakesFromCache(Dataset):
    """A dataset whose items come out of an echo cache made in the main process."""

    def __init__(self, cache: EchoCache) -> None:
        self.cache = cache

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.cache.take(1, timeout=HANG_S)[0].torch(0)


def test_dataloader_workers_refuse_a_cache_made_before_the_fork() -> None:
    cache = EchoCache(capacity_bytes=1 << 20, capacity_samples=16, echo_factor=2.0)
    cache.put_batch(np.arange(8, dtype=np.float32).reshape(8, 1))
    loader = DataLoader(TakesFromCache(cache), batch_size=2, num_workers=2,
                        multiprocessing_context=FORK)  # fmt: skip
    with pytest.raises(CacheForkedError, match="is a fork of it"):
        list(loader)
    # Nothing was drawn from the main process's cache: all 16 copies are still in it.
    assert cache.stats().emitted == 0 and cache.stats().tickets_left == 16
    cache.close()


class EchoesInside(IterableDataset):
    """An iterable dataset that hands out the batches of an EchoLoader made in the main process."""

    def __init__(self, loader: EchoLoader) -> None:
        self.loader = loader

    def __iter__(self):
        yield from self.loader


def _echo_loader() -> EchoLoader:
    data = TensorDataset(torch.arange(16, dtype=torch.float32).reshape(16, 1))
    return EchoLoader(DataLoader(data, batch_size=4), echo_factor=2.0)


def test_an_echo_loader_iterated_in_dataloader_workers_is_refused() -> None:
    echo = _echo_loader()
    outer = DataLoader(EchoesInside(echo), batch_size=None, num_workers=2,
                       multiprocessing_context=FORK)  # fmt: skip
    with pytest.raises(CacheForkedError, match="EchoLoader was created in process"):
        list(outer)
    # The main process's loader is untouched: one whole epoch, every sample twice.
    seen = torch.cat([batch[0] for batch in echo]).reshape(-1)
    assert sorted(seen.tolist()) == sorted(list(range(16)) * 2)
    echo.close()


def test_an_echo_loader_started_before_a_fork_is_refused_in_the_child_and_goes_on_in_the_parent():
    echo = _echo_loader()
    it = iter(echo)
    first = next(it)[0]  # the reader thread runs, the cache holds samples

    def child() -> dict[str, Any]:
        uses = {"next": lambda: next(it), "iter": lambda: iter(echo), "state": echo.state_dict}
        seen = {name: refused(use) for name, use in uses.items()}
        echo.close()  # touches nothing of the parent's (its reader, cache and workers)
        return seen

    seen = in_fork(child)
    assert all(isinstance(v, list) and v[0] == os.getpid() for v in seen.values()), seen
    rest = torch.cat([first, *(batch[0] for batch in it)]).reshape(-1)
    assert sorted(rest.tolist()) == sorted(list(range(16)) * 2)
    echo.close()


@pytest.mark.dali
def test_a_dali_pipeline_made_before_a_fork_is_refused_in_the_child(tmp_path) -> None:
    pytest.importorskip("nvidia.dali")
    from nvidia.dali import fn

    import echopipe.dali as edali
    from pipeline_support.jpegs import solid_jpegs

    files = solid_jpegs(tmp_path, 8, lambda i: (12, 16), lambda i: 10 * i)

    @edali.echo_pipeline_def(num_threads=1, device_id=None, batch_size=4, echo_factor=2.0,
                             epochs=None)  # fmt: skip
    def pipe(files):
        jpegs, labels = fn.readers.file(files=files, labels=list(range(8)), pad_last_batch=True)
        images, labels = edali.echo(fn.decoders.image(jpegs, device="cpu"), labels)
        return images, labels

    p = pipe(files)
    p.build()
    p.run()  # running: its upstream thread fills the cache

    def child() -> list[Any] | str:
        return refused(p.run)

    seen = in_fork(child)
    assert isinstance(seen, list) and seen[0] == os.getpid(), seen
    assert len(p.run()[1]) == 4  # the parent's pipeline goes on
    p.close()


def sleeping(thread: threading.Thread) -> bool:
    """Whether ``thread`` sleeps in the kernel now (its state in /proc is S)."""
    with open(f"/proc/self/task/{thread.native_id}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "S"


def test_a_forked_child_lets_go_of_a_cache_a_parent_thread_waits_in() -> None:
    """The child's copy is never destroyed there: a consumer of the parent waited in its
    condition variable, and destroying (or notifying) the copy would wait for that consumer,
    which does not exist in the child, for ever."""
    gc.collect()  # earlier tests' garbage (a DALI pipeline's threads) is not the child's to end
    cache = EchoCache(capacity_bytes=1 << 20, capacity_samples=16, echo_factor=1.0)
    consumer = threading.Thread(target=cache.take, args=(1, HANG_S), daemon=True)
    consumer.start()
    deadline = time.monotonic() + HANG_S
    # Waiting counted, then asleep: in the native take's wait (the GIL is released there).
    while not (cache.stats().takes_waited and sleeping(consumer)):
        assert time.monotonic() < deadline, "the consumer never waited"
        time.sleep(0.01)

    def child() -> str:
        nonlocal cache
        del cache  # the child's last reference to its copy
        gc.collect()
        return "let go"

    assert in_fork(child) == "let go"
    cache.put(np.zeros(1, dtype=np.int64))  # the parent's consumer gets it
    consumer.join(HANG_S)
    assert not consumer.is_alive()
    cache.close()
