"""Ctrl-C over an EchoLoader whose wrapped loader reads its DataLoader iterator inside a
generator (timm's ``MultiEpochsDataLoader``: one iterator made in ``__init__`` for the loader's
life; a ``PrefetchLoader``-like wrapper): the interrupted epoch wakes that iterator's wait once
its workers died, as ``tests/test_echo_loader_shutdown.py`` checks for the direct iterator."""

from __future__ import annotations

import os
import signal
import time
import warnings

import pytest
from torch.utils.data import DataLoader

from echopipe.torch import EchoLoader
from test_echo_loader_shutdown import HANG_S, Child, Gate, children, gone


class OneIterator(DataLoader):
    """timm's ``MultiEpochsDataLoader`` mechanics: one multi-process iterator for the loader's
    life, ``len(self)`` batches of it per pass, taken inside a generator."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.iterator = super().__iter__()

    def __iter__(self):
        for _ in range(len(self)):
            yield next(self.iterator)


class Prefetch:
    """A wrapper that reads its loader's iterator kept in a local of its generator."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        it = iter(self.loader)
        while True:
            try:
                batch = next(it)
            except StopIteration:
                return
            yield batch


class ForLoop(Prefetch):
    """timm's ``PrefetchLoader`` shape: the iterator lives only in its ``for`` loop (on the
    generator frame's value stack, which Python does not show)."""

    def __iter__(self):
        for x, i, pid in self.loader:  # as timm's: for next_input, next_target in self.loader
            yield x.float(), i, pid  # (timm's moves and normalises)


def interrupt_with_dead_workers(el: EchoLoader, before: set[int]) -> object:
    """Iterates ``el`` until the reader waits for a batch its held workers make, kills the
    workers with SIGINT (a terminal's Ctrl-C) and raises KeyboardInterrupt in the "step"."""
    producer = None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # also "did not return within close_timeout"
        try:
            for _batch in el:
                producer = el._shared.producer
                deadline = time.monotonic() + HANG_S
                while el.stats().fresh_batches_epoch < 2:  # then waits for batch 2, held
                    assert time.monotonic() < deadline, "the reader did not read 2 batches"
                    time.sleep(0.01)
                workers = children() - before
                assert len(workers) == 2
                for pid in workers:
                    os.kill(pid, signal.SIGINT)
                assert all(gone(pid) for pid in workers)
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            pass
    return producer


@pytest.mark.parametrize("shape", ["one_iterator", "prefetch", "for_loop"])
def test_an_interrupt_inside_a_generator_does_not_wait_for_torchs_worker_check(shape) -> None:
    """Without the wake the reader, inside the generator's ``next()`` of the DataLoader
    iterator, returns only at torch's 5 s worker check, with its "exited unexpectedly" error,
    which this test rules out (no clock: the error tells which way the wait ended)."""
    before = children()
    kind = OneIterator if shape == "one_iterator" else DataLoader
    dl = kind(Gate(64, hold=16), batch_size=8, num_workers=2)
    wrap = {"one_iterator": lambda d: d, "prefetch": Prefetch, "for_loop": ForLoop}[shape]
    el = EchoLoader(wrap(dl), 2.0, shuffle_buffer=16)
    producer = interrupt_with_dead_workers(el, before)
    assert producer is not None and not producer.is_alive()
    error = producer.error
    cause = error.__cause__ if error is not None else None
    assert not (isinstance(cause, RuntimeError) and "exited unexpectedly" in str(cause)), (
        "the interrupted reader waited for torch's worker check"
    )
    el.close()


def test_ctrl_c_over_a_multi_epochs_loader_ends_the_program_promptly() -> None:
    """The timed check (a bound on the exit time, generous for a loaded machine): a terminal's
    Ctrl-C over a ``MultiEpochsDataLoader``-shaped loader (``shutdown_program.py ... timmrun``)
    took 6.5 s to exit, waiting for torch's 5 s worker check; the plain DataLoader 1-3 s."""
    child = Child("echo", False, "timmrun")
    child.wait_for("running")
    signalled = time.monotonic()
    os.killpg(child.proc.pid, signal.SIGINT)
    status = child.finish()
    took = time.monotonic() - signalled
    err = child.stderr()
    assert status == -signal.SIGINT, err
    assert err.count("Traceback") == 1 and err.rstrip().endswith("KeyboardInterrupt"), err
    assert "Warning" not in err, err
    assert child.workers and all(gone(p) for p in child.workers)
    assert took < 4.0, f"{took:.1f}s from Ctrl-C to the end (torch's worker check is 5 s)"
