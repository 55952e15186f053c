"""Exact echo accounting when the data set, the reader batch and the training batch do not divide.

60 real JPEGs, read in upstream batches that leave a short last one (60 = 3 * 16 + 12), for every
kind of (upstream, downstream) batch-size pair the docs allow: any pair in example mode, and a
downstream batch that is a multiple of the upstream one in batch mode.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("nvidia.dali")
pytestmark = pytest.mark.dali

from nvidia.dali import fn  # noqa: E402

import echopipe.dali as edali  # noqa: E402
from pipeline_support.jpegs import solid_jpegs  # noqa: E402

LBP = edali.LastBatchPolicy
N_FILES = 60


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("jpegs60")
    return solid_jpegs(root, N_FILES, lambda i: (8, 8), lambda i: 4 * i)


def _pipe(files: list[str], **opts):
    @edali.echo_pipeline_def(num_threads=1, device_id=None, epochs=1, seed=5, **opts)
    def pipe():
        jpegs, labels = fn.readers.file(
            files=files, labels=list(range(len(files))), random_shuffle=True, pad_last_batch=True
        )
        images, labels = edali.echo(fn.decoders.image(jpegs), labels)
        return images, labels

    return pipe()


def _raw_stream(pipe) -> list[tuple[np.ndarray, np.ndarray]]:
    """(labels, info) of every real sample of every downstream batch, until the end."""
    out = []
    while True:
        try:
            outputs, info = pipe.next_batch()
        except StopIteration:
            return out
        valid = info[:, 0] == 1
        assert valid[: valid.sum()].all(), "real samples come first, padding after"
        labels = np.array(outputs[1].as_tensor()).reshape(-1)
        out.append((labels[valid], info[valid]))


@pytest.mark.parametrize("batches", [(16, 16), (16, 32), (16, 64)])
def test_batch_echoing_with_a_short_last_unit(files: list[str], batches: tuple[int, int]) -> None:
    up, down = batches
    with _pipe(files, mode="batch", echo_factor=2.0, upstream_batch_size=up, batch_size=down) as p:
        for _ in range(2):  # a second pass after reset() must behave the same
            stream = _raw_stream(p)
            labels = np.concatenate([lab for lab, _ in stream])
            assert Counter(labels.tolist()) == {i: 2 for i in range(N_FILES)}
            # Units come back whole and in put order: consecutive sample ids, 16 or the last 12.
            units = Counter()
            for _, info in stream:
                ids = info[:, 1]
                start = 0
                while start < len(ids):
                    first = ids[start]
                    n = 1
                    while start + n < len(ids) and ids[start + n] == first + n and n < up:
                        n += 1
                    units[n] += 1
                    start += n
            assert units == {up: 2 * (N_FILES // up), N_FILES % up: 2}
            p.reset()


@pytest.mark.parametrize("mode", ["example", "batch"])
@pytest.mark.parametrize("policy", [LBP.FILL, LBP.PARTIAL, LBP.DROP])
def test_every_policy_accounts_for_every_sample(files: list[str], mode: str, policy) -> None:
    opts = dict(upstream_batch_size=16, batch_size=32) if mode == "batch" else {}
    if mode == "example":
        opts = dict(upstream_batch_size=7, batch_size=16)
    pipe = _pipe(files, mode=mode, echo_factor=2.0, **opts)
    with edali.EchoIterator(pipe, ["data", "label"], last_batch_policy=policy) as it:
        labels = [x for b in it for x in b[0]["label"].reshape(-1).tolist()]
        s = it.stats
        assert s.fresh + s.echoed + s.padded == len(labels) == s.samples
        assert s.fresh + s.echoed + s.dropped == 2 * N_FILES  # nothing lost silently
        if policy == LBP.PARTIAL:
            assert Counter(labels) == {i: 2 for i in range(N_FILES)} and s.padded == 0
        if policy == LBP.FILL:
            assert len(labels) % 32 == 0 if mode == "batch" else len(labels) % 16 == 0
            assert s.dropped == 0
        if policy == LBP.DROP:
            assert s.padded == 0 and all(c <= 2 for c in Counter(labels).values())


@pytest.mark.parametrize("batches", [(16, 16), (16, 24), (24, 16), (7, 5), (64, 16)])
def test_example_echoing_for_pairs_that_do_not_divide(
    files: list[str], batches: tuple[int, int]
) -> None:
    up, down = batches
    pipe = _pipe(files, echo_factor=2.0, upstream_batch_size=up, batch_size=down)
    with edali.EchoIterator(pipe, ["data", "label"], last_batch_policy=LBP.PARTIAL) as it:
        labels = [x for b in it for x in b[0]["label"].reshape(-1).tolist()]
    assert Counter(labels) == {i: 2 for i in range(N_FILES)}
    assert pipe.stats().fresh_in == N_FILES


def test_imagenet_builder_batch_echo_one_epoch(tmp_path: Path) -> None:
    from echopipe.data import make_synthetic_imagenet

    root = make_synthetic_imagenet(
        tmp_path / "data", classes=4, per_class=15, size=(24, 24), seed=1, val_per_class=1
    )  # 60 training images
    pipe = edali.imagenet_train_pipeline(
        root, batch_size=16, image_size=16, echo_mode="batch", epochs=1, num_threads=1
    )
    with edali.EchoIterator(pipe, ["data", "label"], last_batch_policy=LBP.PARTIAL) as it:
        seen = sum(len(b[0]["label"]) for b in it)
        assert seen == 2 * 60 == it.stats.samples
        assert it.stats.fresh == 60
