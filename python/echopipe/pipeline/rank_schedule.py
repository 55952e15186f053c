"""One rank's operation order in a :class:`~echopipe.pipeline.DistributedStalePipeline`.

:class:`RankSchedule` runs this rank's forwards and backwards in the fixed order of
:class:`~echopipe.pipeline.StalePipeline` (forward while the stage holds at most ``D_k``
minibatches in flight, else backward; see ``schedule.py``), receiving from and sending to its
neighbours through the rank's :class:`~echopipe.pipeline.p2p.PeerLink`.

Stage 0 reads the caller's ``x`` and target inside ``train_step``, but keeps reading them after
it returns: autograd's saved tensors and an output that is a view of ``x`` point into ``x``,
and Gloo's ``isend`` copies the target only when the last stage posts its receive. Until
stage 0 has run the minibatch's backward (by which time every other stage is done with it), a
caller that refills either tensor in place changes what the pipeline trains on. Their version
counters, noted after the forward (a first layer may change ``x`` in place itself), tell it,
as :class:`~echopipe.pipeline.StalePipeline`'s stage workers tell it. The forward also notes
the stage's train/eval modes, which a recompute at the backward checks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from .modes import module_modes
from .p2p import TAG_ACT, TAG_GRAD, TAG_TARGET, PeerLink
from .ranks import StageTopology
from .results import LossRecord, refilled
from .stage import StageCore, caller_autocast
from .worker import PipelineError

__all__ = ["RankSchedule"]


@dataclass
class _Held:
    """The caller's tensors that stage 0 still reads for one minibatch, and their versions."""

    index: int
    tensors: tuple[tuple[str, torch.Tensor, int], ...]


def _same_memory(used: torch.Tensor, given: torch.Tensor) -> bool:
    """Whether ``used`` reads the caller's ``given`` (itself or a view), not a copy."""
    return (
        used.device == given.device
        and used.untyped_storage().data_ptr() == given.untyped_storage().data_ptr()
    )


class RankSchedule:
    """Forwards and backwards of one rank's stage, with the messages they need.

    Args:
        topology: where this rank sits.
        core: its stage's forward, backward and update.
        link: its messages to and from the neighbouring ranks.
        device: its device (stage 0 moves the caller's tensors there).
    """

    def __init__(
        self, topology: StageTopology, core: StageCore, link: PeerLink, device: torch.device
    ) -> None:
        self.topology = topology
        self.core = core
        self.link = link
        self.device = device
        self.inputs: deque[tuple[torch.Tensor, torch.Tensor]] = deque()  # stage 0: fed, not run
        self.losses: list[LossRecord] = []  # last stage: finished, not yet handed out
        self._held: deque[_Held] = deque()

    def advance(self, steps_fed: int, drain: bool) -> None:
        """Run forwards and backwards until this rank may return to the caller: every fed
        minibatch forwarded, and at most ``D_k`` in flight (none with ``drain``)."""
        core = self.core
        while True:
            can_forward = core.last_forward_index + 1 < steps_fed
            if len(core.in_flight) <= core.staleness:
                if can_forward:
                    self._forward_one()
                elif drain and core.in_flight:
                    self._backward_one()
                else:
                    return
            else:
                self._backward_one()

    def take_losses(self) -> list[LossRecord]:
        """The losses finished since the last call (last stage only), oldest first."""
        finished, self.losses = self.losses, []
        return finished

    def _forward_one(self) -> None:
        core, topology, link = self.core, self.topology, self.link
        index = core.last_forward_index + 1
        target: torch.Tensor | None = None
        if topology.is_first:
            given = self.inputs.popleft()
            x = given[0].to(self.device)
            if topology.is_last:
                target = tgt = given[1].to(self.device)
            else:
                tgt = link.send(given[1], topology.last_rank, TAG_TARGET)
        else:
            assert topology.prev is not None
            if topology.is_last:
                # Stage 0 sends the target before its activations; with two stages both go to
                # this rank, and without tags the receives must come in the same order.
                target = link.recv(topology.base, TAG_TARGET)
            x = link.recv(topology.prev, TAG_ACT)
        # The forward runs now, inside train_step; a recompute runs at the backward, after the
        # caller may have switched modes (model.eval() without a drain), which it refuses.
        modes = tuple(
            module_modes([core.module])[0] if k == topology.stage_index else ()
            for k in range(topology.num_stages)
        )
        out, loss = core.forward(index, x, target, caller_autocast(), modes)
        if topology.is_first:
            # Copies made above (to another device) are the pipeline's own: nobody else can
            # change them, and holding them would keep device memory.
            kept = tuple(
                (name, mine, mine._version)
                for name, used, mine in (("input", x, given[0]), ("target", tgt, given[1]))
                if _same_memory(used, mine)
            )
            self._held.append(_Held(index, kept))
        if topology.is_last:
            assert loss is not None
            self.losses.append(LossRecord(index, loss.detach()))
        else:
            assert topology.next is not None
            link.send(out, topology.next, TAG_ACT)

    def _backward_one(self) -> None:
        core, topology, link = self.core, self.topology, self.link
        index = core.in_flight[0].index
        if topology.is_first:
            # The caller cannot run before this backward ends, by which time every stage is
            # done with the minibatch; checking before the receive leaves the state as it was
            # when it raises, so a later call raises again.
            self._check_unchanged(self._held[0])
            self._held.popleft()
        grad = None
        if not topology.is_last:
            assert topology.next is not None
            grad = link.recv(topology.next, TAG_GRAD)
        grad_in = core.backward(index, grad)
        if not topology.is_first:
            assert topology.prev is not None
            if grad_in is None:  # (the previous rank waits for a tensor: no way to say "none")
                raise TypeError(
                    f"stage {topology.stage_index}'s input carries no gradient (an integer "
                    "tensor between stages?): DistributedStalePipeline sends every stage's "
                    "input gradient back, so the tensors between stages must be floating "
                    "point; move the boundary, or use StalePipeline"
                )
            link.send(grad_in, topology.prev, TAG_GRAD)

    def _check_unchanged(self, held: _Held) -> None:
        error = refilled(held.tensors, held.index, "stage 0 finished with it",
                         "until that minibatch's backward")  # fmt: skip
        if error is not None:
            raise PipelineError(0, f"rank {self.topology.rank}: {error}")
