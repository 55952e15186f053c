"""Crafted files that pass every checksum: each is refused in one line, with bounded memory.

A checkpoint's SHA-256 detects damage, but anyone can write a file that passes it. Starting
from a real checkpoint of a real run, each case here changes one thing (a declared size, a
sparse file, a compressed archive member, DALI's reader random-number state, a missing entry, a
weight's shape or dtype, a field's type) and writes a hash-valid file. The reader must refuse
each with one typed error; through the CLI (``echopipe train --resume F``, ``echopipe export F
OUT``) with one line on stderr and exit status 1, in a child process whose address space is
limited, so an over-allocation fails the test instead of the machine. ``EchoLoader`` states are
fuzzed: always the one exception type, and the loader unchanged after a refused load.
"""

from __future__ import annotations

import copy
import io
import os
import random
import resource
import stat
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from echopipe.dali import state_codec
from echopipe.dali.torch_copy import tensors_as_arrays
from echopipe.filecheck import FileCheckError, check_tree, read_npz
from echopipe.pipeline.checkpoint import CheckpointFileError, atomic_save, load_file
from echopipe.torch import EchoLoader
from echopipe.torch.loader_state import LoaderStateError
from echopipe.training.checkpoints import (
    CHECKPOINT_MAGIC,
    CheckpointError,
    RunCheckpoints,
    read_checkpoint,
    write_checkpoint,
)

pytest.importorskip("nvidia.dali")
pytestmark = pytest.mark.dali

LIMIT = 1792 << 20
"""Address-space limit of the CLI children: an ``echopipe`` process with its modules loaded
takes about 1.0 GB, so an allocation of 1 GiB from a file's declared figure fails there."""

TINY = ["--batch-size", "8", "--image-size", "32", "--no-progress", "--warmup-epochs", "0"]
RUN = [*TINY, "--epochs", "1", "--stages", "2", "--echo", "auto"]


def _env() -> dict[str, str]:
    import echopipe

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(echopipe.__file__).parent.parent), env.get("PYTHONPATH", "")]
    )
    return env


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``echopipe ARGS`` in a child limited to :data:`LIMIT` bytes of address space; the
    timeout only guards against a hang (DALI's restore spun forever on a bad reader state)."""
    return subprocess.run(
        [sys.executable, "-m", "echopipe.cli", *args],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_limit,
    )


def _one_line_failure(done: subprocess.CompletedProcess[str], *needles: str) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 1, done.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert lines[0].startswith("echopipe ") and ": error: " in lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def base(tiny_imagenet: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``last.pt`` of a real two-stage run with the echo controller (2 steps)."""
    out = tmp_path_factory.mktemp("base_run")
    done = subprocess.run(
        [sys.executable, "-m", "echopipe.cli", "train", "--data", str(tiny_imagenet), *RUN,
         "--max-steps", "2", "--output", str(out)],
        env=_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return out / "checkpoints" / "last.pt"


def _state(base: Path) -> dict[str, Any]:
    return copy.deepcopy(read_checkpoint(base))


def _with_header(payload: bytes) -> bytes:
    import hashlib

    digest = hashlib.sha256(payload).hexdigest()
    return CHECKPOINT_MAGIC + f"sha256 {digest} {len(payload)}\n".encode() + payload


def _saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _deflated(payload: bytes) -> bytes:
    """The same torch.save archive with every member deflated (torch reads it all the same)."""
    src = zipfile.ZipFile(io.BytesIO(payload))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    return out.getvalue()


# ---- DALI's checkpoint, edited at the protobuf level ------------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, pos


def _parse(data: bytes) -> list[tuple[int, int, Any]]:
    out, pos = [], 0
    while pos < len(data):
        tag, pos = _read_varint(data, pos)
        value, pos = _read_varint(data, pos)
        if tag & 7 == 2:
            out.append((tag >> 3, 2, data[pos : pos + value]))
            pos += value
        else:
            out.append((tag >> 3, 0, value))
    return out


def _encode(fields: list[tuple[int, int, Any]]) -> bytes:
    out = b""
    for number, wire, value in fields:
        out += _varint(number << 3 | wire)
        out += _varint(len(value)) + value if wire == 2 else _varint(value)
    return out


def _with_reader_rng(blob: bytes, rng: bytes) -> bytes:
    """DALI checkpoint ``blob`` with the reader's random-number state replaced by ``rng``."""
    ops = []
    for number, wire, value in _parse(blob):
        op = _parse(value) if number == 1 else None
        if op and op[0][2] == b"Reader":
            snapshots = [
                (1, 2, _encode([(1, 2, rng), *_parse(s)[1:]])) for _, _, s in _parse(op[1][2])
            ]
            value = _encode([op[0], (2, 2, _encode(snapshots))])
        ops.append((number, wire, value))
    return _encode(ops)


# ---- the train checkpoint ------------------------------------------------------------------


def test_the_real_checkpoint_reads_and_exports_under_the_limit(base: Path, tmp_path: Path) -> None:
    """The control: a real checkpoint passes every check, also in a limited child."""
    state = read_checkpoint(base)
    assert state["model"]["name"] == "resnet_small" and state["controller"] is not None
    done = _cli("export", str(base), str(tmp_path / "w.pt"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "w.pt").is_file()


def test_the_address_space_limit_fails_a_one_gib_allocation() -> None:
    """The limit the CLI cases run under is tight enough to catch an over-allocation: with
    what the CLI imports loaded, 1 GiB more does not fit."""
    code = (
        "import echopipe.cli, echopipe.training.trainer, echopipe.dali.state_check, torch\n"
        "torch.empty(1 << 30, dtype=torch.uint8).fill_(1)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True,
                          text=True, timeout=300, preexec_fn=_limit)  # fmt: skip
    assert done.returncode != 0 and "memory" in done.stderr.lower(), done.stderr[-500:]


def _craft(base: Path, tmp_path: Path, case: str) -> Path:
    """A hash-valid file of the named class (see the parametrisation below)."""
    path = tmp_path / f"{case}.pt"
    raw = base.read_bytes()
    payload = raw[raw.index(b"\n", len(CHECKPOINT_MAGIC)) + 1 :]
    if case == "huge-declared-size":
        head = CHECKPOINT_MAGIC + f"sha256 {'0' * 64} {50 << 30}\n".encode()
        path.write_bytes(head + payload[:1000])
    elif case == "sparse-file":
        head = CHECKPOINT_MAGIC + f"sha256 {'0' * 64} {(50 << 30) - 100}\n".encode()
        with open(path, "wb") as f:
            f.write(head)
            f.truncate(50 << 30)
    elif case == "compression-bomb":
        bomb = {"kind": "echopipe-train", "x": torch.zeros(64 << 20, dtype=torch.uint8)}
        path.write_bytes(_with_header(_deflated(_saved(bomb))))
    elif case == "stride-0-view":
        view = torch.zeros(1, dtype=torch.uint8).expand(1 << 30)
        path.write_bytes(_with_header(_saved({"kind": "echopipe-train", "blob": {
            "__echopipe_codec__": "bytes", "data": view}})))  # fmt: skip
    elif case == "shared-references":
        tree: Any = list(range(64))
        for _ in range(5):
            tree = [tree] * 64
        path.write_bytes(_with_header(_saved({"kind": "echopipe-train", "x": tree})))
    else:
        state = _state(base)
        {**_EDITS, **_LATE, **_AT_EXPORT}[case](state)
        write_checkpoint(state, path)
    return path


def _set(*keys: str, value: Any):
    def edit(state: dict[str, Any]) -> None:
        target = state
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value

    return edit


def _reader_rng(rng: bytes):
    def edit(state: dict[str, Any]) -> None:
        pipe = state["input"]["pipeline"]
        pipe["dali_upstream"] = _with_reader_rng(pipe["dali_upstream"], rng)

    return edit


def _stage_weight(change):
    def edit(state: dict[str, Any]) -> None:
        stage = state["pipeline"]["stages"][0]
        key = next(k for k, v in stage.items() if v.dim() == 4)
        stage[key] = change(stage[key])

    return edit


def _rename_first_weight(state: dict[str, Any], block: str) -> None:
    stage = state["pipeline"]["stages"][0]
    key = next(iter(stage))
    stage[block + key[key.index(".") :]] = stage.pop(key)


def _momentum(state: dict[str, Any]) -> None:
    entry = next(iter(state["pipeline"]["optimizers"][0]["state"].values()))
    entry["momentum_buffer"] = torch.zeros(3, 3)


_EDITS = {
    "dali-reader-rng-0": _reader_rng(b"0"),
    "dali-reader-rng-empty": _reader_rng(b""),
    "missing-config": lambda s: s.pop("config"),
    "config-missing-an-option": lambda s: s["config"].pop("lr"),
    "weight-wrong-shape": _stage_weight(lambda t: torch.zeros(t.shape[0] + 1, *t.shape[1:])),
    "weight-wrong-dtype": _stage_weight(lambda t: t.double()),
    "momentum-wrong-shape": _momentum,
    "huge-class-count": _set("model", "num_classes", value=10**9),
    "class-count-not-the-weights": _set("model", "num_classes", value=1000),
    "epoch-as-text": _set("run", "epoch", value="3"),
    "negative-steps": _set("pipeline", "steps_fed", value=-1),
    "balance-not-covering": _set("pipeline", "balance", value=[1, 1]),
    "rng-wrong-size": _set("rng", "torch", value=torch.zeros(7, dtype=torch.uint8)),
    "echo-factor-nan": _set("input_factor", value=float("nan")),
    "controller-as-text": _set("controller", value="auto"),
    "controller-pause-negative": _set("controller", "pauses", value=[0.1, -1.0]),
    "controller-pauses-past-the-window": _set("controller", "pauses", value=[0.1] * 10**6),
    "scheduler-lambda-state": _set(
        "pipeline",
        "schedulers",
        value=[{"base_lrs": [0.1], "last_epoch": 1, "lr_lambdas": [{"x": 1}]}] * 2,
    ),
    "step-past-the-epoch": _set("run", "step_in_epoch", value=10**6),
    "dali-pipeline-data": _set("input", "pipeline", "dali_downstream", value=b"\x12\x00"),
    "cache-as-list": _set("input", "pipeline", "cache", value=[1, 2]),
}
_LATE = {"cache-truncated": lambda s: s["input"]["pipeline"].update(cache=b"\x00" * 64)}
"""Cases only the running pipeline can refuse: the cache's own format (checked at resume, on a
scratch cache, before training)."""
_AT_EXPORT = {"weight-name-unicode-digit": lambda s: _rename_first_weight(s, "\u00b2")}
"""Cases the export's weight names check refuses ('²'.isdigit() is True, int('²') raises)."""
_CONTAINER = [
    "huge-declared-size", "sparse-file", "compression-bomb", "stride-0-view", "shared-references",
]  # fmt: skip


@pytest.mark.parametrize("case", _CONTAINER + list(_EDITS))
def test_crafted_checkpoint_is_refused_by_the_reader(base: Path, tmp_path: Path, case: str) -> None:
    path = _craft(base, tmp_path, case)
    with pytest.raises(CheckpointError) as info:
        read_checkpoint(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message


def test_dali_reader_state_check_passes_the_real_state_and_names_the_bad_one(
    base: Path, tmp_path: Path
) -> None:
    """The DALI check is specific: the real reader state passes, "0" and "" are named."""
    blob = _state(base)["input"]["pipeline"]["dali_upstream"]
    assert _with_reader_rng(blob, b"12345") != blob
    state = _state(base)
    _reader_rng(b"12345")(state)
    write_checkpoint(state, tmp_path / "ok.pt")
    read_checkpoint(tmp_path / "ok.pt")
    for rng in (b"0", b"", b"2147483647", b"x1"):
        state = _state(base)
        _reader_rng(rng)(state)
        write_checkpoint(state, tmp_path / "bad.pt")
        with pytest.raises(CheckpointError, match="random-number state"):
            read_checkpoint(tmp_path / "bad.pt")


_CLI_CASES = [
    "huge-declared-size", "sparse-file", "compression-bomb", "dali-reader-rng-0",
    "dali-reader-rng-empty", "missing-config", "weight-wrong-shape", "huge-class-count",
    "epoch-as-text", "step-past-the-epoch", "cache-truncated",
]  # fmt: skip


@pytest.mark.parametrize("case", _CLI_CASES)
def test_crafted_checkpoint_through_train_resume_is_one_line(
    base: Path, tmp_path: Path, tiny_imagenet: Path, case: str
) -> None:
    path = _craft(base, tmp_path, case)
    out = tmp_path / "resumed"
    done = _cli("train", "--data", str(tiny_imagenet), *RUN, "--resume", str(path),
                "--output", str(out))  # fmt: skip
    _one_line_failure(done, str(path))
    assert not (out / "checkpoints").exists()


def test_resume_on_data_with_another_class_count_is_one_line(base: Path, tmp_path: Path) -> None:
    """A checkpoint of a 4-class model whose options name a folder of 3 classes: named before
    the model is built (it was a shape-mismatch traceback from load_state_dict)."""
    from echopipe.data import make_synthetic_imagenet

    data = make_synthetic_imagenet(
        tmp_path / "data3", classes=3, per_class=4, size=(32, 48), seed=1, val_per_class=1
    )
    state = _state(base)
    state["config"]["data"] = str(data)
    path = write_checkpoint(state, tmp_path / "three.pt")
    done = _cli("train", "--data", str(data), *RUN, "--resume", str(path),
                "--output", str(tmp_path / "resumed"))  # fmt: skip
    _one_line_failure(done, "4 classes", "3")


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (_set("config", "data", value=123), "the checkpoint's --data must be a path, got 123"),
        (_set("config", "devices", value=[1]), "the checkpoint's --devices [1]: give e.g. cpu"),
        (_set("options", "workers", value=0), "the checkpoint's --workers must be >= 1, got 0"),
        (
            _set("config", "channels_last", value="yes"),
            "the checkpoint's --channels-last must be on or off (a bool), got 'yes'",
        ),
    ],
)
def test_a_checkpoint_option_its_own_check_refuses_is_one_line_on_resume(
    base: Path, tmp_path: Path, edit: Any, needle: str
) -> None:
    """Plain values of the wrong kind pass the reader's type check; the resume puts each option
    it takes from the checkpoint through that option's check (they were TypeErrors in the run)."""
    state = _state(base)
    edit(state)
    path = write_checkpoint(state, tmp_path / "bad.pt")
    done = _cli("train", "--resume", str(path), "--output", str(tmp_path / "resumed"))
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith(f"echopipe train: error: --resume {str(path)!r}: "), lines[0]
    assert needle in lines[0], lines[0]


@pytest.mark.parametrize("case", ["sparse-file", "compression-bomb", "weight-wrong-dtype",
                                  "huge-class-count", "missing-config", *_AT_EXPORT])  # fmt: skip
def test_crafted_checkpoint_through_export_is_one_line(base: Path, tmp_path: Path, case: str):
    path = _craft(base, tmp_path, case)
    out = tmp_path / "w.pt"
    _one_line_failure(_cli("export", str(path), str(out)), str(path))
    assert not out.exists()


def test_export_onto_its_own_checkpoint_is_refused(base: Path, tmp_path: Path) -> None:
    path = tmp_path / "last.pt"
    path.write_bytes(base.read_bytes())
    done = _cli("export", str(path), str(tmp_path / "." / "last.pt"))
    assert done.returncode == 2 and "is CKPT itself" in done.stderr, done.stderr[-2000:]
    assert path.read_bytes() == base.read_bytes()  # the training checkpoint is untouched


def test_export_never_replaces_a_fifo_or_a_device(base: Path, tmp_path: Path) -> None:
    """The write replaces OUT, so an OUT that is there and not a regular file is refused in one
    line and left as it was (as root, export replaced /dev/null with the weights)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    outs = [fifo]
    try:
        os.mknod(tmp_path / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        outs.append(tmp_path / "null")
    except PermissionError:
        pass  # not root: the FIFO alone
    for out in outs:
        mode = out.lstat().st_mode
        done = _cli("export", str(base), str(out))
        assert done.returncode == 2, done.stderr[-2000:]
        assert f"OUT {str(out)!r} is not a regular file" in done.stderr, done.stderr[-2000:]
        assert out.lstat().st_mode == mode


def test_an_echo_value_error_stays_one_short_line() -> None:
    from echopipe.echo import EchoConfigError

    error = EchoConfigError("echo_factor", "9" * 1_000_000, "a number in [1, 65535]")
    assert len(str(error)) < 200 and "\n" not in str(error) and str(error).endswith("...")


# ---- the DALI route (EchoPipeline(checkpoint=...)) -------------------------------------------


def _dali_blob(base: Path, edit=None) -> bytes:
    # The iterator's state holds the pipeline's arrays as tensors (for weights_only loads)
    state = tensors_as_arrays(_state(base)["input"]["pipeline"])
    state["iterator_data"] = ""
    if edit is not None:
        edit(state)
    return state_codec.encode(state)


def _reader_rng_in_pipeline(rng: bytes):
    def edit(state: dict[str, Any]) -> None:
        state["dali_upstream"] = _with_reader_rng(state["dali_upstream"], rng)

    return edit


def test_dali_route_refuses_bad_reader_state_and_compressed_members(base: Path) -> None:
    good = _dali_blob(base)
    assert state_codec.decode(good)["version"] == 2
    for rng in (b"0", b""):
        bad = _dali_blob(base, _reader_rng_in_pipeline(rng))
        with pytest.raises(ValueError, match="random-number state"):
            state_codec.decode(bad)
    # The archive's members deflated: a compressed member could inflate without bound.
    body = good[len(state_codec.MAGIC) :]
    with pytest.raises(ValueError, match="compressed"):
        state_codec.decode(state_codec.MAGIC + _deflated(body))


def test_npy_header_declaring_more_than_its_member_is_refused() -> None:
    buf = io.BytesIO()
    np.savez(buf, a=np.zeros(4, np.uint8))
    assert read_npz(buf.getvalue())["a"].tolist() == [0, 0, 0, 0]
    # The header's shape says (1 << 40,): reading it would allocate a terabyte.
    member = zipfile.ZipFile(io.BytesIO(buf.getvalue())).read("a.npy")
    crafted = member.replace(b"'shape': (4,), ", b"'shape': (1099511627776,), ")
    assert crafted != member
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        dst.writestr("a.npy", crafted)
    with pytest.raises(FileCheckError, match="declares shape"):
        read_npz(out.getvalue())
    # Negative dimensions whose product is the member's size: refused, not a bare reshape error.
    negative = member.replace(b"'shape': (4,), ", b"'shape': (-2, -2), ").replace(
        b"    \n", b"\n", 1
    )
    assert len(negative) == len(member)  # the header keeps its length: only the shape differs
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        dst.writestr("a.npy", negative)
    with pytest.raises(FileCheckError, match="declares shape"):
        read_npz(out.getvalue())


def test_export_check_refuses_a_state_dict_the_model_does_not_load(tmp_path: Path) -> None:
    from echopipe.models import build_model
    from echopipe.training.checkpoints import check_export

    model = {"name": "lenet5", "num_classes": 3}
    good = build_model("lenet5", num_classes=3).state_dict()
    torch.save(good, tmp_path / "good.pt")
    check_export(tmp_path / "good.pt", model)
    torch.save({k: v[:1] for k, v in good.items()}, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError, match="does not load into lenet5"):
        check_export(tmp_path / "bad.pt", model)


def test_tree_budget_counts_repeated_references() -> None:
    leaf = list(range(100))
    check_tree([leaf] * 10, budget=10_000)
    with pytest.raises(FileCheckError):
        check_tree([[leaf] * 100] * 100, budget=10_000)


# ---- stage checkpoints and the run folder --------------------------------------------------


def test_stage_checkpoint_files_are_read_bounded(tmp_path: Path) -> None:
    atomic_save({"format": 1, "w": torch.ones(3)}, tmp_path / "ok.pt")
    assert torch.equal(load_file(tmp_path / "ok.pt")["w"], torch.ones(3))
    (tmp_path / "bomb.pt").write_bytes(_deflated(_saved({"w": torch.zeros(1 << 20)})))
    with pytest.raises(CheckpointFileError, match="compressed"):
        load_file(tmp_path / "bomb.pt")
    with open(tmp_path / "sparse.pt", "wb") as f:
        f.truncate(50 << 30)
    with pytest.raises(CheckpointFileError, match="sparse"):
        load_file(tmp_path / "sparse.pt")
    os.mkfifo(tmp_path / "fifo.pt")
    with pytest.raises(CheckpointFileError, match="not a regular file"):
        load_file(tmp_path / "fifo.pt")


def test_planted_checkpoints_link_is_refused(tiny_imagenet: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(outside, target_is_directory=True)
    with pytest.raises(CheckpointError, match="symbolic link"):
        RunCheckpoints(run / "checkpoints", root=run)
    # A planted last.pt link inside a real checkpoints/ folder is not followed either.
    other = tmp_path / "other"
    (other / "checkpoints").mkdir(parents=True)
    (other / "checkpoints" / "last.pt").symlink_to(outside / "elsewhere.pt")
    with pytest.raises(CheckpointError, match="symbolic link"):
        RunCheckpoints(other / "checkpoints", root=other)
    RunCheckpoints(tmp_path / "fine" / "checkpoints", root=tmp_path / "fine")  # nothing there yet
    done = _cli("train", "--data", str(tiny_imagenet), *RUN, "--max-steps", "1",
                "--output", str(run))  # fmt: skip
    _one_line_failure(done, "symbolic link")
    assert list(outside.iterdir()) == []


# ---- EchoLoader.load_state_dict ------------------------------------------------------------


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.arange(i * 8, i * 8 + 8).float().view(8, 1), torch.arange(i * 8, i * 8 + 8))
            for i in range(6)]  # fmt: skip


def _loader_states() -> list[dict[str, Any]]:
    """A state between epochs and one mid-epoch, of a fixed and an auto loader."""
    states = []
    for factor in (2.0, "auto"):
        with EchoLoader(_batches(), factor, seed=1) as el:
            list(el)
            states.append(el.state_dict())
            it = iter(el)
            next(it)
            next(it)
            states.append(el.state_dict())
    return states


_JUNK = [None, "x", -1, 1.5, 2**70, float("nan"), [], {}, b"\x00", True, [1, 2], (0, 1)]


def _mutations(state: dict[str, Any], rng: random.Random):
    """Malformed copies of ``state``: a field removed, replaced by junk, or nested junk."""
    for key in state:
        bad = dict(state)
        del bad[key]
        yield bad
        for junk in _JUNK:
            bad = copy.deepcopy(state)
            bad[key] = junk
            yield bad
    for _ in range(60):
        bad = copy.deepcopy(state)
        key = rng.choice(["totals", "cache_config", "echo_history", "controller"])
        inner = bad[key]
        if isinstance(inner, dict) and inner:
            inner[rng.choice(sorted(inner))] = rng.choice(_JUNK)
        elif isinstance(inner, list) and inner:
            inner[rng.randrange(len(inner))] = rng.choice(_JUNK)
        yield bad
    if state["mid_epoch"]:
        yield dict(state, batches_done=7)  # past the wrapped loader's 6 batches
    if state["cache"]:
        for cut in (0, 1, len(state["cache"]) // 2, len(state["cache"]) - 1):
            bad = dict(state, cache=state["cache"][:cut])
            yield bad


def _epoch_after(state: dict[str, Any]) -> list[int]:
    """Labels one epoch delivers after restoring ``state`` into a new loader."""
    auto = state["controller"] is not None
    with EchoLoader(_batches(), "auto" if auto else 2.0, seed=1) as el:
        el.load_state_dict(state)
        return sorted(y for _, labels in el for y in labels.tolist())


@pytest.mark.filterwarnings("ignore::echopipe.torch.FactorReplacedWarning")  # a mutated factor
def test_echo_loader_load_state_dict_fuzz_is_all_or_nothing() -> None:
    rng = random.Random(0)
    refused = 0
    for state in _loader_states():
        auto = state["controller"] is not None
        expected = _epoch_after(state)
        with EchoLoader(_batches(), "auto" if auto else 2.0, seed=1) as el:
            el.load_state_dict(state)
            before = el.state_dict()
            for bad in _mutations(state, rng):
                try:
                    el.load_state_dict(bad)
                except LoaderStateError:
                    refused += 1
                    assert el.state_dict() == before
                else:
                    el.load_state_dict(state)  # a harmless change: back to the reference
            # After every refusal the loader goes on exactly as the reference state says.
            assert sorted(y for _, labels in el for y in labels.tolist()) == expected
    assert refused >= 185
