"""The stale-weight pipeline as torchgpipe / torch.distributed.pipelining users drive it: weights
tied across layers, losses that return more than a scalar, layers frozen mid-run."""

from __future__ import annotations

import gc
import threading
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

from echopipe.pipeline import PipelineError, StalePipeline
from pipeline_support.train_runs import torchrun_worker

loss_fn = nn.functional.cross_entropy


def _adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


class _Embed(nn.Module):
    def __init__(self, table: nn.Embedding) -> None:
        super().__init__()
        self.table = table

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table(tokens).mean(1)


class _TiedOutput(nn.Module):
    """Logits against the input embedding's table (tied input and output embeddings)."""

    def __init__(self, table: nn.Embedding) -> None:
        super().__init__()
        self.table = table

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.table.weight.t()


def _tied_lm(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    table = nn.Embedding(10, 8)
    return nn.Sequential(_Embed(table), nn.Linear(8, 8), nn.Tanh(), _TiedOutput(table)).double()


def _token_batches(n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randint(0, 10, (4, 5), generator=g), torch.randint(0, 10, (4,), generator=g))
        for _ in range(n)
    ]


def _plain_adam(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    opt = _adam(list(model.parameters()))
    for x, y in batches:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("balance", [[1, 3], [2, 2], [3, 1]])
def test_a_weight_tied_across_stages_is_refused_naming_both_layers(balance) -> None:
    """Two stages sharing a weight would step it with two optimizers on partial gradients (with
    Adam: silently other weights than one optimizer on the whole gradient)."""
    with pytest.raises(ValueError) as info:
        StalePipeline(_tied_lm(), balance=balance, optimizer=_adam, loss_fn=loss_fn)
    assert "'0.table.weight'" in str(info.value) and "'3.table.weight'" in str(info.value)


def test_tied_weights_and_a_repeated_block_within_one_stage_train_as_without_a_pipeline(
    one_thread,
) -> None:
    batches = _token_batches()
    expected, got = _tied_lm(), _tied_lm()
    _plain_adam(expected, batches)
    with StalePipeline(got, balance=[4], optimizer=_adam, loss_fn=loss_fn) as pipe:
        pipe.run_epoch(batches, drain=True)
    for a, b in zip(expected.parameters(), got.parameters(), strict=True):
        assert torch.equal(a, b)

    def repeated() -> nn.Sequential:  # one block applied twice (ALBERT-style sharing)
        torch.manual_seed(0)
        block = nn.Linear(6, 6)
        return nn.Sequential(nn.Linear(6, 6), block, nn.Tanh(), block, nn.Linear(6, 3)).double()

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 6, generator=g, dtype=torch.float64), torch.tensor([0, 1, 2, 0]))] * 3
    expected, got = repeated(), repeated()
    _plain_adam(expected, data)
    with StalePipeline(
        got, balance=[1, 3, 1], optimizer=_adam, loss_fn=loss_fn, pipelined=False
    ) as pipe:
        pipe.run_epoch(data, drain=True)
    for a, b in zip(expected.parameters(), got.parameters(), strict=True):
        assert torch.equal(a, b)


def _loss_and_accuracy(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return loss_fn(output, target), (output.argmax(1) == target).double().mean()


def _lightning_style(output: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"loss": loss_fn(output, target)}


def _per_sample(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return loss_fn(output, target, reduction="none")


def _detached(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.tensor(loss_fn(output, target).item())


@pytest.mark.parametrize(
    ("bad_loss", "error", "named"),
    [
        (_loss_and_accuracy, TypeError, "tuple"),
        (_lightning_style, TypeError, "dict"),
        (_per_sample, ValueError, "(4,)"),
        (_detached, ValueError, "no gradient"),
    ],
)
def test_a_loss_fn_returning_more_than_the_loss_is_named(bad_loss, error, named) -> None:
    """A loss with its metrics (tuple, dict) failed inside the engine on ``.detach()``; a
    per-sample loss failed in the caller's ``.item()``, and a detached one in the stage before
    ("got no gradient"), naming neither ``loss_fn`` nor what it returned."""
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    x = torch.randn(4, 6, dtype=torch.float64)
    with (
        StalePipeline(model, balance=[2, 1], optimizer=_adam, loss_fn=bad_loss) as pipe,
        pytest.raises(PipelineError) as info,
    ):
        pipe.train_step(x, torch.tensor([0, 1, 2, 0]))
        pipe.drain()
    assert info.value.stage == 1
    assert isinstance(info.value.__cause__, error)
    assert "loss_fn" in str(info.value) and named in str(info.value)


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)
    ).double()


def _momentum_sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-2)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [
        (
            torch.randn(4, 6, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (4,), generator=g),
        )
        for _ in range(n)
    ]


def test_freezing_and_unfreezing_a_stage_mid_run_trains_as_without_a_pipeline(one_thread) -> None:
    """Fine-tuning freezes layers for a while: a parameter frozen after the pipeline was built
    kept getting gradients and updates (momentum and weight decay moved it), where a plain loop
    leaves it alone until it is unfrozen."""
    batches = _batches(9)
    expected, got = _mlp(), _mlp()
    opt = _momentum_sgd(list(expected.parameters()))
    for i, (x, y) in enumerate(batches):
        expected[0].requires_grad_(i not in range(3, 6))
        opt.zero_grad()
        loss_fn(expected(x), y).backward()
        opt.step()
    with StalePipeline(
        got, balance=[2, 3], optimizer=_momentum_sgd, loss_fn=loss_fn, pipelined=False
    ) as pipe:
        for start in range(0, 9, 3):
            got[0].requires_grad_(start != 3)  # while drained: the stage threads read it
            pipe.run_epoch(batches[start : start + 3], drain=True)
    for a, b in zip(expected.parameters(), got.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("recompute", [False, True])
def test_a_stage_frozen_while_pipelined_stays_put(recompute: bool, one_thread) -> None:
    model = _mlp()
    with StalePipeline(
        model, balance=[2, 2, 1], optimizer=_momentum_sgd, loss_fn=loss_fn, recompute=recompute
    ) as pipe:
        pipe.run_epoch(_batches(4), drain=True)
        model[2].requires_grad_(False)
        frozen = [p.clone() for p in model[2].parameters()]
        first = model[0].weight.clone()
        pipe.run_epoch(_batches(4), drain=True)
        assert all(torch.equal(a, b) for a, b in zip(frozen, model[2].parameters(), strict=True))
        assert not torch.equal(first, model[0].weight)  # the stages around it still train


def test_unfreezing_a_parameter_no_optimizer_holds_is_named() -> None:
    model = _mlp()
    model[2].requires_grad_(False)
    with StalePipeline(model, balance=[2, 2, 1], optimizer=_momentum_sgd, loss_fn=loss_fn) as pipe:
        pipe.run_epoch(_batches(2), drain=True)
        model[2].requires_grad_(True)
        with pytest.raises(PipelineError) as info:
            pipe.run_epoch(_batches(2), drain=True)
    assert info.value.stage == 1
    assert isinstance(info.value.__cause__, ValueError)
    assert "'0.weight'" in str(info.value)


@pytest.mark.distributed
def test_a_layer_frozen_on_data_parallel_replicas_stays_put(tmp_path: Path) -> None:
    """The replicas' gradient average filled a frozen parameter's missing gradient with zeros,
    and momentum and weight decay then moved it."""
    torchrun_worker(
        Path(__file__).parent / "pipeline_support" / "dist_freeze_worker.py", tmp_path, 180
    )
    for rank in range(2):
        saved = torch.load(tmp_path / f"rank{rank}.pt")
        for key, value in saved["before"].items():
            assert torch.equal(value, saved["after"][key]), (rank, key)


class _TwoHeads(nn.Module):
    """Main and auxiliary logits (Inception, deep supervision), as a tuple or a dict."""

    def __init__(self, as_dict: bool) -> None:
        super().__init__()
        self.main, self.aux, self.as_dict = nn.Linear(8, 3), nn.Linear(8, 3), as_dict

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, ...] | dict[str, torch.Tensor]:
        main, aux = self.main(h), self.aux(h)
        return {"main": main, "aux": aux} if self.as_dict else (main, aux)


def _two_heads_loss(output, target: torch.Tensor) -> torch.Tensor:
    main, aux = output.values() if isinstance(output, dict) else output
    return loss_fn(main, target) + 0.4 * loss_fn(aux, target)


@pytest.mark.parametrize("as_dict", [False, True])
def test_a_model_with_an_auxiliary_head_trains_and_evaluates(as_dict: bool, one_thread) -> None:
    """The last stage's output goes to ``loss_fn`` only, so it may be several heads; the engine
    failed on it with "'tuple' object has no attribute 'detach'", and ``evaluate`` on
    ``.cpu()``."""

    def model() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), _TwoHeads(as_dict)).double()

    batches = _batches(5)
    expected, got = model(), model()
    opt = _momentum_sgd(list(expected.parameters()))
    for x, y in batches:
        opt.zero_grad()
        _two_heads_loss(expected(x), y).backward()
        opt.step()
    with StalePipeline(
        got, balance=[2, 1], optimizer=_momentum_sgd, loss_fn=_two_heads_loss, pipelined=False
    ) as pipe:
        pipe.run_epoch(batches, drain=True)
        x = torch.cat([b[0] for b in batches])
        outputs = pipe.evaluate(x, batch_size=7)
        with pytest.raises(TypeError):
            pipe.accuracy(x, torch.cat([b[1] for b in batches]))
    for a, b in zip(expected.parameters(), got.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)
    with torch.no_grad():
        reference = expected.eval()(x)
    assert type(outputs) is type(reference)
    if as_dict:
        reference, outputs = list(reference.values()), list(outputs.values())
    for a, b in zip(reference, outputs, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


def test_the_documented_float16_recipe_equals_a_grad_scaler_loop(one_thread) -> None:
    """docs/pipeline.md: ``LossScaler`` stands in for ``torch.amp.GradScaler``, whose
    backward and step the stage threads run."""
    from echopipe.training.amp import LossScaler

    def model() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)
        )

    batches = [(x.float(), y) for x, y in _batches(6)]
    expected, got = model(), model()
    opt, grad_scaler = _momentum_sgd(list(expected.parameters())), torch.amp.GradScaler("cpu")
    for x, y in batches:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(expected(x), y)
        grad_scaler.scale(loss).backward()
        grad_scaler.step(opt)
        grad_scaler.update()
    scaler = LossScaler(2)
    with (
        StalePipeline(
            got, balance=[2, 3], optimizer=_momentum_sgd, loss_fn=scaler.wrap_loss(loss_fn),
            grad_hook=scaler.grad_hook, pipelined=False,
        ) as pipe,
        torch.autocast("cpu", dtype=torch.float16),
    ):  # fmt: skip
        pipe.run_epoch(batches, drain=True)
    assert scaler.scale == grad_scaler.get_scale()
    for a, b in zip(expected.parameters(), got.parameters(), strict=True):
        assert torch.equal(a, b)


def test_an_optimizer_over_the_whole_model_is_refused_naming_the_stage() -> None:
    """A factory that ignores its argument (``SGD(model.parameters())``) gave every stage an
    optimizer over every stage's weights: each stepped the other stages' weights whenever their
    gradients happened to be set, so the result depended on thread timing."""
    model = _mlp()
    with pytest.raises(ValueError) as info:
        StalePipeline(
            model,
            balance=[2, 3],
            optimizer=lambda params: torch.optim.SGD(model.parameters(), lr=0.05),
            loss_fn=loss_fn,
        )
    assert "stage 0" in str(info.value)

    def without_biases(params: list[nn.Parameter]) -> torch.optim.Optimizer:  # a subset is fine
        return torch.optim.SGD([p for p in params if p.ndim > 1], lr=0.05)

    with StalePipeline(model, balance=[2, 3], optimizer=without_biases, loss_fn=loss_fn) as pipe:
        bias = model[4].bias.clone()
        pipe.run_epoch(_batches(2), drain=True)
        assert torch.equal(bias, model[4].bias)


class _Gate(nn.Module):
    """Holds the forward of its ``hold``-th minibatch until ``opened`` is set."""

    def __init__(self, hold: int) -> None:
        super().__init__()
        self.hold, self.calls, self.opened = hold, 0, threading.Event()
        self.reached = threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.hold:
            self.reached.set()
            self.opened.wait()
        return x


def _bn_model(gate: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8), gate, nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3)
    ).double()


def test_model_eval_while_minibatches_are_in_flight_is_named(one_thread) -> None:
    """torchgpipe's evaluation loop (``model.eval()`` right after the epoch) ran the forwards
    still in flight in eval mode: BatchNorm's running statistics not updated, and other
    weights afterwards, with nothing said."""
    gate = _Gate(hold=3)
    model = _bn_model(gate)
    with StalePipeline(model, balance=[2, 3], optimizer=_momentum_sgd, loss_fn=loss_fn) as pipe:
        pipe.run_epoch(_batches(3))
        assert gate.reached.wait(timeout=60)  # minibatch 2 is inside stage 0's forward
        model.eval()
        gate.opened.set()
        with pytest.raises(PipelineError) as info:
            pipe.evaluate(_batches(1)[0][0])
    assert info.value.stage == 1
    assert isinstance(info.value.__cause__, RuntimeError)  # (minibatch 1 or 2, as it runs)


def test_model_eval_after_a_drain_evaluates_as_evaluate_does(one_thread) -> None:
    """The same loop with ``drain()`` first trains and evaluates as ``evaluate()`` alone."""
    x = _batches(1)[0][0]
    results = []
    for own_loop in (False, True):
        model = _bn_model(nn.Identity())
        with StalePipeline(model, balance=[2, 3], optimizer=_momentum_sgd, loss_fn=loss_fn) as pipe:
            for _ in range(2):
                pipe.run_epoch(_batches(4))
                if own_loop:
                    pipe.drain()
                    model.eval()
                    with torch.no_grad():
                        out = model(x)
                    model.train()
                else:
                    out = pipe.evaluate(x)
            pipe.drain()
        results.append((out, list(model.state_dict().values())))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1], strict=True))


def test_automatic_balances_keep_a_tied_weight_in_one_stage() -> None:
    """``balance="auto"`` chose a split across the tie, which the pipeline then refused."""
    from echopipe.pipeline import balance_by_cost

    def tied(seed: int = 0) -> nn.Sequential:
        torch.manual_seed(seed)
        table = nn.Embedding(10, 8)
        return nn.Sequential(
            _Embed(table), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), _TiedOutput(table),
            nn.Identity(),
        )  # fmt: skip

    tokens = torch.randint(0, 10, (4, 5))
    assert balance_by_cost(tied(), tokens, 2) == [5, 1]
    with StalePipeline(
        tied(), balance="auto", num_stages=2, sample_input=tokens, balance_cost="model",
        optimizer=_adam, loss_fn=loss_fn,
    ) as pipe:  # fmt: skip
        assert pipe.balance == [5, 1]
    with pytest.raises(ValueError):  # children 0 to 4 in one stage leave one cut
        balance_by_cost(tied(), tokens, 3)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's own, importing dynamo
def test_a_compiled_sequential_is_refused_saying_to_compile_its_children() -> None:
    """``torch.compile(model)`` hides the sequential the stages are cut from; compiling each
    child works (checked by hand against eager training: same losses, weights within 3e-8)."""
    model = _mlp()
    with pytest.raises(TypeError) as info:
        StalePipeline(torch.compile(model), balance=[2, 3], optimizer=_adam, loss_fn=loss_fn)
    assert "OptimizedModule" in str(info.value) and "children" in str(info.value)


@pytest.mark.parametrize("reused", ["input", "target"])
def test_a_buffer_refilled_after_train_step_is_named(reused: str) -> None:
    """A plain loop may refill one input buffer per minibatch; train_step returns before the
    stages read it, so the stages trained on a later minibatch's values, silently (or, for an
    input refilled after its forward, failed in autograd's version check, naming neither)."""
    batches = _batches(6)
    x_buffer, y_buffer = batches[0][0].clone(), batches[0][1].clone()
    model = _mlp()
    gate = _Gate(hold=1)  # stage 0 waits until every minibatch is fed
    model.insert(0, gate)
    pipe = StalePipeline(
        model, balance=[3, 3], optimizer=_momentum_sgd, loss_fn=loss_fn, max_prefetch=8
    )
    # Stage 0 may check minibatch 0's input before or after the loop refills it (CI saw
    # after): the failure is then raised by a later train_step, else by drain().
    with pipe, pytest.raises(PipelineError) as info:
        try:
            for x, y in batches:
                if reused == "input":
                    x_buffer.copy_(x)
                    x = x_buffer
                else:
                    y_buffer.copy_(y)
                    y = y_buffer
                pipe.train_step(x, y)
        finally:
            gate.opened.set()
        pipe.drain()
    assert info.value.stage == (0 if reused == "input" else 1)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert f"the {reused} of minibatch" in str(info.value)


class _NormalizeInPlace(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sub_(0.5).mul_(2.0)


def test_recompute_on_stage_0_sees_the_input_before_an_in_place_first_layer(one_thread) -> None:
    """Stage 0 saved its input by reference for the recompute, after a first layer had
    changed it in place: the recompute normalised it twice (weights 0.18 away). On stage 0 the
    weight gradient needs no weight, so both rules must agree exactly."""
    results = []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(
            _NormalizeInPlace(), nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)
        ).double()
        with StalePipeline(
            model, balance=[2, 2], optimizer=_momentum_sgd, loss_fn=loss_fn, recompute=recompute
        ) as pipe:
            pipe.run_epoch([(x.clone(), y) for x, y in _batches(6)], drain=True)
        results.append(list(model.parameters()))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_a_detached_loss_on_a_single_stage_is_named_not_a_run_that_trains_nothing() -> None:
    model = _mlp()
    with (
        StalePipeline(model, optimizer=_adam, loss_fn=_detached) as pipe,
        pytest.raises(PipelineError) as info,
    ):
        pipe.run_epoch(_batches(2), drain=True)
    assert isinstance(info.value.__cause__, ValueError)


class _FailAt(nn.Module):
    def __init__(self, call: int) -> None:
        super().__init__()
        self.call, self.calls = call, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.call:
            raise ValueError("a stage's own error")
        return x


def test_a_failed_and_closed_pipeline_lets_go_of_its_minibatches() -> None:
    """The minibatches in flight when a stage failed (inputs, activations, graphs) stayed
    referenced by a closed pipeline for as long as the object lived."""
    model = nn.Sequential(
        nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), _FailAt(4), nn.Linear(8, 3)
    ).double()
    fed: list[weakref.ref[torch.Tensor]] = []

    def feed(pipe: StalePipeline) -> None:
        for x, y in _batches(8):
            fed.append(weakref.ref(x))
            pipe.train_step(x, y)
        pipe.drain()

    with (
        StalePipeline(model, balance=[2, 2, 1], optimizer=_adam, loss_fn=loss_fn) as pipe,
        pytest.raises(PipelineError),
    ):
        feed(pipe)
    gc.collect()
    assert all(ref() is None for ref in fed), "a fed input is still referenced"
    assert pipe.steps_fed >= 4  # the pipeline object itself is still alive here
