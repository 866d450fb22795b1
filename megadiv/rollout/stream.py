"""Rollout as a stream of GRPO groups: submit one group (n samples of one prompt) at a time, take
groups back as they finish, abort what is left once a step has enough.

    stream = engine.open_stream(params)          # every engine offers one
    stream.submit(key, prompt_ids)               # a group: params.n completions of one prompt
    group = stream.next_done()                   # the next finished group, in any order
    stream.abort_pending()                       # the step is full: drop or abort the rest

The rollout driver (trainer/driver.py) keeps as many groups in flight as the step still needs
(over-sampling with dynamic sampling) and grades each group the moment it is back, so rewards run
beside generation. Two streams implement the protocol:

- :class:`megadiv.rollout.fleet_stream.FleetStream` (SGLang servers): one request per group to
  the least-loaded healthy server, heartbeats, a lost server's groups re-sent, the rest aborted
  with ``/abort_request``;
- :class:`WaveStream` (the embedded engine): the groups submitted since the last wave are
  generated in one batch ``generate`` call (what an in-process engine is fast at), then handed
  back one by one. Nothing is in flight between calls, so aborting drops the queue.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Hashable, Protocol, Sequence

from megadiv.rollout.engine import Completion, SamplingParams


@dataclass
class GroupResult:
    """One finished group: the completions of ``prompt`` submitted under ``key``."""

    key: Hashable
    prompt: list[int]
    completions: list[Completion]
    server: str = "local"
    """Who generated it (a server URL, or "local" for an in-process engine)."""


@dataclass
class StreamStats:
    """What a stream did since it was opened (the driver logs these as rollout/* metrics)."""

    groups_by_server: dict[str, int] = field(default_factory=dict)
    """Groups finished per server."""
    resent_groups: int = 0
    """Groups re-sent because their server was lost."""
    aborted_groups: int = 0
    """Groups in flight or queued when abort_pending was called."""
    dropped_servers: list[str] = field(default_factory=list)
    """Servers dropped from the fleet (failed health check or requests), in order."""


class GroupStream(Protocol):
    stats: StreamStats

    def submit(self, key: Hashable, prompt: Sequence[int]) -> None:
        """Queue one group: ``params.n`` completions of ``prompt``, handed back under ``key``."""

    def next_done(self) -> GroupResult:
        """Block until a submitted group is finished and return it (any order). Raises
        RolloutError when nothing can finish (no server left, an engine error)."""

    @property
    def pending(self) -> int:
        """Groups submitted and not yet returned by next_done."""

    def abort_pending(self) -> int:
        """Give up every pending group (abort those running on servers); the number given up."""

    def close(self) -> None:
        """Abort what is pending and release the stream's resources."""


class WaveStream:
    """A GroupStream over a batch ``generate(prompts, params)`` (see the module docstring)."""

    def __init__(self, engine: Any, params: SamplingParams):
        self.engine, self.params = engine, params
        self.stats = StreamStats()
        self._queued: list[tuple[Hashable, list[int]]] = []
        self._done: deque[GroupResult] = deque()

    def submit(self, key: Hashable, prompt: Sequence[int]) -> None:
        self._queued.append((key, list(prompt)))

    def next_done(self) -> GroupResult:
        if not self._done:
            if not self._queued:
                raise RuntimeError("next_done() with no group pending")
            wave, self._queued = self._queued, []
            groups = self.engine.generate([p for _, p in wave], self.params)
            self._done.extend(GroupResult(k, p, g) for (k, p), g in zip(wave, groups))
            self.stats.groups_by_server["local"] = self.stats.groups_by_server.get("local", 0) + len(wave)
        return self._done.popleft()

    @property
    def pending(self) -> int:
        return len(self._queued) + len(self._done)

    def abort_pending(self) -> int:
        given_up = self.pending
        self._queued, self._done = [], deque()
        self.stats.aborted_groups += given_up
        return given_up

    def close(self) -> None:
        self.abort_pending()
