"""Stale-weight pipeline engine (threads, CPU) against a step-by-step reference simulator."""

from __future__ import annotations

import copy
import json
import random
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from echopipe.pipeline import (
    HybridSchedule,
    PipelineError,
    StalePipeline,
    partition_balance,
    profile_layers,
    split_sequential,
    stage_staleness,
)
from echopipe.pipeline.checkpoint import atomic_save
from echopipe.pipeline.partition import min_max_partition
from pipeline_support.models import BALANCES, adam, loss_fn, make_batches, sgd, small_cnn
from pipeline_support.reference import ReferencePipeline
from pipeline_support.timing import FakeClock, Timed


def reference_for(model: nn.Sequential, balance, opt_factory, recompute=False, scheduler=None):
    stages = split_sequential(model, balance)
    opts = [opt_factory(list(s.parameters())) if list(s.parameters()) else None for s in stages]
    scheds = [scheduler(o) if (scheduler and o) else None for o in opts]
    return ReferencePipeline(stages, opts, loss_fn, recompute=recompute, schedulers=scheds)


def max_rel_error(a: nn.Module, b: nn.Module) -> float:
    worst = 0.0
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        x, y = sa[key].double(), sb[key].double()
        scale = max(float(y.abs().max()), 1e-30)
        worst = max(worst, float((x - y).abs().max()) / scale)
    return worst


# Schedule and staleness -----------------------------------------------------------------------
def test_staleness_formula() -> None:
    assert stage_staleness(1) == [0]
    assert stage_staleness(4) == [6, 4, 2, 0]
    assert stage_staleness(3, pipelined=False) == [0, 0, 0]
    with StalePipeline(small_cnn(), balance=[3, 3, 2], optimizer=sgd, loss_fn=loss_fn) as pipe:
        assert pipe.staleness() == [4, 2, 0]
        pipe.set_pipelined(False)
        assert pipe.staleness() == [0, 0, 0]


def test_reference_tick_schedule_matches_documented_staleness() -> None:
    """In the tick simulation, forward of m on stage k comes after exactly max(0, m-D_k)
    backwards of that stage: the forward misses D_k updates in steady state."""
    K, n = 4, 12
    ref = reference_for(small_cnn(), BALANCES[K], sgd)
    ref.run_pipelined(make_batches(n))
    for k in range(K):
        ops = [(op, m) for (_, op, s, m) in ref.log if s == k]
        done = 0
        for op, m in ops:
            if op == "fwd":
                assert done == max(0, m - 2 * (K - 1 - k)), (k, m, done)
            else:
                assert m == done
                done += 1
        assert done == n


@pytest.mark.parametrize("num_stages", [2, 3, 4])
@pytest.mark.parametrize("opt_factory", [sgd, adam], ids=["sgd_momentum", "adam"])
def test_engine_equals_reference(num_stages: int, opt_factory, one_thread) -> None:
    batches = make_batches(14)
    ref_model = small_cnn()
    ref = reference_for(ref_model, BALANCES[num_stages], opt_factory)
    ref_losses = ref.run_pipelined(batches)

    model = small_cnn()
    with StalePipeline(
        model, balance=BALANCES[num_stages], optimizer=opt_factory, loss_fn=loss_fn
    ) as pipe:
        losses = []
        for x, y in batches:
            losses.extend(pipe.train_step(x, y).losses)
        losses.extend(r.value for r in pipe.drain())
        assert pipe.steps_applied == len(batches)
        assert pipe.updates_per_stage == [len(batches)] * num_stages
        assert pipe.samples_seen == 6 * len(batches)
    assert max_rel_error(model, ref_model) <= 1e-12
    assert losses == pytest.approx(ref_losses, rel=1e-12)
    # The check can fail: the pipelined run is measurably different from plain SGD.
    sgd_model = small_cnn()
    reference_for(sgd_model, BALANCES[num_stages], opt_factory).run_sync(batches)
    assert max_rel_error(model, sgd_model) > 1e-6


def test_engine_equals_reference_with_recompute(one_thread) -> None:
    batches = make_batches(12)
    ref_model = small_cnn()
    reference_for(ref_model, BALANCES[3], sgd, recompute=True).run_pipelined(batches)
    saved_model = small_cnn()
    reference_for(saved_model, BALANCES[3], sgd).run_pipelined(batches)
    model = small_cnn()
    with StalePipeline(
        model, balance=BALANCES[3], optimizer=sgd, loss_fn=loss_fn, recompute=True
    ) as pipe:
        for x, y in batches:
            pipe.train_step(x, y)
        pipe.drain()
    assert max_rel_error(model, ref_model) <= 1e-12
    # The two rules differ (otherwise the recompute option would be pointless to offer).
    assert max_rel_error(model, saved_model) > 1e-9
    # Running statistics were updated once per minibatch, not again by the recomputation.
    assert int(model[0][1].num_batches_tracked) == len(batches)


def test_grad_hook_runs_per_update_and_its_gradients_reach_the_optimizer(one_thread) -> None:
    batches = make_batches(10)

    def sgd_halving_grads(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        opt = sgd(params)

        def halve(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
            for q in params:
                if q.grad is not None:
                    q.grad = q.grad * 0.5

        opt.register_step_pre_hook(halve)
        return opt

    ref_model = small_cnn()
    reference_for(ref_model, BALANCES[3], sgd_halving_grads).run_pipelined(batches)

    calls: list[tuple[int, str, int]] = []

    def hook(stage: int, params: list[nn.Parameter], grads: list[torch.Tensor | None]) -> None:
        assert len(grads) == len(params)
        calls.append((stage, threading.current_thread().name, len(params)))
        for i, g in enumerate(grads):
            if g is not None:
                grads[i] = g * 0.5

    model = small_cnn()
    with StalePipeline(
        model, balance=BALANCES[3], optimizer=sgd, loss_fn=loss_fn, grad_hook=hook
    ) as pipe:
        for x, y in batches:
            pipe.train_step(x, y)
        pipe.drain()
        sizes = [len([q for q in s.parameters() if q.requires_grad]) for s in pipe.stages]
    # Replaced gradients are what each stage's optimizer used: equal to the halving reference.
    assert max_rel_error(model, ref_model) <= 1e-12
    plain = small_cnn()
    reference_for(plain, BALANCES[3], sgd).run_pipelined(batches)
    assert max_rel_error(model, plain) > 1e-6
    # Once per update of every stage, in that stage's worker thread, with its parameters.
    assert sorted(calls) == sorted(
        (k, f"echopipe-stage-{k}", sizes[k]) for k in range(3) for _ in batches
    )
    with pytest.raises(TypeError, match="grad_hook"):
        StalePipeline(small_cnn(), optimizer=sgd, loss_fn=loss_fn, grad_hook=3)  # type: ignore[arg-type]


def test_single_stage_is_plain_sgd() -> None:
    batches = make_batches(10)
    plain = small_cnn()
    opt = sgd(list(plain.parameters()))
    for x, y in batches:
        loss_fn(plain(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model = small_cnn()
    with StalePipeline(model, optimizer=sgd, loss_fn=loss_fn) as pipe:
        assert pipe.staleness() == [0]
        for x, y in batches:
            pipe.train_step(x, y)
        pipe.drain()
    for a, b in zip(model.state_dict().values(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_synchronous_mode_is_plain_sgd(one_thread) -> None:
    batches = make_batches(8)
    ref_model = small_cnn()
    reference_for(ref_model, BALANCES[3], sgd).run_sync(batches)
    model = small_cnn()
    with StalePipeline(
        model, balance=BALANCES[3], optimizer=sgd, loss_fn=loss_fn, pipelined=False
    ) as pipe:
        for x, y in batches:
            pipe.train_step(x, y)
        pipe.drain()
    assert max_rel_error(model, ref_model) <= 1e-12


class _Jitter(nn.Module):
    """Sleeps a random short time: perturbs thread timing without changing values."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.rng = random.Random(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.rng.random() * 0.004)
        return x


def test_result_is_independent_of_thread_timing(one_thread) -> None:
    batches = make_batches(12)
    ref_model = small_cnn()
    reference_for(ref_model, BALANCES[3], sgd).run_pipelined(batches)
    for seed in range(2):
        model = small_cnn()
        jittered = nn.Sequential(
            *[nn.Sequential(layer, _Jitter(seed * 10 + i)) for i, layer in enumerate(model)]
        )
        with StalePipeline(jittered, balance=BALANCES[3], optimizer=sgd, loss_fn=loss_fn) as pipe:
            for x, y in batches:
                pipe.train_step(x, y)
            pipe.drain()
        assert max_rel_error(model, ref_model) <= 1e-12


def test_step_seconds_is_the_slowest_stages_busy_time_not_the_callers_wait() -> None:
    """t_down for ``echopipe train``, from injected timings: per minibatch, stage 0 works
    10 ms forward and 30 ms backward, stage 1 30 ms forward and 5 ms backward (each on its own
    thread's clock). The caller takes 80 ms between steps on its clock; the pipeline's busy
    time per minibatch is still the slowest stage's forward plus backward, 40 ms, and ``None``
    before every stage has done a forward and a backward."""
    clock = FakeClock()
    model = small_cnn()
    # Each Timed follows a layer with weights, so its input needs a gradient in backward.
    timed = nn.Sequential(
        model[0], Timed(clock, 0.010, 0.030), model[1], Timed(clock, 0.030, 0.005), *model[2:]
    )
    with StalePipeline(
        timed, balance=[3, len(timed) - 3], optimizer=sgd, loss_fn=loss_fn, clock=clock
    ) as pipe:  # fmt: skip
        assert pipe.step_seconds() is None
        for x, y in make_batches(8):
            pipe.train_step(x, y)
            clock.advance(0.08)
        pipe.drain()
        busy = pipe.step_seconds()
    assert busy == pytest.approx(0.040, rel=1e-9)


def test_documented_weight_rule_by_hand() -> None:
    """Independent of autograd aliasing: a 3-stage tanh MLP with hand-written gradients.

    Forward of m on stage k uses the weights after max(0, m - D_k) updates; backward uses the
    forward-time activations and the live weights (after m updates) for the input gradient.
    """
    torch.manual_seed(3)
    dims = [3, 5, 4, 2]
    K, lr, n = 3, 0.1, 9
    layers = [nn.Linear(dims[i], dims[i + 1]).double() for i in range(K)]
    model = nn.Sequential(layers[0], nn.Tanh(), layers[1], nn.Tanh(), layers[2])
    history = [[(lay.weight.detach().clone(), lay.bias.detach().clone())] for lay in layers]
    g = torch.Generator().manual_seed(4)
    batches = [
        (torch.randn(4, 3, generator=g, dtype=torch.float64), torch.randn(4, 2, generator=g))
        for _ in range(n)
    ]
    batches = [(x, y.double()) for x, y in batches]
    D = [4, 2, 0]
    for m, (x, y) in enumerate(batches):
        hs = [x]
        for k in range(K):
            w, b = history[k][max(0, m - D[k])]
            z = hs[-1] @ w.T + b
            hs.append(torch.tanh(z) if k < K - 1 else z)
        grad = 2 * (hs[-1] - y) / y.numel()
        for k in reversed(range(K)):
            if k < K - 1:
                grad = grad * (1 - hs[k + 1] ** 2)  # tanh saved its forward-time output
            w_live, b_live = history[k][m]
            assert len(history[k]) == m + 1
            grad_w, grad_b = grad.T @ hs[k], grad.sum(0)
            grad = grad @ w_live  # input gradient through the live weight
            history[k].append((w_live - lr * grad_w, b_live - lr * grad_b))
    with StalePipeline(
        model,
        balance=[2, 2, 1],
        optimizer=lambda ps: torch.optim.SGD(ps, lr=lr),
        loss_fn=nn.functional.mse_loss,
    ) as pipe:
        for x, y in batches:
            pipe.train_step(x, y)
        pipe.drain()
    for k, lay in enumerate(layers):
        w, b = history[k][-1]
        torch.testing.assert_close(lay.weight.detach(), w, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(lay.bias.detach(), b, rtol=1e-12, atol=1e-14)


# Hybrid, drains, schedulers ------------------------------------------------------------------
def test_mid_run_drain_and_hybrid_switch(one_thread) -> None:
    batches = make_batches(16)
    ref_model = small_cnn()
    ref = reference_for(ref_model, BALANCES[2], sgd)
    ref.run_pipelined(batches[:5])
    ref.run_pipelined(batches[5:10])
    ref.run_sync(batches[10:])
    model = small_cnn()
    with StalePipeline(
        model, balance=BALANCES[2], optimizer=sgd, loss_fn=loss_fn, hybrid=HybridSchedule(10)
    ) as pipe:
        seen = []
        for i, (x, y) in enumerate(batches):
            if i == 5:
                seen.extend(r.index for r in pipe.drain())
            seen.extend(r.index for r in pipe.train_step(x, y).finished)
            assert pipe.pipelined == (i < 10)
        seen.extend(r.index for r in pipe.drain())
        # Every minibatch finished exactly once across the drain and the switch.
        assert seen == list(range(16))
        assert pipe.steps_applied == 16
        assert pipe.staleness() == [0, 0]
    assert max_rel_error(model, ref_model) <= 1e-12


def test_hybrid_schedule_constructors() -> None:
    assert HybridSchedule.from_epochs(3, 40).pipelined_steps == 120
    assert HybridSchedule.from_fraction(0.5, 101).pipelined_steps == 50
    with pytest.raises(ValueError, match="fraction"):
        HybridSchedule.from_fraction(1.5, 10)
    with pytest.raises(ValueError, match="pipelined_steps"):
        HybridSchedule(-1)


def test_epoch_scheduler_steps_after_each_stage_update_of_last_minibatch(one_thread) -> None:
    batches = make_batches(15)
    epochs = [batches[0:5], batches[5:10], batches[10:15]]

    def step_lr(opt):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    ref_model = small_cnn()
    ref = reference_for(ref_model, BALANCES[3], sgd, scheduler=step_lr)
    ref.run_pipelined(batches, scheduler_after={4, 9, 14})
    model = small_cnn()
    with StalePipeline(
        model, balance=BALANCES[3], optimizer=sgd, loss_fn=loss_fn, scheduler=step_lr
    ) as pipe:
        for epoch in epochs:
            result = pipe.run_epoch(epoch)
            assert result.steps == 5 and result.samples == 30
        pipe.drain()
        assert [s.last_epoch for s in pipe.schedulers] == [3, 3, 3]
    assert max_rel_error(model, ref_model) <= 1e-12


# BatchNorm -----------------------------------------------------------------------------------
def test_batchnorm_running_stats_follow_forward_order() -> None:
    """Running statistics of a stage's BN are the EMA of that stage's forward-time batches."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.BatchNorm1d(4), nn.Linear(4, 2)).double()
    bn = model[2]
    seen: list[torch.Tensor] = []
    bn.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach().clone()))
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(8, 3, generator=g, dtype=torch.float64), torch.randint(0, 2, (8,)))
        for _ in range(10)
    ]
    with StalePipeline(model, balance=[2, 2], optimizer=sgd, loss_fn=loss_fn) as pipe:
        for x, y in batches:
            pipe.train_step(x, y)
        pipe.drain()
        mean = torch.zeros(4, dtype=torch.float64)
        var = torch.ones(4, dtype=torch.float64)
        for inp in seen:
            mean = 0.9 * mean + 0.1 * inp.mean(0)
            var = 0.9 * var + 0.1 * inp.var(0, unbiased=True)
        assert len(seen) == 10
        torch.testing.assert_close(bn.running_mean, mean, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(bn.running_var, var, rtol=1e-12, atol=1e-14)
        assert int(bn.num_batches_tracked) == 10
        # Evaluation uses the running statistics and leaves the modules in training mode.
        x = batches[0][0]
        expected = model[3](
            (model[1](model[0](x)) - mean) / torch.sqrt(var + bn.eps) * bn.weight + bn.bias
        )
        torch.testing.assert_close(pipe.evaluate(x), expected.detach(), rtol=1e-10, atol=1e-12)
        assert model.training and bn.training


# Checkpoints ---------------------------------------------------------------------------------
def test_checkpoint_resume_equals_uninterrupted_run(tmp_path: Path, one_thread) -> None:
    batches = make_batches(14)

    def step_lr(opt):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)

    def build(model):
        return StalePipeline(
            model,
            balance=BALANCES[3],
            optimizer=sgd,
            loss_fn=loss_fn,
            scheduler=step_lr,
            scheduler_interval="step",
        )

    full = small_cnn()
    with build(full) as pipe:
        for i, (x, y) in enumerate(batches):
            if i == 8:
                pipe.drain()  # the checkpoint policy: drain, then save
            pipe.train_step(x, y)
        pipe.drain()

    path = tmp_path / "pipe.ckpt"
    first = small_cnn()
    with build(first) as pipe:
        for x, y in batches[:8]:
            pipe.train_step(x, y)
        pipe.save_checkpoint(path)
        assert pipe.steps_applied == 8  # saving drained the in-flight minibatches
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe.ckpt"]  # no temp file left

    resumed = small_cnn(seed=99)  # different initial weights, overwritten by the checkpoint
    with build(resumed) as pipe:
        pipe.load_checkpoint(path)
        assert pipe.steps_fed == 8 and pipe.samples_seen == 48
        assert pipe.updates_per_stage == [8, 8, 8]
        for x, y in batches[8:]:
            pipe.train_step(x, y)
        pipe.drain()
        assert [s.last_epoch for s in pipe.schedulers] == [14, 14, 14]
    assert max_rel_error(resumed, full) <= 1e-12


def test_checkpoint_errors_and_atomic_write(tmp_path: Path) -> None:
    path = tmp_path / "ck.pt"
    with StalePipeline(small_cnn(), balance=[4, 4], optimizer=sgd, loss_fn=loss_fn) as pipe:
        with pytest.raises(FileNotFoundError, match=r"missing\.pt"):
            pipe.load_checkpoint(tmp_path / "missing.pt")
        pipe.save_checkpoint(path)
        before = path.read_bytes()
    other = StalePipeline(small_cnn(), balance=[3, 5], optimizer=sgd, loss_fn=loss_fn)
    with other, pytest.raises(ValueError, match="balance"):
        other.load_checkpoint(path)
    # A failed write leaves the old file untouched and no temporary file behind.
    with pytest.raises(Exception, match=r"pickle|lambda|local"):
        atomic_save({"not": lambda: None}, path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.pt"]


# Errors --------------------------------------------------------------------------------------
class _Boom(nn.Module):
    def __init__(self, after: int, where: str = "forward") -> None:
        super().__init__()
        self.after, self.where, self.calls = after, where, 0
        self.raised = threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > self.after:
            if self.where == "forward":
                self.raised.set()
                raise RuntimeError("boom in forward")
            return _RaiseInBackward.apply(x, self)
        return x


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, owner):  # type: ignore[override]
        ctx.owner = owner
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.owner.raised.set()
        raise RuntimeError("boom in backward")


# A guard against a hang, not a bound on speed: the calls below return as soon as the stage's
# error reaches them, and only a wait that never ends would reach this.
HANG_S = 60.0


def _in_thread(call) -> tuple[threading.Event, list[BaseException]]:
    """Run ``call`` in a thread; the event fires when it returned or raised (kept in the list)."""
    done, errors = threading.Event(), []

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    return done, errors


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_stage_exception_reaches_caller_and_stops_workers(where: str) -> None:
    """The caller is stopped by the error, not by running out of input: the bounded queues let
    it feed only a few minibatches past the failing one before it waits, and that wait ends in
    the stage's error."""
    boom = _Boom(after=3, where=where)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), boom, nn.Linear(4, 4), nn.Linear(4, 2))
    pipe = StalePipeline(model, balance=[2, 2, 1], optimizer=sgd, loss_fn=loss_fn)
    x, y = torch.randn(3, 4), torch.randint(0, 2, (3,))

    def feed() -> None:
        for _ in range(1000):
            pipe.train_step(x, y)
        pipe.drain()

    done, errors = _in_thread(feed)
    assert done.wait(HANG_S), "the caller never saw the stage's error"
    (error,) = errors
    assert isinstance(error, PipelineError) and error.stage == 1
    assert f"stage 1 failed: RuntimeError: boom in {where}" in str(error)
    assert boom.raised.is_set() and pipe.steps_fed < 20
    for t in pipe._workers.threads:
        t.join(timeout=HANG_S)
        assert not t.is_alive()
    # The failure is sticky: later calls raise it again instead of hanging.
    with pytest.raises(PipelineError, match=f"boom in {where}"):
        pipe.train_step(x, y)
    pipe.close()


def test_error_while_caller_waits_in_drain() -> None:
    """With two stages, stage 0 holds two minibatches in flight and runs no backward until the
    drain asks for it: the failing backward happens while the caller waits in ``drain``."""
    boom = _Boom(after=1, where="backward")
    model = nn.Sequential(nn.Linear(4, 4), boom, nn.Linear(4, 2))
    pipe = StalePipeline(model, balance=[2, 1], optimizer=sgd, loss_fn=loss_fn)
    x, y = torch.randn(3, 4), torch.randint(0, 2, (3,))
    pipe.train_step(x, y)
    pipe.train_step(x, y)
    assert not boom.raised.is_set()
    done, errors = _in_thread(pipe.drain)
    assert done.wait(HANG_S), "drain never saw the stage's error"
    assert boom.raised.is_set()
    (error,) = errors
    assert isinstance(error, PipelineError) and error.stage == 0
    pipe.close()
    assert threading.active_count() < 50


def test_bad_configuration_errors() -> None:
    with pytest.raises(ValueError, match=r"sums to 7 but the model has 8 layers"):
        StalePipeline(small_cnn(), balance=[4, 3], optimizer=sgd, loss_fn=loss_fn)
    with pytest.raises(ValueError, match="at least one layer"):
        StalePipeline(small_cnn(), balance=[8, 0], optimizer=sgd, loss_fn=loss_fn)
    with pytest.raises(ValueError, match="unknown device 'cuda:7'"):
        StalePipeline(
            small_cnn(), balance=[4, 4], devices=["cpu", "cuda:7"], optimizer=sgd, loss_fn=loss_fn
        )
    with pytest.raises(ValueError, match="unknown device 'warp-drive'"):
        StalePipeline(
            small_cnn(),
            balance=[4, 4],
            devices=["cpu", "warp-drive"],
            optimizer=sgd,
            loss_fn=loss_fn,
        )
    with pytest.raises(ValueError, match=r"1 device.*2 stage"):
        StalePipeline(small_cnn(), balance=[4, 4], devices=["cpu"], optimizer=sgd, loss_fn=loss_fn)
    with pytest.raises(TypeError, match=r"nn\.Sequential.*Linear"):
        StalePipeline(nn.Linear(2, 2), optimizer=sgd, loss_fn=loss_fn)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="balance entries must be ints"):
        StalePipeline(small_cnn(), balance=[4.0, 4], optimizer=sgd, loss_fn=loss_fn)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="sample_input"):
        StalePipeline(small_cnn(), balance="auto", num_stages=2, optimizer=sgd, loss_fn=loss_fn)


# Partitioning --------------------------------------------------------------------------------
def test_min_max_partition_is_optimal_and_respects_memory() -> None:
    assert min_max_partition([1.0, 1.0, 20.0, 1.0, 1.0], 3) == [2, 1, 2]
    assert min_max_partition([1.0] * 8, 4) == [2, 2, 2, 2]
    assert min_max_partition([5.0, 1.0, 1.0, 1.0, 1.0, 1.0], 2) == [1, 5]
    # Forbid a first stage with more than one layer: the split has to adapt.
    assert min_max_partition([1.0] * 4, 2, lambda k, a, b: k != 0 or b - a <= 1) == [1, 3]


def _heavy_middle_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 64),
        nn.Linear(64, 64),
        nn.Sequential(*[nn.Linear(64, 64) for _ in range(30)]),  # much heavier than the rest
        nn.Linear(64, 64),
        nn.Linear(64, 64),
    )


def test_auto_balance_profiles_layers() -> None:
    # Only what does not depend on wall-clock time: which layer measures slowest does.
    model = _heavy_middle_model()
    before = copy.deepcopy(model.state_dict())
    profiles = profile_layers(model, torch.randn(256, 64), repeats=2)
    assert len(profiles) == 5 and all(p.seconds > 0 for p in profiles)
    assert profiles[2].param_bytes == 30 * profiles[0].param_bytes
    assert profiles[0].activation_bytes == 256 * 64 * 4
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])  # profiling leaves the weights untouched
    balance = partition_balance(model, torch.randn(256, 64), 3, repeats=2)
    assert sum(balance) == 5 and len(balance) == 3
    with StalePipeline(
        model, balance="auto", num_stages=3, sample_input=torch.randn(64, 64),
        optimizer=sgd, loss_fn=nn.functional.mse_loss,
    ) as pipe:  # fmt: skip
        assert len(pipe.balance) == 3 and sum(pipe.balance) == 5


def test_model_cost_balance_is_repeatable_and_isolates_the_heavy_block() -> None:
    from echopipe.pipeline.cost_model import estimate_layer_seconds

    model = _heavy_middle_model()
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(256, 64)
    estimate = estimate_layer_seconds(model, x)
    assert max(range(5), key=lambda i: estimate[i]) == 2
    assert estimate[2] == pytest.approx(30 * estimate[0], rel=0.05)
    assert estimate_layer_seconds(model, x) == estimate  # from shapes: the same every time
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])
    balances = {tuple(partition_balance(model, x, 3, cost="model")) for _ in range(3)}
    assert balances == {(2, 1, 2)}
    with StalePipeline(
        model, balance="auto", num_stages=3, sample_input=x, balance_cost="model",
        optimizer=sgd, loss_fn=nn.functional.mse_loss,
    ) as pipe:  # fmt: skip
        assert pipe.balance == [2, 1, 2]
    with pytest.raises(ValueError, match="cost must be"):
        partition_balance(model, x, 3, cost="flops")  # type: ignore[arg-type]


def test_balance_cache_reuses_the_first_choice(tmp_path) -> None:
    model = _heavy_middle_model()
    x = torch.randn(32, 64)
    cache = tmp_path / "balance.json"
    first = partition_balance(model, x, 3, repeats=1, cache=cache)
    stored = json.loads(cache.read_text())
    ((key, value),) = stored.items()
    assert value == first
    # A later run reads the file instead of timing: make the stored choice recognisable.
    cache.write_text(json.dumps({key: [1, 1, 3]}))
    assert partition_balance(model, x, 3, repeats=1, cache=cache) == [1, 1, 3]
    # Another configuration (stage count) is a different key: timed and added.
    assert len(partition_balance(model, x, 2, repeats=1, cache=cache)) == 2
    assert len(json.loads(cache.read_text())) == 2
    cache.write_text(json.dumps({key: [0, 5]}))
    with pytest.raises(ValueError, match="not a balance"):
        partition_balance(model, x, 3, repeats=1, cache=cache)


def test_memory_caps_constrain_auto_balance() -> None:
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
    per_layer = 32 * 32 * 4 + 32 * 4
    with pytest.raises(ValueError, match="memory caps"):
        partition_balance(model, torch.randn(4, 32), 2, memory_caps=[per_layer, per_layer])
    balance = partition_balance(model, torch.randn(4, 32), 2, memory_caps=[10**6, 10**6])
    assert sum(balance) == 6


def test_intra_op_threads_are_divided_among_cpu_stages() -> None:
    before = torch.get_num_threads()
    seen: dict[int, int] = {}

    class Probe(nn.Module):
        def __init__(self, k: int) -> None:
            super().__init__()
            self.k = k

        def forward(self, x):
            seen[self.k] = torch.get_num_threads()
            return x

    model = nn.Sequential(nn.Linear(2, 2), Probe(0), nn.Linear(2, 2), Probe(1))
    with StalePipeline(
        model, balance=[2, 2], optimizer=sgd, loss_fn=nn.functional.mse_loss,
        intra_op_threads=[1, 1],
    ) as pipe:  # fmt: skip
        pipe.train_step(torch.randn(2, 2), torch.randn(2, 2))
        pipe.drain()
    assert seen == {0: 1, 1: 1}
    assert torch.get_num_threads() == before


# Scheduler steps, start-up failures and interrupted drains ----------------------------------


def test_a_scheduler_step_requested_on_an_idle_pipeline_is_in_the_next_checkpoint(one_thread):
    with StalePipeline(
        small_cnn(), balance=BALANCES[3], optimizer=sgd, loss_fn=loss_fn,
        scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
    ) as pipe:  # fmt: skip
        for x, y in make_batches(3):
            pipe.train_step(x, y)
        pipe.drain()
        pipe.step_schedulers()  # queued for the stage threads; nothing else in flight
        state = pipe.state_dict()
    assert state["scheduler_steps"] == [1, 1, 1]
    assert [s["last_epoch"] for s in state["schedulers"]] == [1, 1, 1]


def test_a_stage_that_fails_to_start_raises_its_own_error(monkeypatch) -> None:
    import echopipe.pipeline.worker as worker

    real = worker.DeviceStream

    def failing(device):
        if threading.current_thread().name == "echopipe-stage-1":
            raise RuntimeError("no memory for a stream (injected)")
        return real(device)

    monkeypatch.setattr(worker, "DeviceStream", failing)
    unhandled: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: unhandled.append(args.exc_value))
    with pytest.raises(PipelineError, match=r"stage 1 failed: .*no memory for a stream"):
        StalePipeline(small_cnn(), balance=BALANCES[2], optimizer=sgd, loss_fn=loss_fn)
    assert unhandled == []  # the other stage ended quietly


def test_a_drain_interrupted_by_ctrl_c_leaves_the_next_drain_complete(
    monkeypatch, one_thread
) -> None:
    """Ctrl-C while the caller waits in drain(): the next drain (a handler that saves a
    checkpoint) must still wait for every stage, not take the interrupted one's tokens."""
    import signal

    import echopipe.pipeline.stage as stage

    gate = threading.Event()
    blocked = threading.Event()
    real = stage.StageCore.backward

    def held_backward(self, index, grad):
        if index == 5 and not gate.is_set():
            blocked.set()
            gate.wait(30)
        return real(self, index, grad)

    monkeypatch.setattr(stage.StageCore, "backward", held_backward)

    def interrupt(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        with StalePipeline(
            small_cnn(), balance=BALANCES[3], optimizer=sgd, loss_fn=loss_fn
        ) as pipe:
            batches = make_batches(12)
            for x, y in batches[:6]:
                pipe.train_step(x, y)
            assert blocked.wait(30)
            signal.setitimer(signal.ITIMER_REAL, 0.05)  # arrives while drain() waits
            with pytest.raises(KeyboardInterrupt):
                pipe.drain()  # cannot finish: a stage's backward is held
            gate.set()
            for x, y in batches[6:]:
                pipe.train_step(x, y)
            state = pipe.state_dict()  # drains again
            assert state["steps_fed"] == 12
            assert state["updates_per_stage"] == [12, 12, 12]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


_LEFT_OPEN = """
import sys
import torch
from echopipe.pipeline import StalePipeline
model = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.ReLU(),
                            torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.Flatten(),
                            torch.nn.Linear(64 * 32 * 32, 10))
pipe = StalePipeline(model, balance=[2, 3], devices=["cpu", "cpu"],
                     optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
                     loss_fn=torch.nn.functional.cross_entropy)
x, y = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
for i in range(4):
    pipe.train_step(x, y)
if sys.argv[1] == "raise":
    raise RuntimeError("an error in the training loop")
if sys.argv[1] == "thread":  # a non-daemon thread still trains when the main thread returns
    import threading

    def more() -> None:
        for i in range(20):
            pipe.train_step(x, y)
        pipe.drain()
        print("trained", pipe.steps_applied)

    threading.Thread(target=more).start()
"""


@pytest.mark.parametrize("how", ["raise", "end", "thread"])
def test_a_pipeline_left_open_at_exit_stops_its_stages_first(how: str) -> None:
    """A script that ends (or fails) with minibatches still in the stage threads: interpreter
    exit stops them before it finalizes, so the process ends with its own status (its daemon
    threads, ended inside torch code, aborted it: SIGABRT). Only after the non-daemon threads
    ended: one still training with the pipeline finishes."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _LEFT_OPEN, how], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == (1 if how == "raise" else 0), done.stderr[-2000:]
    assert "terminate called" not in done.stderr
    if how == "thread":
        assert "trained 24" in done.stdout, done.stderr[-2000:]


def test_each_loss_comes_back_once_across_evaluations_and_checkpoints(tmp_path: Path) -> None:
    """accuracy() and save_checkpoint() drain the pipeline; the losses that drain finishes
    come back from the next call that returns losses (they were dropped)."""
    batches = make_batches(6)
    with StalePipeline(small_cnn(), balance=[3, 3, 2], optimizer=sgd, loss_fn=loss_fn) as pipe:
        first = pipe.run_epoch(batches[:3])
        pipe.accuracy(batches[0][0], batches[0][1])
        second = pipe.run_epoch(batches[3:])
        pipe.save_checkpoint(tmp_path / "ck")
        rest = pipe.drain()
        assert pipe.steps_applied == 6
    assert len(first.losses) + len(second.losses) + len(rest) == 6


def test_accuracy_takes_n_by_1_labels_and_keeps_each_modules_mode() -> None:
    """(N, 1) integer labels (DALI's) score as (N,) ones (they broadcast to N x N), and a
    BatchNorm the user froze with .eval() is still frozen after an evaluation."""
    x, _ = make_batches(1)[0]
    with StalePipeline(small_cnn(), balance=[4, 4], optimizer=sgd, loss_fn=loss_fn) as pipe:
        frozen = pipe.stages[0][0][1]
        assert isinstance(frozen, nn.BatchNorm2d)
        frozen.eval()
        own = pipe.evaluate(x).argmax(dim=1)
        assert pipe.accuracy(x, own) == 1.0
        assert pipe.accuracy(x, own.reshape(-1, 1).int()) == 1.0
        assert not frozen.training and pipe.stages[0][0][0].training


def test_more_argument_checks_name_the_argument() -> None:
    for kw, error, text in [
        ({"recompute": "no"}, TypeError, "recompute must be a bool, got 'no'"),
        ({"max_prefetch": 0}, ValueError, "max_prefetch must be an int >= 1, got 0"),
        ({"max_stale_share": 2.0}, ValueError, "max_stale_share must be in [0, 1], got 2.0"),
    ]:
        with pytest.raises(error) as caught:
            StalePipeline(small_cnn(), balance=[4, 4], optimizer=sgd, loss_fn=loss_fn, **kw)
        assert str(caught.value) == text
    assert HybridSchedule.from_fraction(0.29, 100).pipelined_steps == 29  # 28.999... in floats
