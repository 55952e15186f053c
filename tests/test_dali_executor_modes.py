"""DALI's executor options reach both pipelines of an ``echo_pipeline_def`` pipeline
(docs/dali.md: "any other ``nvidia.dali.Pipeline`` argument"): with ``exec_pipelined=False``
DALI's first ``schedule_run()`` runs one iteration, not the whole prefetch queue, and with
``exec_async=False`` every run happens inside ``schedule_run()`` and needs a free output buffer.
Epoch after epoch must still hold each file e times, under DALI's iterators and EchoIterator."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("nvidia.dali")
pytestmark = pytest.mark.dali

_PROGRAM = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from collections import Counter
    from nvidia.dali import fn
    from nvidia.dali.plugin.pytorch import DALIClassificationIterator, LastBatchPolicy
    import echopipe.dali as edali
    sys.path.insert(0, {support!r})
    from pipeline_support.jpegs import solid_jpegs

    files = solid_jpegs(Path({root!r}), 12, lambda i: (10, 12), lambda i: 20 * i)

    @edali.echo_pipeline_def(echo_factor=2, exec_pipelined={pipelined}, exec_async={run_async})
    def train_pipe(files):
        jpegs, labels = fn.readers.file(files=files, labels=list(range(len(files))),
                                        random_shuffle=True, pad_last_batch=True, name="Reader")
        images = fn.decoders.image(jpegs, device="cpu")
        images, labels = edali.echo(images, labels)
        return fn.resize(images, size=(8, 8)), labels

    pipe = train_pipe(files, batch_size=4, num_threads=1, device_id=None, seed=3)
    if {dali_iterator}:
        it = DALIClassificationIterator(pipe, reader_name="Reader", auto_reset=True,
                                        last_batch_policy=LastBatchPolicy.PARTIAL)
    else:
        it = edali.EchoIterator(pipe, reader_name="Reader", auto_reset=True,
                                last_batch_policy=LastBatchPolicy.PARTIAL)
    for epoch in range(3):
        labels = [int(v) for batch in it for v in batch[0]["label"].reshape(-1)]
        print("epoch", epoch, len(labels), sorted(Counter(Counter(labels).values()).items()),
              flush=True)
    """
)


@pytest.mark.parametrize("dali_iterator", [True, False], ids=["dali_iterator", "echo_iterator"])
@pytest.mark.parametrize(
    "pipelined,run_async", [(False, True), (False, False), (True, False)],
    ids=["not_pipelined", "synchronous", "pipelined_synchronous"],
)  # fmt: skip
def test_every_epoch_under_dali_executor_options(
    tmp_path, pytestconfig, dali_iterator: bool, pipelined: bool, run_async: bool
) -> None:
    # A child process: the failures this guards against are a hang inside DALI's
    # schedule_run() and empty epochs.
    program = _PROGRAM.format(
        support=str(pytestconfig.rootpath / "tests"), root=str(tmp_path),
        pipelined=pipelined, run_async=run_async, dali_iterator=dali_iterator,
    )  # fmt: skip
    try:
        done = subprocess.run(
            [sys.executable, "-c", program], capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the pipeline hung; it printed: {exc.stdout!r}")
    assert done.returncode == 0, done.stderr[-2000:]
    epochs = [line for line in done.stdout.splitlines() if line.startswith("epoch")]
    assert epochs == [f"epoch {k} 24 [(2, 12)]" for k in range(3)], done.stdout
