"""The echo source's padding template travels in DALI's checkpoints (``enable_checkpointing=True``).

Shard 0 of 21 files holds 10, so at e = 2 and batch 4 its pass has 20 copies in 5 batches and
owes a padding-only batch to take shard 1's 6 steps; under FILL that batch repeats the first
sample the source drew in the pass. Before, the template was not saved, so a restored source
padded with the first sample it drew after the restore and a resumed deterministic run's last
batch held another file than the uninterrupted run's. Real CPU pipelines over real JPEGs, DALI's
iterator and EchoIterator, both DALI executors. Also: a checkpoint written before the source
saved a state still restores, and a damaged state is refused in one line before DALI sees it.
"""

from __future__ import annotations

import copy
import struct
from collections.abc import Callable

import numpy as np
import pytest
import torch

pytest.importorskip("nvidia.dali")
pytestmark = pytest.mark.dali

from nvidia.dali import fn  # noqa: E402
from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy  # noqa: E402

import echopipe.dali as edali  # noqa: E402
from echopipe.dali import plugin, state_codec  # noqa: E402
from echopipe.dali.state_check import DaliStateError, check_dali_checkpoint  # noqa: E402
from pipeline_support.jpegs import solid_jpegs  # noqa: E402

MAGIC = b"ECHOPIPE-SOURCE-STATE\n"  # (the plugin's kSourceStateMagic, as the tests read it)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("padding_checkpoint")
    return solid_jpegs(root, 21, lambda i: (8, 8), lambda i: 8 * i + 4)


@edali.echo_pipeline_def(num_threads=1)
def echo_pipe(files, gpu):
    jpegs, labels = fn.readers.file(
        files=files, labels=list(range(len(files))), shard_id=0, num_shards=2,
        random_shuffle=True, pad_last_batch=True, stick_to_shard=True, name="Reader",
    )  # fmt: skip
    images = fn.decoders.image(jpegs, device="cpu")
    if gpu:  # the GPU sink and source, whose template lives in device memory
        images, labels = images.gpu(), labels.gpu()
    return edali.echo(images, labels)


def _pipe(files, exec_dynamic: bool = True, gpu: bool = False, **kwargs):
    return echo_pipe(
        files, gpu, batch_size=4, echo_factor=2, seed=3, deterministic=True,
        enable_checkpointing=True, exec_dynamic=exec_dynamic, device_id=0 if gpu else None,
        **kwargs,
    )  # fmt: skip


def _loader(pipe, iterator: str):
    make = DALIGenericIterator if iterator == "dali" else edali.EchoIterator
    return make(
        pipe, ["data", "label"], reader_name="Reader", auto_reset=True,
        last_batch_policy=LastBatchPolicy.FILL,
    )  # fmt: skip


def _host(batch) -> tuple[np.ndarray, np.ndarray]:
    return batch[0]["data"].cpu().numpy().copy(), batch[0]["label"].cpu().numpy().reshape(-1).copy()


def _epochs(loader, epochs: int = 2) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    return [[_host(b) for b in loader] for _ in range(epochs)]


def _saved(files, iterator: str, steps: int, exec_dynamic: bool = True, gpu: bool = False):
    """The first ``steps`` batches and the state saved after them (DALI's ``checkpoints()``
    or ``EchoIterator.state_dict()``)."""
    with _pipe(files, exec_dynamic, gpu) as pipe:
        loader = _loader(pipe, iterator)
        first = [_host(next(loader)) for _ in range(steps)]
        state = loader.checkpoints()[0] if iterator == "dali" else loader.state_dict()
    return first, state


def _resumed(files, iterator: str, state, exec_dynamic: bool = True, gpu: bool = False):
    restored = dict(checkpoint=state) if iterator == "dali" else {}
    with _pipe(files, exec_dynamic, gpu, **restored) as pipe:
        loader = _loader(pipe, iterator)
        if iterator == "echo":
            loader.load_state_dict(state)
        return _epochs(loader)


def _same(a, b) -> bool:
    return len(a) == len(b) and all(
        np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1]) for x, y in zip(a, b, strict=True)
    )


def _check_restore(files, iterator: str, steps: int, exec_dynamic: bool, gpu: bool) -> None:
    with _pipe(files, exec_dynamic, gpu) as pipe:
        whole = _epochs(_loader(pipe, iterator))
    assert [len(epoch) for epoch in whole] == [6, 6]
    padding = whole[0][-1][1]
    assert len(set(padding.tolist())) == 1  # one sample of the pass, four times
    first, state = _saved(files, iterator, steps, exec_dynamic, gpu)
    rest, following = _resumed(files, iterator, state, exec_dynamic, gpu)
    assert _same(first + rest, whole[0])
    assert _same(following, whole[1])


@pytest.mark.parametrize("exec_dynamic", [True, False])
@pytest.mark.parametrize("steps", [1, 4])
@pytest.mark.parametrize("iterator", ["dali", "echo"])
def test_a_deterministic_restore_gives_the_uninterrupted_batches_padding_included(
    files, iterator, steps, exec_dynamic
) -> None:
    _check_restore(files, iterator, steps, exec_dynamic, gpu=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("iterator", ["dali", "echo"])
def test_the_gpu_sources_template_restores_too(files, iterator) -> None:
    """The GPU source keeps its template in device memory: saved through a copy back to the
    host, restored by a copy on its stream before the first draw."""
    if not plugin.gpu_backend_compiled():
        pytest.skip("the plugin was built without its GPU operators")
    _check_restore(files, iterator, 1, exec_dynamic=True, gpu=True)


# ---- the source's entry in the saved DALI checkpoint -----------------------------------------


def _varint(n: int) -> bytes:
    out = b""
    while n > 0x7F:
        out += bytes([n & 0x7F | 0x80])
        n >>= 7
    return out + bytes([n])


def _entry(number: int, data: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _entries(blob: bytes) -> list[tuple[int, bytes]]:
    """The length-delimited fields of a protobuf message (all a DALI checkpoint holds)."""
    out, pos = [], 0
    while pos < len(blob):
        tag = blob[pos]
        size, shift, pos = 0, 0, pos + 1
        while True:
            size |= (blob[pos] & 0x7F) << shift
            pos, shift = pos + 1, shift + 7
            if not blob[pos - 1] & 0x80:
                break
        assert tag & 7 == 2
        out.append((tag >> 3, blob[pos : pos + size]))
        pos += size
    return out


def _source_data(blob: bytes) -> bytes:
    for number, value in _entries(blob):
        op = dict(_entries(value)) if number == 1 else {}
        if op.get(1, b"").startswith(b"__EchopipeEchoSource"):
            return op.get(2, b"")
    raise AssertionError("no echo source in the checkpoint")


def _with_source_data(blob: bytes, change: Callable[[bytes], bytes]) -> bytes:
    out = b""
    for number, value in _entries(blob):
        if number == 1:
            op = dict(_entries(value))
            data = op.get(2, b"")
            if op[1].startswith(b"__EchopipeEchoSource"):
                data = change(data)
            value = _entry(1, op[1]) + (_entry(2, data) if data else b"")
        out += _entry(number, value)
    return out


def _changed(state, iterator: str, change: Callable[[bytes], bytes]):
    """``state`` with the echo source's entry in its downstream DALI checkpoint changed."""
    if iterator == "dali":
        echo_state = state_codec.decode(state)
        echo_state["dali_downstream"] = _with_source_data(echo_state["dali_downstream"], change)
        return state_codec.encode(echo_state)
    state = copy.deepcopy(state)
    pipeline = state["pipeline"]
    pipeline["dali_downstream"] = _with_source_data(pipeline["dali_downstream"], change)
    return state


@pytest.mark.parametrize("iterator", ["dali", "echo"])
def test_a_checkpoint_without_the_sources_state_still_restores(files, iterator) -> None:
    """A checkpoint from before the source saved a state (its entry empty, as a stateless
    operator's) restores as those did: the same real copies, and padding that repeats one file
    of the shard, the first the restored source drew."""
    with _pipe(files) as pipe:
        whole = _epochs(_loader(pipe, iterator))
    first, state = _saved(files, iterator, 2)
    rest, _ = _resumed(files, iterator, _changed(state, iterator, lambda data: b""))
    resumed = first + rest
    assert _same(resumed[:5], whole[0][:5])
    shard = {int(x) for _, labels in whole[0] for x in labels}
    assert len(set(resumed[5][1].tolist())) == 1 and set(resumed[5][1].tolist()) <= shard


def _at(offset: int, value: bytes) -> Callable[[bytes], bytes]:
    start = len(MAGIC) + offset
    return lambda data: data[:start] + value + data[start + len(value) :]


DAMAGE = {  # what a crafted or cut file can hold, and the words of its refusal
    "cut inside the template": (lambda data: data[:-1], "truncated or damaged"),
    "cut inside the extents": (lambda data: data[: len(MAGIC) + 12], "truncated"),
    "a later version": (_at(0, struct.pack("<I", 2)), "format version 2"),
    "a stale flag of 2": (_at(4, b"\x02"), "stale flag is 2"),
    "three fields": (_at(5, b"\x03"), "num_fields=2"),
    "an unknown element type": (_at(6, b"\x63"), "dtype code 99"),
    "nine dimensions": (_at(7, b"\x09"), "at most 8"),
    "a huge extent": (_at(8, struct.pack("<q", 2**62)), "holds more than 2305843009213693952"),
    "a negative extent": (_at(8, struct.pack("<q", -5)), "negative dimension"),
    "a byte after its end": (lambda data: data + b"x", "1 more bytes"),
    "a current template it lacks": (
        lambda data: data[: len(MAGIC) + 4] + b"\x00\x00",
        "marks a padding template as current but holds none",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.parametrize("iterator", ["dali", "echo"])
def test_a_damaged_source_state_is_refused_in_one_line(files, iterator, damage) -> None:
    change, words = DAMAGE[damage]
    _, state = _saved(files, iterator, 2)
    damaged = _changed(state, iterator, change)
    with pytest.raises(DaliStateError, match=words) as refused:
        _resumed(files, iterator, damaged)
    assert "\n" not in str(refused.value)
    assert "'__EchopipeEchoSource" in str(refused.value)


def test_every_cut_of_a_saved_source_state_is_refused(files) -> None:
    """The plugin's decoder (the one DALI's restore runs) on every prefix of a real state:
    refused with a reason once the magic is there, never read past its end."""
    _, state = _saved(files, "echo", 2)
    data = _source_data(state["pipeline"]["dali_downstream"])
    assert data.startswith(MAGIC)
    assert plugin.check_source_state(data, 2) == (True, "")
    for size in range(1, len(data)):
        is_state, reason = plugin.check_source_state(data[:size], 2)
        assert is_state == (size >= len(MAGIC)) and bool(reason) == is_state, size
    blob = _with_source_data(state["pipeline"]["dali_downstream"], lambda d: d[: len(d) // 2])
    with pytest.raises(DaliStateError, match=r"cannot be restored: .* truncated"):
        check_dali_checkpoint(blob, "checkpoint", 2)
