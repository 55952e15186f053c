"""Programs a torchgpipe / torch.distributed.pipelining user writes around ``StalePipeline``:
gradient clipping, mixed precision, frozen normalisation layers, non-tensor stage outputs."""

from __future__ import annotations

import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn

from echopipe.pipeline import (
    PipelineError,
    StalePipeline,
    balance_by_cost,
    balance_by_time,
    split_sequential,
)
from pipeline_support.amp_programs import BALANCE, amp_batches, amp_mlp, amp_sgd, train_under_bf16
from pipeline_support.models import BALANCES, loss_fn, make_batches, sgd, small_cnn
from pipeline_support.reference import ReferencePipeline
from pipeline_support.resume_program import HALF, resume_batches, resume_model, resume_pipeline
from pipeline_support.timing import FakeClock
from pipeline_support.train_runs import torchrun_worker

MAX_NORM = 0.05


def _max_rel_error(a: nn.Module, b: nn.Module) -> float:
    worst = 0.0
    for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True):
        scale = max(float(y.double().abs().max()), 1e-30)
        worst = max(worst, float((x.double() - y.double()).abs().max()) / scale)
    return worst


def _clipping_sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """SGD that clips its own parameters' gradient norm before each step (the reference)."""
    opt = sgd(params)

    def clip(*_: object) -> None:  # a pre-hook returning the norm would be taken as new args
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)

    opt.register_step_pre_hook(clip)
    return opt


def test_clip_grad_norm_in_the_grad_hook_clips_each_stage(one_thread) -> None:
    """The usual ``clip_grad_norm_(params, max_norm)`` works inside ``grad_hook``: it reads and
    scales ``p.grad``, so the gradients must be there when the hook runs."""
    batches = make_batches(8)
    ref_model = small_cnn()
    stages = split_sequential(ref_model, BALANCES[3])
    opts = [_clipping_sgd([p for p in s.parameters() if p.requires_grad]) for s in stages]
    ReferencePipeline(stages, opts, loss_fn).run_pipelined(batches)

    norms: list[float] = []

    def clip(stage: int, params: list[nn.Parameter], grads: list[torch.Tensor | None]) -> None:
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, MAX_NORM)))

    model = small_cnn()
    with StalePipeline(
        model, balance=BALANCES[3], optimizer=sgd, loss_fn=loss_fn, grad_hook=clip
    ) as pipe:
        for x, y in batches:
            pipe.train_step(x, y)
        pipe.drain()
    assert len(norms) == 3 * len(batches) and min(norms) > MAX_NORM  # every update was clipped
    assert _max_rel_error(model, ref_model) <= 1e-12


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)]
    return nn.Sequential(*layers)


def test_the_callers_autocast_reaches_the_stage_threads(one_thread) -> None:
    """``with torch.autocast("cpu", dtype=torch.bfloat16): pipe.train_step(x, y)`` runs the
    stages in bfloat16, as the same loop does without a pipeline; autocast state is per thread,
    so the stage threads must be given it."""
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))]
    batches *= 4
    plain = _mlp()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    expected = []
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(plain(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        expected.append(float(loss.detach()))

    model = _mlp()
    seen: list[torch.dtype] = []
    for layer in (model[0], model[4]):
        layer.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    losses = []
    with StalePipeline(
        model,
        balance=[2, 3],
        pipelined=False,  # plain SGD on two stages: comparable with the loop above
        intra_op_threads=1,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        loss_fn=loss_fn,
    ) as pipe:
        for x, y in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                losses += pipe.train_step(x, y).losses
        losses += [r.value for r in pipe.drain()]
        assert seen == [torch.bfloat16] * (2 * len(batches))
        # The caller's thread itself keeps its own autocast state for evaluation.
        assert pipe.evaluate(batches[0][0]).dtype == torch.float32
    torch.testing.assert_close(losses, expected, rtol=0, atol=0)
    torch.testing.assert_close(model[4].weight, plain[4].weight, rtol=0, atol=0)


def _frozen_bn_model() -> tuple[nn.Sequential, nn.BatchNorm1d]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)
    )
    bn = model[1]
    bn.eval()  # fine-tuning: the normalisation keeps its running statistics
    bn.weight.requires_grad_(False)
    bn.bias.requires_grad_(False)
    return model, bn


def test_a_batchnorm_frozen_before_the_pipeline_stays_frozen() -> None:
    """A module the user put in eval mode keeps that mode through balancing and construction,
    so its running statistics do not move during training."""
    model, bn = _frozen_bn_model()
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    x = torch.randn(8, 6)
    clock = FakeClock()
    balance = balance_by_time(model, x, 2, clock=clock)
    assert balance_by_cost(model, x, 2)
    assert not bn.training and model[0].training
    with StalePipeline(
        model, balance=balance, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=loss_fn
    ) as pipe:
        for _ in range(3):
            pipe.train_step(x, torch.tensor([0, 1, 2, 0, 1, 2, 0, 1]))
        pipe.drain()
        assert not bn.training and model[0].training
    for key, value in bn.state_dict().items():
        assert torch.equal(value, before[key]), key


class _Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x * 2


class _Sum(nn.Module):
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return pair[0] + pair[1]


def test_a_stage_that_outputs_a_tuple_is_named() -> None:
    """torchgpipe passes tuples between partitions; this engine passes one tensor, and says so
    with the stage and the type instead of an AttributeError from inside the engine."""
    model = nn.Sequential(nn.Linear(6, 4), _Pair(), _Sum(), nn.Linear(4, 3))
    with (
        StalePipeline(
            model, balance=[2, 2], optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=loss_fn
        ) as pipe,
        pytest.raises(PipelineError) as info,
    ):
        pipe.train_step(torch.randn(4, 6), torch.tensor([0, 1, 2, 0]))
        pipe.drain()
    assert info.value.stage == 0
    assert isinstance(info.value.__cause__, TypeError)
    assert "stage 0 outputs a tuple" in str(info.value)


@pytest.mark.distributed
def test_two_gloo_ranks_under_autocast_equal_the_threaded_engine(
    tmp_path: Path, one_thread
) -> None:
    """Both engines train under the caller's bfloat16 autocast, with recompute, and agree even
    for the minibatches whose recompute runs in a ``drain()`` outside the autocast block."""
    torchrun_worker(
        Path(__file__).parent / "pipeline_support" / "dist_amp_worker.py", tmp_path, 180
    )

    with StalePipeline(
        amp_mlp(),
        balance=BALANCE,
        optimizer=amp_sgd,
        loss_fn=loss_fn,
        recompute=True,
        intra_op_threads=1,
    ) as pipe:
        train_under_bf16(pipe, amp_batches(), first=True)
        for k, stage in enumerate(pipe.stages):
            ranked = torch.load(tmp_path / f"stage{k}.pt")
            for name, value in stage.state_dict().items():
                assert torch.equal(value, ranked[name]), (k, name)


def _plateau_pipeline(interval: str = "epoch") -> StalePipeline:
    return StalePipeline(
        amp_mlp(),
        balance=BALANCE,
        optimizer=amp_sgd,
        loss_fn=loss_fn,
        scheduler=lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=0),
        scheduler_interval=interval,  # type: ignore[arg-type]
    )


def test_reduce_lr_on_plateau_steps_on_the_metric_given_after_an_epoch() -> None:
    """``ReduceLROnPlateau`` needs its metric: a plain ``run_epoch`` refuses before feeding
    (instead of failing a stage thread at the epoch's end), and ``step_schedulers(metric)``
    steps every stage's scheduler on it."""
    batches = amp_batches()
    with _plateau_pipeline() as pipe:
        with pytest.raises(TypeError):
            pipe.run_epoch(batches)
        assert pipe.steps_fed == 0
        pipe.run_epoch(batches, step_schedulers=False)
        pipe.step_schedulers(1.0)
        assert pipe.steps_applied == len(batches)  # stepped after the epoch's updates
        pipe.step_schedulers(2.0)  # worse, with patience 0: the rate halves
        assert [o.param_groups[0]["lr"] for o in pipe.optimizers] == [0.05, 0.05]
        pipe.run_epoch(batches, step_schedulers=False)  # the pipeline is still usable
        pipe.drain()
    with pytest.raises(TypeError):
        _plateau_pipeline("step")
    step_lr = partial(torch.optim.lr_scheduler.StepLR, step_size=1)
    with StalePipeline(
        amp_mlp(), balance=BALANCE, optimizer=amp_sgd, loss_fn=loss_fn, scheduler=step_lr
    ) as pipe:
        pipe.run_epoch(amp_batches()[:1], step_schedulers=False)
        with pytest.raises(TypeError):  # StepLR.step(1.0) would set the epoch to 1
            pipe.step_schedulers(1.0)
        pipe.step_schedulers()
        pipe.drain()  # the stage threads step their schedulers
        assert [o.param_groups[0]["lr"] for o in pipe.optimizers] == pytest.approx([0.01] * 2)


@pytest.mark.parametrize("batch_size", [0, -1, 2.5])
def test_evaluate_names_a_bad_batch_size(batch_size: object) -> None:
    with StalePipeline(amp_mlp(), balance=BALANCE, optimizer=amp_sgd, loss_fn=loss_fn) as pipe:
        x, y = amp_batches()[0]
        with pytest.raises(ValueError, match="batch_size"):
            pipe.accuracy(x, y, batch_size=batch_size)  # type: ignore[arg-type]


@pytest.mark.parametrize("made_there", ["x", "target"])
def test_a_minibatch_made_under_inference_mode_is_named(made_there: str) -> None:
    """GPU preprocessing often runs under ``torch.inference_mode()``; train_step failed with a
    traceback ending in 'Inference tensors do not track version counter'. A clone made
    outside inference mode trains."""
    with StalePipeline(amp_mlp(), balance=BALANCE, optimizer=amp_sgd, loss_fn=loss_fn) as pipe:
        x, y = amp_batches()[0]
        with torch.inference_mode():
            made = (x * 1, y) if made_there == "x" else (x, y * 1)
        with pytest.raises(TypeError, match=f"{made_there} is an inference tensor"):
            pipe.train_step(*made)
        pipe.train_step(*(t.clone() for t in made))
        assert len(pipe.drain()) == 1


def test_a_checkpoint_resumed_in_another_process_continues_the_run(tmp_path: Path) -> None:
    """Saved mid-training by one process, loaded by a fresh pipeline in another: the weights
    end as an uninterrupted run's that drained at the same step, exactly."""
    path = tmp_path / "mid.ckpt"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    python_dir = Path(__file__).resolve().parent.parent / "python"
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(python_dir), env.get("PYTHONPATH")] if p)
    program = Path(__file__).parent / "pipeline_support" / "resume_program.py"
    proc = subprocess.run(
        [sys.executable, str(program), str(path)], env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]

    batches = resume_batches()
    full = resume_model()
    with resume_pipeline(full) as pipe:
        for i, (x, y) in enumerate(batches):
            if i == HALF:
                pipe.drain()  # the checkpoint policy: drain, then save
            pipe.train_step(x, y)
        pipe.drain()
    resumed = resume_model(seed=99)
    with resume_pipeline(resumed) as pipe:
        pipe.load_checkpoint(path)
        for x, y in batches[HALF:]:
            pipe.train_step(x, y)
        pipe.drain()
    for (name, value), expected in zip(
        resumed.state_dict().items(), full.state_dict().values(), strict=True
    ):
        assert torch.equal(value, expected), name
