"""The labelled-file echo pipeline the DALI route tests share: a file reader whose label is each
file's index (named ``Reader``, shuffled, its last batch padded), CPU decode, ``echo()``, then a
random flip (augmentation after the echo point). Import after ``pytest.importorskip``."""

from __future__ import annotations

from nvidia.dali import fn

import echopipe.dali as edali


@edali.echo_pipeline_def(echo_factor=2)
def labelled_flip_pipe(files):
    jpegs, labels = fn.readers.file(
        files=files, labels=list(range(len(files))), random_shuffle=True, pad_last_batch=True,
        name="Reader",
    )  # fmt: skip
    images, labels = edali.echo(fn.decoders.image(jpegs, device="cpu"), labels)
    return fn.flip(images, horizontal=fn.random.coin_flip()), labels
