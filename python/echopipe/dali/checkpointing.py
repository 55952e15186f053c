"""Checkpoints of an :class:`~echopipe.dali.EchoPipeline`: ``state_dict`` / ``load_state_dict``.

The state holds the cache contents, the upstream position, the batches DALI had prepared but
nobody consumed, the pass's counters and, with ``enable_checkpointing=True``, DALI's own
checkpoints of both pipelines (see docs/dali.md, "Checkpoints").
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

# 2: the config holds the echo configuration as its own "echo" entry.
_STATE_VERSION = 2


def _compared(config: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint and the pipeline restoring it must agree on."""
    return {
        "mode": config["echo"]["mode"],
        "batch_size": config["batch_size"],
        "upstream_batch_size": config["upstream_batch_size"],
        "epochs": config["epochs"],
    }


class EchoCheckpointing:
    """Mixin for :class:`EchoPipeline`: saving and restoring the echo state."""

    # Set by EchoPipeline; declared here for readers and type checkers.
    config: Any
    cache: Any
    cache_name: str
    upstream: Any
    downstream: Any
    num_fields: int
    upstream_wait_s: float
    _runner: Any
    _queue: Any  # DownstreamQueue once built
    _started: bool
    _enable_checkpointing: bool
    _restore: dict[str, Any] | None

    def state_dict(self) -> dict[str, Any]:
        """Echo state aligned with the batches handed out so far.

        Holds the cache contents (samples with tickets left, RNG and counters), the upstream
        position, batches DALI already prepared but nobody has consumed (kept as numpy arrays and
        replayed first after a restore), and DALI's own checkpoints of both pipelines when
        ``enable_checkpointing=True``. With ``deterministic=True`` a restored pipeline continues
        with exactly the same stream; otherwise it continues with no sample lost or repeated.
        """
        self.start()  # type: ignore[attr-defined]
        self._raise_runner_error()  # type: ignore[attr-defined]
        queue = self._queue
        # Take DALI's prepared batches out first, while the upstream still feeds the cache.
        queue.take_prepared()
        self._runner.pause()
        try:
            state: dict[str, Any] = {
                "version": _STATE_VERSION,
                "config": asdict(self.config),
                "num_fields": self.num_fields,
                "cache": self.cache.state_dict(),
                "layouts": self.cache.layouts,
                "quota": self.cache.quota,
                "runner": self._runner.state(),
                "stash": [
                    ([a.copy() for a in arrays], info.copy()) for arrays, info in queue.stash
                ],
                "input_done": queue.input_done,
                "handed": queue.handed,
                "upstream_wait_s": self.upstream_wait_s,
                "downstream_wait_s": queue.wait_s,
            }
            if self._enable_checkpointing:
                state["dali_upstream"] = self.upstream.checkpoint()
                state["dali_downstream"] = self.downstream.checkpoint()
        finally:
            self._runner.resume()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict` output; must be called before the first batch."""
        if self._started:
            raise RuntimeError(
                "load_state_dict() must be called before the first batch (the DALI pipelines are "
                "built with the checkpoint)"
            )
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported echo state version {state.get('version')!r}")
        saved = state["config"]
        if self.config.epochs == "auto":
            _ = self.shard_size  # type: ignore[attr-defined]  # resolves epochs, as when saved
        mine = _compared(asdict(self.config))
        # The echo factor is runtime state (set_echo_factor): the checkpoint's factor is adopted.
        for key, value in _compared(saved).items():
            if value != mine[key]:
                raise ValueError(
                    f"checkpoint has {key}={value!r} but this pipeline has {key}={mine[key]!r}"
                )
        if self._enable_checkpointing and "dali_upstream" not in state:
            raise ValueError(
                "this pipeline has enable_checkpointing=True but the checkpoint carries no DALI "
                "state (it was saved with enable_checkpointing=False)"
            )
        if self._enable_checkpointing and self.upstream is not None:
            # Built early (shard_size) without DALI's checkpoints; nothing ran, so rebuild.
            self.upstream = self.downstream = None
        self.set_echo_factor(float(saved["echo"]["factor"]))  # type: ignore[attr-defined]
        self._restore = state

    def _apply_restore(self, state: dict[str, Any]) -> None:
        self.cache.load_state_dict(state["cache"])
        self.cache.layouts = list(state["layouts"])
        self.cache.quota = int(state["quota"])
        self._runner.load(state["runner"])
        self._queue.restore(
            state["stash"], state["input_done"], state["handed"], state["downstream_wait_s"]
        )
        if self._runner.ended:
            self.cache.end_of_input()
        self.upstream_wait_s = float(state["upstream_wait_s"])
