"""Routing replay (R2) for a mixture-of-experts actor: the experts its routers chose in the
old-log-prob pass (the weights before the batch's first update) are the experts every training
pass of that batch uses.

Without it, each update moves the routers, and a token of a later mini-batch may reach other
experts than those pi_old was measured with: the importance ratio pi_theta / pi_old then
compares two different sub-networks, and RL on MoE models drifts or collapses (the routers'
disagreement is what verl's ``router_replay.mode: R2`` and slime's routing replay remove). With
it only the gate values (the router's probabilities of the chosen experts) follow the current
weights; the router still learns through them.

The choices are megatron-core's own (``moe_enable_routing_replay``: a RouterReplay per router
that records or replays the top-k indices). This module keeps them per row of the batch,
``SequenceBatch.routing`` [B, S, layers, k], so that training micro-batches grouped and padded
differently from the recording pass find theirs. Positions no row holds (padding) get experts
0..k-1, distinct as the dispatcher needs; no loss reads them. Under sequence parallelism a
router sees its rank's slice of the sequence: the slices recorded are gathered over the TP group,
and each rank replays its own. Under pipeline parallelism each stage records and replays its own
layers (the batch's routing holds those on each rank). R3: the rollout engine's routing of every
layer (Completion.routing) arrives with the batch, and each stage takes its layers' from it.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from megadiv.policy.batches import ModelInput, padding_experts


class RoutingReplay:
    """Records and replays the top-k expert indices of every router of ``chunks`` (built with
    ``moe_enable_routing_replay``), one padded micro-batch at a time. ``sequence_parallel_group``:
    the TP group whose ranks each route a slice of the sequence (None: whole sequences)."""

    def __init__(self, chunks: list[torch.nn.Module], topk: int, sequence_parallel_group=None):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self.actions = RouterReplayAction
        routers = [m for chunk in chunks for m in chunk.modules() if getattr(m, "router_replay", None) is not None]
        self.replays = [m.router_replay for m in routers]
        self.layers = [m.layer_number - 1 for m in routers]  # megatron's global layer numbers, from 1
        self.topk = topk
        self.slices = sequence_parallel_group

    @contextmanager
    def recording(self, x: ModelInput, into: list[torch.Tensor]):
        """Record the routing of this forward of ``x``; appends it as [b, w, layers, k]."""
        for r in self.replays:
            r.set_router_replay_action(self.actions.RECORD)
        try:
            yield
            width = x.tokens.shape[1]
            # megatron routes [s, b] positions flattened: position t of row i is index t * b + i
            chosen = torch.stack([r.get_recorded_indices() for r in self.replays], 1)  # [w * b, layers, k]
            if self.slices is not None:  # this rank's slice of the positions: [w * b / TP, layers, k]
                parts = [torch.empty_like(chosen) for _ in range(dist.get_world_size(self.slices))]
                dist.all_gather(parts, chosen, group=self.slices)
                chosen = torch.cat(parts)
            into.append(chosen.view(width, x.rows, len(self.replays), self.topk).transpose(0, 1).to(torch.int16))
        finally:
            self._clear()

    @contextmanager
    def replaying(self, routing: torch.Tensor, x: ModelInput):
        """Route this forward of ``x`` by ``routing`` [b, S, layers, k] (its rows' recorded choices:
        this stage's layers, or, from the rollout engine, all of the model's)."""
        if routing.shape[2] != len(self.replays):
            routing = routing[:, :, self.layers]
        width = x.tokens.shape[1]
        chosen = self.fit(routing, width).transpose(0, 1).reshape(width * x.rows, len(self.replays), self.topk)
        if self.slices is not None:  # this rank's slice of the sequence, the same positions of every row
            chosen = chosen.chunk(dist.get_world_size(self.slices))[dist.get_rank(self.slices)]
        for layer, r in enumerate(self.replays):
            r.set_target_indices(chosen[:, layer].long())
            r.set_router_replay_action(self.actions.REPLAY_FORWARD)
        try:
            yield
        finally:
            self._clear()  # the targets too: megatron keeps a list of them for recompute, never emptied

    def _clear(self) -> None:
        for r in self.replays:
            r.clear_indices()
            r.clear_router_replay_action()

    def fit(self, routing: torch.Tensor, width: int) -> torch.Tensor:
        """[b, S, layers, k] cut or padded to [b, width, layers, k] (padding: experts 0..k-1)."""
        if routing.shape[1] >= width:
            return routing[:, :width]
        pad = padding_experts(routing.shape[0], width - routing.shape[1], routing.shape[2], self.topk,
                              routing.dtype, routing.device)
        return torch.cat([routing, pad], 1)

    def assemble(self, pieces: list[torch.Tensor], order: torch.Tensor | None, width: int) -> torch.Tensor:
        """The recorded micro-batches as the batch's rows [B, width, layers, k], in batch order
        (``order``: the batch rows the micro-batches hold, None: the batch order)."""
        rows = torch.cat([self.fit(piece, width) for piece in pieces]).cpu()  # beside the batch, in host memory
        return rows if order is None else torch.empty_like(rows).index_copy_(0, order.to(rows.device), rows)
