"""Where EchoLoader's output batches live: a wrapped DataLoader's ``pin_memory=True`` carries
over (the training loop's ``.to(device, non_blocking=True)`` counts on pinned batches, as in
pytorch/examples' ImageNet script), an explicit ``pin_memory`` wins, and nothing is pinned
without CUDA. The choice with CUDA is checked through ``pin_choice``'s ``cuda`` argument on any
machine; the pinned take itself (the last test) runs only where CUDA is, as a step of
``bench/gpu/run.sh``."""

from __future__ import annotations

import collections
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from echopipe.torch import EchoLoader
from echopipe.torch.delivery import pin_choice

CUDA = torch.device("cuda", 0)


def _loader(pin: bool) -> DataLoader:
    data = TensorDataset(torch.arange(32, dtype=torch.float32).reshape(16, 2), torch.arange(16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own "no accelerator" warning
        return DataLoader(data, batch_size=4, pin_memory=pin)


@pytest.mark.parametrize(
    ("device", "asked", "loader_pins", "want"),
    [
        (None, None, True, True),  # the DataLoader's pin_memory=True carries over
        (None, None, False, False),
        (CUDA, None, False, True),  # a CUDA device pins, as before
        (None, False, True, False),  # asked not to: not pinned
        (None, True, False, True),
    ],
)
def test_with_cuda_the_wrapped_loaders_pinning_carries_over(device, asked, loader_pins, want):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pin_choice(device, asked, _loader(loader_pins), cuda=True) is want


def test_without_cuda_nothing_is_pinned_and_only_an_explicit_request_warns() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pin_choice(None, None, _loader(True), cuda=False) is False
        assert pin_choice(CUDA, None, _loader(False), cuda=False) is False
    with pytest.warns(RuntimeWarning, match="CUDA is not available"):
        assert pin_choice(None, True, _loader(False), cuda=False) is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case")
def test_a_pinning_dataloader_on_this_machine_gives_plain_batches_silently() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = EchoLoader(_loader(True), echo_factor=2.0)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*no accelerator is found.*")
            batches = list(loader)
        loader.close()
    assert len(batches) == 8 and not any(b[0].is_pinned() for b in batches)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_with_cuda_batches_are_pinned_and_each_async_copy_keeps_its_rows() -> None:
    """pytorch/examples' loop: a DataLoader with ``pin_memory=True``, EchoLoader around it, and
    each batch sent with ``.to(cuda, non_blocking=True)`` while the next ones are taken, with no
    sync until the epoch is over. A batch whose pinned buffer a later take reused would arrive
    with another batch's rows."""
    x = torch.arange(64 * 3 * 8 * 8, dtype=torch.float32).reshape(64, 3, 8, 8)
    y = torch.arange(64)
    data = DataLoader(TensorDataset(x, y), batch_size=8, pin_memory=True)
    sent = []
    with EchoLoader(data, echo_factor=2.0) as el:
        for xb, yb in el:
            assert xb.is_pinned() and yb.is_pinned()
            sent.append((xb.to(CUDA, non_blocking=True), yb.to(CUDA, non_blocking=True)))
    torch.cuda.synchronize()
    seen: collections.Counter = collections.Counter()
    for xd, yd in sent:
        ids = yd.cpu()
        assert torch.equal(xd.cpu(), x[ids])
        seen.update(ids.tolist())
    assert sorted(seen) == list(range(64)) and set(seen.values()) == {2}
