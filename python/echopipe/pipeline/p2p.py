"""Point-to-point messages between the ranks of a distributed pipeline.

:class:`PeerLink` sends and receives tensors of any shape: each message is a small header
(rank count, dtype, shape) followed by the data, so shapes may change between minibatches (a
short last batch). Sends are asynchronous and reaped lazily; receives block. With a timeout, a
receive or a send that does not complete in time raises :class:`TimeoutError` naming the peer
rank and the message (on CPU tensors, i.e. Gloo; NCCL bounds its waits with the process
group's own ``timeout``).
"""

from __future__ import annotations

import datetime
import math
import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from .ranks import StageTopology

__all__ = [
    "TAG_ACT",
    "TAG_EVAL",
    "TAG_GRAD",
    "TAG_TARGET",
    "PeerLink",
    "link_timeout",
]

# Message kinds, for error messages only. Every message goes with tag 0: NCCL ignores tags, so
# each pair of ranks must post its receives in the order the peer posts the sends, and using no
# tags on Gloo either makes the tests over Gloo check that order too.
#
# Messages down the pipeline (activations, targets, evaluation) and up it (gradients, results)
# travel in two process groups. NCCL runs a pair's sends and receives of one group in posting
# order on one stream, and a send of a large tensor waits for its receive: stage k sending
# activations down while stage k + 1 sends gradients up, each then receiving, would wait on each
# other (NCCL asks for such a send and receive to be grouped, but here the receive's size comes
# from a header the receiver must read first, so it cannot join the group). With one group per
# direction, each pair's stream carries one direction only: every send meets a receive posted
# in the same order, and no wait crosses another.
TAG_ACT = 1
TAG_GRAD = 2
TAG_TARGET = 3
TAG_EVAL = 4
_P2P_TAG = 0
_TAG_NAMES = {
    TAG_ACT: "activations",
    TAG_GRAD: "gradients",
    TAG_TARGET: "targets",
    TAG_EVAL: "evaluation activations",
}
_MAX_DIMS = 8
_NAMED_RANKS = 8  # a collective's error lists the ranks it waited for, up to this many
_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
]


def link_timeout(timeout_s: float | None) -> datetime.timedelta | None:
    """``timeout_s`` checked (a finite number of seconds > 0, or ``None``) as a timedelta."""
    if timeout_s is not None and (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, int | float)
        or not math.isfinite(timeout_s)
        or timeout_s <= 0
    ):
        raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
    return None if timeout_s is None else datetime.timedelta(seconds=timeout_s)


class PeerLink:
    """Sends and receives of one rank's stage (see the module docstring).

    Args:
        topology: where this rank sits (for the names in timeout errors).
        device: this rank's device; received tensors land there, and on CUDA sent CPU tensors
            are moved there first (NCCL sends device memory).
        timeout: longest wait for one message on CPU (Gloo), or ``None``.
    """

    def __init__(
        self,
        topology: StageTopology,
        device: torch.device,
        timeout: datetime.timedelta | None,
    ) -> None:
        self.device = device
        self.rank = topology.rank
        self.stage_index = topology.stage_index
        self.num_stages = topology.num_stages
        self._base = topology.base
        self._timeout = timeout
        self._pending_sends: deque[tuple[Any, tuple[torch.Tensor, torch.Tensor, int, int]]] = (
            deque()
        )
        # Every rank creates both groups, in the same order, when it builds its link.
        everyone = list(range(dist.get_world_size()))
        self._down_group: Any = dist.new_group(everyone)
        self._up_group: Any = dist.new_group(everyone)

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> torch.Tensor:
        """Post an asynchronous send of ``tensor`` (header, then data) to rank ``dst``; returns
        the tensor the send reads (``tensor`` itself unless it had to be copied), which Gloo
        reads only once ``dst`` posts its receive."""
        tensor = tensor.detach().contiguous()
        if self.device.type == "cuda" and not tensor.is_cuda:
            tensor = tensor.to(self.device)
        if tensor.dim() > _MAX_DIMS:
            raise ValueError(f"cannot send a tensor with {tensor.dim()} > {_MAX_DIMS} dims")
        if tensor.dtype not in _DTYPES:
            raise TypeError(f"cannot send dtype {tensor.dtype}")
        header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64)
        header[0] = tensor.dim()
        header[1] = _DTYPES.index(tensor.dtype)
        header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        header = header.to(tensor.device)
        group = self._group_of(self.rank, dst)
        works = [
            dist.isend(header, dst, group=group, tag=_P2P_TAG),
            dist.isend(tensor, dst, group=group, tag=_P2P_TAG),
        ]
        for work in works:
            # The tensors stay referenced until the send completes.
            self._pending_sends.append((work, (header, tensor, dst, tag)))
        self.reap_sends()
        return tensor

    def recv(self, src: int, tag: int) -> torch.Tensor:
        """Receive one tensor (header, then data) from rank ``src``; blocks."""
        header = torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=self.device)
        group = self._group_of(src, self.rank)
        self.wait(dist.irecv(header, src, group=group, tag=_P2P_TAG), "receive", src, tag)
        values = header.tolist()
        ndim, dtype = int(values[0]), _DTYPES[int(values[1])]
        shape = [int(v) for v in values[2 : 2 + ndim]]
        tensor = torch.empty(shape, dtype=dtype, device=self.device)
        self.wait(dist.irecv(tensor, src, group=group, tag=_P2P_TAG), "receive", src, tag)
        return tensor

    def _group_of(self, sender: int, receiver: int) -> Any:
        """The group a message from ``sender`` to ``receiver`` travels in: down the pipeline
        (to a later stage) or up it."""
        return self._down_group if sender < receiver else self._up_group

    def wait(self, work: Any, what: str, peer: int, tag: int) -> None:
        """Waits for one point-to-point operation, bounded by ``timeout_s`` on CPU (Gloo).

        On CPU a peer that died (its connection closed or reset) raises
        :class:`ConnectionError` naming it, instead of Gloo's words about a socket.
        """
        if self.device.type != "cpu":
            work.wait()
            return
        # Gloo raises a plain RuntimeError for a timeout as for any other failure; a wait that
        # failed only after its whole timeout had passed is taken as the timeout.
        started = time.monotonic()
        message = _TAG_NAMES.get(tag, f"tag {tag}")
        route = (
            f"{what} {message} {'from' if what == 'receive' else 'to'} rank {peer} "
            f"(stage {(peer - self._base) % self.num_stages})"
        )
        try:
            if self._timeout is None:
                work.wait()
            else:
                work.wait(timeout=self._timeout)
        except RuntimeError as exc:
            if self._timeout is None or time.monotonic() - started < self._timeout.total_seconds():
                raise ConnectionError(
                    f"rank {self.rank} (stage {self.stage_index}) failed to {route}: that "
                    "rank has probably failed or exited (see its own error)"
                ) from exc
            raise TimeoutError(
                f"rank {self.rank} (stage {self.stage_index}) waited more than "
                f"{self._timeout.total_seconds():g} s to {route}; is that rank "
                "alive and calling the same methods in the same order?"
            ) from exc

    def wait_collective(self, work: Any, what: str) -> None:
        """Waits for a collective that every rank joins (``what`` names it), bounded by
        ``timeout_s`` on CPU (Gloo) as :meth:`wait` is: a rank that stopped calling the
        pipeline's methods would otherwise hold the others for the process group's timeout."""
        if self.device.type != "cpu" or self._timeout is None:
            work.wait()
            return
        started = time.monotonic()
        # Gloo's error names an address, not a rank: name the ranks this one waited for.
        others = [r for r in range(dist.get_world_size()) if r != self.rank]
        if len(others) == 1:
            waited, culprit = f"rank {others[0]}", f"rank {others[0]}"
        elif len(others) <= _NAMED_RANKS:
            waited, culprit = f"ranks {others}", f"one of ranks {others}"
        else:
            waited = f"the other {len(others)} ranks"
            culprit = f"one of {waited}"
        try:
            work.wait(timeout=self._timeout)
        except RuntimeError as exc:
            if time.monotonic() - started < self._timeout.total_seconds():
                raise ConnectionError(
                    f"rank {self.rank} (stage {self.stage_index}) failed in {what}: {culprit} "
                    "has probably failed or exited (see its own error)"
                ) from exc
            raise TimeoutError(
                f"rank {self.rank} (stage {self.stage_index}) waited more than "
                f"{self._timeout.total_seconds():g} s for {waited} to join {what}; is every "
                "rank alive and calling the same methods in the same order?"
            ) from exc

    def reap_sends(self, wait_all: bool = False) -> None:
        """Drop completed sends (in order); with ``wait_all``, wait for every one first."""
        while self._pending_sends:
            work, (_, _, dst, tag) = self._pending_sends[0]
            if wait_all:
                self.wait(work, "send", dst, tag)
            elif not work.is_completed():
                return
            self._pending_sends.popleft()
