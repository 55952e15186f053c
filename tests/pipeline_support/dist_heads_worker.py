"""torchrun worker: a two-stage pipeline whose last stage returns two heads (logits and
auxiliary logits), scored with ``accuracy`` and evaluated in chunks of 4 of its 6 rows.

Usage: ``torchrun --nproc_per_node=2 dist_heads_worker.py OUTDIR``. Each rank writes what
``accuracy`` raised, and what ``evaluate(x, batch_size=4)`` returned (``None`` off the last
stage; the heads' shapes, and whether they equal one chunk's), then what ``evaluate`` and
``accuracy`` with ``batch_size=0`` raised, to ``OUTDIR/rank<r>.txt``; then
the ranks meet at a barrier, so a rank left waiting for the other's answer shows as its
pipeline's timeout, not as a closed connection.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from echopipe.pipeline import DistributedStalePipeline


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main, self.aux = nn.Linear(8, 3), nn.Linear(8, 3)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.main(h), self.aux(h)


def _loss(out: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out[0], y) + 0.3 * nn.functional.cross_entropy(out[1], y)


def _compare(chunked: object, whole: tuple[torch.Tensor, ...]) -> str:
    """What evaluate returned in chunks, and whether it equals the one-chunk evaluation."""
    if not isinstance(chunked, tuple):
        return type(chunked).__name__
    shapes = " ".join(str(tuple(t.shape)) for t in chunked)
    same = all(torch.allclose(a, b) for a, b in zip(chunked, whole, strict=True))
    return f"tuple {shapes} {'equal' if same else 'different'}"


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), TwoHeads())
    pipe = DistributedStalePipeline(
        model, balance=[2, 1], optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=_loss,
        timeout_s=10,
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)
    first = pipe.topology.is_first
    try:
        for _ in range(3):
            pipe.train_step(x if first else None, y if first else None)
        pipe.drain()
        pipe.accuracy(x if first else None, y if first else None, batch_size=4)
        outcome = "no error"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    try:
        chunked = pipe.evaluate(x if first else None, batch_size=4)
        whole = pipe.evaluate(x if first else None)
        heads = "None" if chunked is None else _compare(chunked, whole)
    except Exception as exc:
        heads = f"{type(exc).__name__}: {exc}"
    refused = []
    for call in (pipe.evaluate, functools.partial(pipe.accuracy, target=y if first else None)):
        try:  # every rank refuses it before any message
            call(x if first else None, batch_size=0)
            refused.append("no error")
        except Exception as exc:
            refused.append(f"{type(exc).__name__}: {exc}")
    lines = [outcome, heads, *refused]
    (out / f"rank{dist.get_rank()}.txt").write_text("\n".join(lines) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
