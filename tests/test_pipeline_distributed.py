"""DistributedStalePipeline over 2 Gloo processes (torchrun), against the threaded engine."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from echopipe.pipeline import DistributedStalePipeline, HybridSchedule, StalePipeline
from pipeline_support import models
from pipeline_support.models import loss_fn, make_batches, sgd, small_cnn
from pipeline_support.train_runs import torchrun_worker

WORKER = Path(__file__).parent / "pipeline_support" / "dist_worker.py"
TIMEOUT_WORKER = Path(__file__).parent / "pipeline_support" / "dist_timeout_worker.py"
INT_WORKER = Path(__file__).parent / "pipeline_support" / "dist_int_boundary_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _assert_close(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        a, e = actual[key].double(), expected[key].double()
        scale = max(float(e.abs().max()), 1e-30)
        assert float((a - e).abs().max()) / scale <= 1e-12, key


@pytest.fixture(scope="module")
def torchrun_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    torchrun_worker(WORKER, out, timeout=180)
    return out


def _threaded_reference():
    batches = make_batches(15)
    model = small_cnn(0)
    pipe = StalePipeline(
        model, balance=[4, 4], optimizer=sgd, loss_fn=loss_fn, hybrid=HybridSchedule(8)
    )
    losses = []
    for x, y in batches[:12]:
        losses.extend(r.value for r in pipe.train_step(x, y).finished)
    losses.extend(r.value for r in pipe.drain())
    after_12 = [{k: v.clone() for k, v in s.state_dict().items()} for s in pipe.stages]
    logits = pipe.evaluate(batches[0][0])
    for x, y in batches[12:]:
        losses.extend(r.value for r in pipe.train_step(x, y).finished)
    losses.extend(r.value for r in pipe.drain())
    final = [s.state_dict() for s in pipe.stages]
    pipe.close()
    return after_12, final, losses, logits


@pytest.mark.distributed
def test_two_gloo_ranks_equal_the_threaded_engine(torchrun_results: Path) -> None:
    torch.set_num_threads(torch.get_num_threads())
    after_12, final, losses, logits = _threaded_reference()
    ranks = [torch.load(torchrun_results / f"pipeline_rank{r}.pt") for r in range(2)]
    for r, result in enumerate(ranks):
        assert result["stage_index"] == r
        assert result["updates"] == 15
        assert result["updates_per_stage"] == [15 if k == r else None for k in range(2)]
        _assert_close(result["after_12"], after_12[r])
        _assert_close(result["final"], final[r])
        # A fresh pipeline resumed from the checkpoint continues exactly like the original.
        _assert_close(result["resumed"], final[r])
    assert ranks[0]["samples_seen"] == 15 * 6
    assert ranks[0]["losses"] == [] and ranks[0]["logits"] is None
    assert [i for i, _ in ranks[1]["losses"]] == list(range(15))
    assert [v for _, v in ranks[1]["losses"]] == pytest.approx(losses, rel=1e-12)
    torch.testing.assert_close(ranks[1]["logits"], logits, rtol=1e-12, atol=1e-12)
    assert (torchrun_results / "ck.stage0").is_file() and (torchrun_results / "ck.stage1").is_file()


@pytest.mark.distributed
def test_distributed_api_matches_stale_pipeline(torchrun_results: Path) -> None:
    batches = make_batches(15)[:7]
    ref = StalePipeline(small_cnn(0), balance=[4, 4], optimizer=sgd, loss_fn=loss_fn)
    loader = [[{"data": x, "label": y.reshape(-1, 1).int()}] for x, y in batches]
    expected = ref.run_epoch(loader, drain=True)
    accuracy = ref.accuracy(batches[0][0], batches[0][1], batch_size=4)
    chunked = ref.evaluate(batches[0][0], batch_size=4)
    final = [s.state_dict() for s in ref.stages]
    ref.close()
    ranks = [torch.load(torchrun_results / f"api_rank{r}.pt") for r in range(2)]
    assert ranks[0]["auto_balance"] == ranks[1]["auto_balance"]  # rank 0 chose, both adopted
    assert sum(ranks[0]["auto_balance"]) == 8 and len(ranks[0]["auto_balance"]) == 2
    for r, result in enumerate(ranks):
        assert result["steps"] == expected.steps == 7
        _assert_close(result["final"], final[r])
        assert result["accuracy"] == pytest.approx(accuracy, abs=1e-12)
        assert result["optimizers"] == [k == r for k in range(2)]
    assert ranks[0]["samples"] == expected.samples and ranks[0]["losses"] == []
    assert ranks[1]["losses"] == pytest.approx(expected.losses, rel=1e-12)
    # evaluate(x, batch_size) takes StalePipeline's chunks (it took no batch_size).
    assert ranks[0]["chunked_logits"] is None
    torch.testing.assert_close(ranks[1]["chunked_logits"], chunked, rtol=1e-12, atol=1e-12)


@pytest.mark.distributed
def test_data_parallel_replicas_equal_full_batch_sgd(torchrun_results: Path) -> None:
    model = small_cnn(0)
    opt = sgd(list(model.parameters()))
    for x, y in make_batches(15)[:6]:
        # Mean over each half, averaged over replicas: the full-batch mean for equal halves.
        loss = 0.5 * (loss_fn(model(x[:3]), y[:3]) + loss_fn(model(x[3:]), y[3:]))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    ranks = [torch.load(torchrun_results / f"dp_rank{r}.pt")["final"] for r in range(2)]
    for sd in ranks:
        params_only = {k: v for k, v in sd.items() if "running" not in k and "num_batches" not in k}
        expected = {k: v for k, v in model.state_dict().items() if k in params_only}
        _assert_close(params_only, expected)


@pytest.mark.distributed
def test_grad_hook_and_a_plateau_scheduler_match_the_threaded_engine(torchrun_results) -> None:
    """``grad_hook`` (``clip_grad_norm_``) and ``ReduceLROnPlateau`` stepped on the last stage's
    metric (rank 0 passes ``None``) give the threaded engine's weights, learning rates and
    clipped norms; an epoch that would step the plateau without a metric is refused before it
    runs, and a metric that only the first stage passes is refused on both ranks alike."""
    norms: list[tuple[int, float]] = []
    ref = StalePipeline(
        small_cnn(0), balance=[4, 4], optimizer=sgd, loss_fn=loss_fn, scheduler=models.plateau,
        grad_hook=models.clip_hook(norms),
    )  # fmt: skip
    loader = make_batches(15)[:5]
    with pytest.raises(TypeError, match="ReduceLROnPlateau"):
        ref.run_epoch(loader)
    for metric in models.PLATEAU_METRICS:
        ref.run_epoch(loader, step_schedulers=False)
        ref.step_schedulers(metric)
    final = [s.state_dict() for s in ref.stages]
    lrs = [o.param_groups[0]["lr"] for o in ref.optimizers if o is not None]
    ref.close()
    assert lrs == [0.025, 0.025]  # halved once, on the worse second metric
    assert min(n for _, n in norms) > models.CLIP  # every update was clipped
    ranks = [torch.load(torchrun_results / f"hook_rank{r}.pt") for r in range(2)]
    for r, result in enumerate(ranks):
        _assert_close(result["final"], final[r])
        assert result["lr"] == lrs[r]
        assert [n for _, n in result["norms"]] == pytest.approx(
            [n for k, n in norms if k == r], rel=1e-12
        )
        assert len(result["refused"]) == 2, result["refused"]
        assert "ReduceLROnPlateau steps on a metric" in result["refused"][0]
        assert "passed no metric" in result["refused"][1]


@pytest.mark.distributed
def test_replicas_clip_the_averaged_gradient(torchrun_results) -> None:
    """Over 2 data-parallel replicas, ``grad_hook`` sees the averaged gradients (in ``grads``
    and in ``.grad``): both replicas clip the same gradient and equal full-batch SGD clipped
    after backward, as ``clip_grad_norm_`` after DDP's backward does."""
    model = small_cnn(0)
    params = list(model.parameters())
    opt = sgd(params)
    expected_norms = []
    for x, y in make_batches(15)[:6]:
        loss = 0.5 * (loss_fn(model(x[:3]), y[:3]) + loss_fn(model(x[3:]), y[3:]))
        loss.backward()
        expected_norms.append(float(torch.nn.utils.clip_grad_norm_(params, models.CLIP)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    ranks = [torch.load(torchrun_results / f"hook_rank{r}.pt") for r in range(2)]
    for result in ranks:
        sd = result["dp_final"]
        params_only = {k: v for k, v in sd.items() if "running" not in k and "num_batches" not in k}
        wanted = {k: v for k, v in model.state_dict().items() if k in params_only}
        _assert_close(params_only, wanted)
        assert [n for _, n in result["dp_norms"]] == pytest.approx(expected_norms, rel=1e-10)


@pytest.mark.distributed
def test_a_silent_neighbour_raises_timeout_error_naming_it(tmp_path: Path) -> None:
    """Rank 1 builds its stage but never trains: rank 0 waits ``timeout_s`` (2 s) for the
    gradients it needs, then raises TimeoutError naming rank 1, instead of hanging (the
    subprocess timeout is the guard against a hang, not a bound on speed)."""
    torchrun_worker(TIMEOUT_WORKER, tmp_path, timeout=120)
    seconds, outcome = (tmp_path / "rank0.txt").read_text().splitlines()
    assert outcome.startswith("TimeoutError: rank 0 (stage 0) waited more than 2 s"), outcome
    assert "from rank 1 (stage 1)" in outcome
    assert float(seconds) >= 2.0  # it waited its timeout before giving up


def test_integer_tensors_between_stages_are_named_not_an_assertion(tmp_path: Path) -> None:
    """Stage 1's input is token ids (no gradient to send back): the rank says so in a
    TypeError (it was a bare AssertionError)."""
    torchrun_worker(INT_WORKER, tmp_path, timeout=120)
    outcome = (tmp_path / "rank1.txt").read_text()
    assert outcome.startswith("TypeError: stage 1's input carries no gradient"), outcome


def test_bad_timeout_is_named() -> None:
    with pytest.raises(ValueError, match="timeout_s must be a finite number of seconds > 0, got 0"):
        DistributedStalePipeline(
            small_cnn(), balance=[4, 4], optimizer=sgd, loss_fn=loss_fn, timeout_s=0
        )


def test_distributed_pipeline_needs_an_initialised_process_group() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        DistributedStalePipeline(small_cnn(), balance=[4, 4], optimizer=sgd, loss_fn=loss_fn)


def test_two_ranks_on_one_gpu_are_refused_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from echopipe.pipeline import check_gpus_per_rank, init_distributed

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"2 local ranks and sees 1 GPU\(s\) \(rank 1 would share"):
        check_gpus_per_rank(gpus=1)
    check_gpus_per_rank(gpus=2)
    if torch.cuda.device_count() < 2:
        # Refused before any process group exists (nothing to clean up, nothing hangs).
        with pytest.raises(ValueError, match="use the Gloo backend"):
            init_distributed("nccl")
        assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="backend must be"):
        init_distributed("mpi")  # type: ignore[arg-type]


@pytest.mark.distributed
def test_init_distributed_joins_again_after_a_torchrun_restart(tmp_path: Path) -> None:
    """torchrun keeps one store over restarts; ``init_distributed`` keys each attempt apart, so
    the restarted ranks do not read the killed attempt's addresses (they failed to connect)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    python_dir = Path(__file__).resolve().parent.parent / "python"
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in [str(python_dir), env.get("PYTHONPATH", "")] if p
    )
    worker = Path(__file__).parent / "pipeline_support" / "dist_restart_worker.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           "--max-restarts=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
           "--monitor-interval=0.2", str(worker), str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    done = sorted(p.name for p in tmp_path.iterdir())
    assert done == ["attempt1_rank0", "attempt1_rank1"]


@pytest.mark.distributed
def test_accuracy_of_a_model_with_several_heads_is_named_on_every_rank(tmp_path: Path) -> None:
    """The last stage returns logits and auxiliary logits: accuracy raises StalePipeline's
    TypeError on both ranks. Before, the last rank failed in torch.cat ('expected Tensor as
    element 0') and stage 0 waited for a result that never came (its pipeline's timeout).
    ``evaluate(x, batch_size=4)`` returns the tuple of heads, each concatenated over the two
    chunks, as StalePipeline's does (it took no batch_size), and ``batch_size=0`` is refused
    by ``evaluate`` and ``accuracy`` on every rank (``accuracy`` failed in ``torch.split`` on
    stage 0 alone, leaving rank 1 waiting for its pipeline's timeout)."""
    torchrun_worker(WORKER.with_name("dist_heads_worker.py"), tmp_path, timeout=180)
    for rank in range(2):
        outcome, heads, *refused = (tmp_path / f"rank{rank}.txt").read_text().splitlines()
        assert outcome.startswith("TypeError: accuracy needs the model to output logits"), outcome
        assert heads == ("None" if rank == 0 else "tuple (6, 3) (6, 3) equal"), heads
        assert refused == ["ValueError: batch_size must be an int >= 1, got 0"] * 2, refused


@pytest.mark.distributed
def test_a_killed_neighbour_is_named_in_a_connection_error(tmp_path: Path) -> None:
    """Rank 1 dies by SIGKILL: rank 0 raises ConnectionError naming rank 1, its stage and the
    message it waited for (it was Gloo's RuntimeError about a socket, naming no rank)."""
    from pipeline_support.train_runs import child_env, free_port

    worker = Path(__file__).parent / "pipeline_support" / "dist_lost_peer_worker.py"
    cmd = [sys.executable, str(worker), str(tmp_path), str(free_port())]
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=120)
    assert (tmp_path / "rank0.txt").is_file(), proc.stderr[-3000:]
    outcome = (tmp_path / "rank0.txt").read_text().strip()
    assert outcome.startswith("ConnectionError: rank 0 (stage 0) failed to "), outcome
    assert "rank 1 (stage 1)" in outcome


@pytest.mark.distributed
def test_a_failed_replica_bounds_the_gradient_average_by_timeout_s(tmp_path: Path) -> None:
    """Replica 1 raises in ``loss_fn`` and its process stays up: rank 0 raises TimeoutError
    naming the replicas' ranks after ``timeout_s`` (2 s), instead of waiting in the gradient
    all-reduce for the process group's timeout (120 s here, 30 minutes by default)."""
    from pipeline_support.train_runs import child_env, free_port

    worker = Path(__file__).parent / "pipeline_support" / "dist_replica_timeout_worker.py"
    cmd = [sys.executable, str(worker), str(tmp_path), str(free_port())]
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=400)
    assert (tmp_path / "rank0.txt").is_file(), proc.stderr[-3000:]
    outcome = (tmp_path / "rank0.txt").read_text().strip()
    assert outcome.startswith(
        "TimeoutError: rank 0 (stage 0, replica 0) waited more than 2 s for the gradient average"
    ), outcome
    assert "(ranks [0, 1])" in outcome


@pytest.mark.distributed
def test_a_loader_without_len_is_refused_on_every_rank(tmp_path: Path) -> None:
    """Stage 0's loader is a generator: both ranks raise the TypeError (rank 1 waited in the
    step count's all_reduce for rank 0, which had raised alone), and the retry with
    ``steps=`` then runs on both."""
    from pipeline_support.train_runs import child_env, free_port

    worker = Path(__file__).parent / "pipeline_support" / "dist_unsized_loader_worker.py"
    cmd = [sys.executable, str(worker), str(tmp_path), str(free_port())]
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=300)
    for rank in range(2):
        path = tmp_path / f"rank{rank}.txt"
        assert path.is_file(), proc.stderr[-3000:]
        refused, retried = path.read_text().splitlines()
        assert refused.startswith("TypeError: run_epoch on stage 0 needs a loader with len()")
        assert retried == "steps 3"


@pytest.mark.distributed
def test_a_failed_checkpoint_write_is_raised_on_every_rank(tmp_path: Path) -> None:
    """Replica 0 cannot write its stage (no such folder): it raises FileNotFoundError and
    replica 1, which writes nothing, an OSError (it waited in the barrier for rank 0); both
    then save to a real folder."""
    from pipeline_support.train_runs import child_env, free_port

    worker = Path(__file__).parent / "pipeline_support" / "dist_save_fails_worker.py"
    cmd = [sys.executable, str(worker), str(tmp_path), str(free_port())]
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=300)
    outcomes = {}
    for rank in range(2):
        path = tmp_path / f"rank{rank}.txt"
        assert path.is_file(), proc.stderr[-3000:]
        outcomes[rank] = path.read_text().splitlines()
    assert outcomes[0][0].startswith("FileNotFoundError: checkpoint folder does not exist")
    assert outcomes[1][0].startswith("OSError: the checkpoint is incomplete: 1 rank(s) failed")
    assert outcomes[0][1] == outcomes[1][1] == "saved"
    assert (tmp_path / "ck.stage0").is_file()


@pytest.mark.distributed
def test_auto_balance_needs_the_sample_input_on_rank_0_only(tmp_path: Path) -> None:
    """Rank 0 alone passes ``sample_input``: both ranks adopt its choice (rank 1 refused it and
    left rank 0 waiting in the broadcast); without one on rank 0, both raise ValueError."""
    from pipeline_support.train_runs import child_env, free_port

    worker = Path(__file__).parent / "pipeline_support" / "dist_auto_balance_worker.py"
    cmd = [sys.executable, str(worker), str(tmp_path), str(free_port())]
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=300)
    outcomes = {}
    for rank in range(2):
        path = tmp_path / f"rank{rank}.txt"
        assert path.is_file(), proc.stderr[-3000:]
        outcomes[rank] = path.read_text().splitlines()
    assert outcomes[0][0] == outcomes[1][0] and outcomes[0][0].startswith("balance [")
    assert outcomes[0][1].startswith("ValueError: balance='auto' needs sample_input")
    assert outcomes[1][1].startswith("ValueError: rank 0 could not choose the balance")


@pytest.mark.distributed
def test_run_epoch_bounds_its_step_count_agreement_by_timeout_s(tmp_path: Path) -> None:
    """Rank 1 never starts the epoch: rank 0 raises TimeoutError after ``timeout_s`` (2 s) in
    the step count's all_reduce, instead of waiting there for the process group's timeout."""
    from pipeline_support.train_runs import child_env, free_port

    worker = Path(__file__).parent / "pipeline_support" / "dist_silent_epoch_worker.py"
    cmd = [sys.executable, str(worker), str(tmp_path), str(free_port())]
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=300)
    assert (tmp_path / "rank0.txt").is_file(), proc.stderr[-3000:]
    outcome = (tmp_path / "rank0.txt").read_text().strip()
    assert outcome.startswith("TimeoutError: rank 0 (stage 0) waited more than 2 s"), outcome
    assert "run_epoch's agreement on the step count" in outcome


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("call", "what"),
    [
        ("step_schedulers", "step_schedulers' agreement on the metric"),
        ("save_checkpoint", "save_checkpoint's agreement on the writes' outcome"),
    ],
)
@pytest.mark.parametrize("fault", ["blocks", "exits"])
def test_a_rank_missing_from_an_agreement_is_bounded_by_timeout_s(
    tmp_path: Path, call: str, what: str, fault: str
) -> None:
    """Rank 1 never calls ``step_schedulers(metric)`` / ``save_checkpoint`` (it blocks, or its
    process exits): rank 0 raises TimeoutError after ``timeout_s`` (2 s), or ConnectionError,
    naming itself, rank 1 and the agreement. Their ``all_reduce`` waited for the process group's
    timeout (60 s here, 30 minutes by default), then raised Gloo's RuntimeError, which names an
    address."""
    from pipeline_support.train_runs import child_env, free_port

    worker = Path(__file__).parent / "pipeline_support" / "dist_silent_agreement_worker.py"
    cmd = [sys.executable, str(worker), str(tmp_path), str(free_port()), call, fault]
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=300)
    assert (tmp_path / "rank0.txt").is_file(), proc.stderr[-3000:]
    seconds, outcome = (tmp_path / "rank0.txt").read_text().splitlines()
    if fault == "blocks":
        assert outcome.startswith(
            f"TimeoutError: rank 0 (stage 0) waited more than 2 s for rank 1 to join {what};"
        ), outcome
        assert float(seconds) >= 2.0  # it waited its timeout before giving up
    else:
        assert outcome.startswith(
            f"ConnectionError: rank 0 (stage 0) failed in {what}: rank 1 has probably failed"
        ), outcome


@pytest.mark.distributed
@pytest.mark.parametrize("reused", ["input", "target"])
def test_a_buffer_refilled_after_train_step_is_named(tmp_path: Path, reused: str) -> None:
    """Stage 0 reads the caller's input until the minibatch's backward (autograd's saved
    tensors), and Gloo sends the target only when the last stage receives it: a loop refilling
    one buffer per minibatch trained on later values, silently (the target), or failed in
    autograd's version check, naming neither (the input). Now stage 0 raises StalePipeline's
    PipelineError naming the minibatch, and again when the caller drains after it; a first
    layer changing the input in place is not taken for the caller."""
    from pipeline_support.train_runs import child_env, free_port

    worker = Path(__file__).parent / "pipeline_support" / "dist_refilled_buffer_worker.py"
    cmd = [sys.executable, str(worker), str(tmp_path), str(free_port()), reused]
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=300)
    assert (tmp_path / "rank0.txt").is_file(), proc.stderr[-3000:]
    lines = (tmp_path / "rank0.txt").read_text().splitlines()
    not_a_tensor, in_place_layer, refilled, retried = lines
    assert not_a_tensor == "TypeError: train_step needs tensors (x, target), got list, Tensor"
    assert in_place_layer == "no error"
    assert refilled.startswith(
        f"PipelineError: rank 0: the {reused} of minibatch 0 was modified in place after train_step"
    ), refilled
    assert refilled.endswith("| stage 0"), refilled
    assert retried == refilled  # the error stays raised, as StalePipeline's does


@pytest.mark.distributed
def test_modes_switched_before_a_recompute_are_named(tmp_path: Path) -> None:
    """``model.eval()`` right after feeding, before a drain: stage 0 recomputed the forwards of
    its minibatches in flight (1 and 2) in eval mode (its batch norms on running statistics)
    and trained on those gradients, silently. As StalePipeline's stages do, it now raises the
    RuntimeError naming the stage and the minibatch."""
    from pipeline_support.train_runs import child_env, free_port

    worker = Path(__file__).parent / "pipeline_support" / "dist_modes_worker.py"
    cmd = [sys.executable, str(worker), str(tmp_path), str(free_port())]
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=300)
    assert (tmp_path / "rank0.txt").is_file(), proc.stderr[-3000:]
    outcome = (tmp_path / "rank0.txt").read_text().strip()
    assert outcome.startswith(
        "RuntimeError: stage 0: its modules' train/eval modes changed while minibatch 1 was "
        "in flight"
    ), outcome
