"""Router statistics of a mixture-of-experts actor: how its routers load the experts, measured
on the tokens each train step's loss reads (the positions that predict response tokens).

Per MoE layer, over the step's N tokens (every data-parallel replica's), with router logits l_t
[E], k experts per token and f_e the fraction of the N k assignments that went to expert e:

    router/z_loss   = mean_t logsumexp(l_t)^2                 ST-MoE's router z-loss
    router/aux_loss = E * sum_e f_e * P_e,  P_e = mean_t softmax(l_t)_e
                                                              Switch's load-balancing loss, the form
                                                              megatron's moe_aux_loss_coeff scales
    router/load_max = max_e E * f_e                           1 when every expert takes N k / E
    router/replay_agreement = mean_t |top-k(l_t) & replayed_t| / k
                                                              with routing replay: how many of the
                                                              experts the routers would choose now
                                                              are those replayed (1: no drift)

reported as the mean over layers (load_max: the most loaded expert of any layer), per train
step (the loop averages its mini-batches). Each rank counts the tokens its routers see: under
sequence parallelism its slice of the sequence, under pipeline parallelism its stage's layers;
the sums are added over all ranks, where tensor-parallel ranks without sequence parallelism
count the same tokens alike (every figure is a ratio of two such sums, unchanged by that).
They are measurements: the z-loss is never added to the loss, the load-balancing loss only with
model.moe_aux_loss_coeff > 0 (models/builder.moe_fields; off by default, as RL trainers run MoE
models).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist


class RouterStats:
    """Forward hooks on every router of ``chunks`` that, inside :meth:`reading`, add the
    statistics above of the positions given; :meth:`metrics` adds them over all ranks.
    ``layers``: the model's (all pipeline stages'); ``sequence_parallel_group``: the TP group
    whose ranks each hold a slice of the sequence (None: whole sequences)."""

    def __init__(self, chunks: list[torch.nn.Module], layers: int, device: torch.device,
                 sequence_parallel_group=None, replayed: bool = False):
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)]
        self.device, self.replayed = device, replayed
        self.slice_rank = dist.get_rank(sequence_parallel_group) if sequence_parallel_group is not None else 0
        config = self.routers[0].config
        self.experts, self.topk = config.num_moe_experts, config.moe_router_topk
        self.index: torch.Tensor | None = None
        # per layer: [sum_t logsumexp^2, tokens, sum_t softmax (E), assignments per expert (E),
        # sum_t of the own top-k experts the routing used]
        self.sums = torch.zeros(layers, 3 + 2 * self.experts, dtype=torch.float64, device=device)
        for router in self.routers:
            router.register_forward_hook(self._hook(router.layer_number - 1))  # megatron's: global, from 1

    def _hook(self, layer: int):
        def record(router, args, output) -> None:
            if self.index is None:  # log-prob passes, the reference, activation recompute
                return
            hidden, (_, routing_map) = args[0], output
            with torch.no_grad():
                # megatron's [s, b, h] flattened as the ModelInput index counts positions; this
                # rank's slice of s (sequence parallelism) is the index's [lo, lo + n) part
                hidden = hidden.reshape(-1, hidden.shape[-1])
                lo = self.slice_rank * len(hidden)
                index = self.index[(self.index >= lo) & (self.index < lo + len(hidden))] - lo
                if not len(index):  # no response position in this rank's slice
                    return
                logits = router.gating(hidden[index]).double()
                row = self.sums[layer]
                row[0] += logits.logsumexp(-1).square().sum()
                row[1] += len(index)
                row[2:2 + self.experts] += logits.softmax(-1).sum(0)
                used = routing_map[index]
                row[2 + self.experts:2 + 2 * self.experts] += used.sum(0)
                if self.replayed:  # else the routing used is the routers' own top-k
                    row[-1] += used.gather(1, logits.topk(self.topk).indices).sum()
        return record

    @contextmanager
    def reading(self, index: torch.Tensor):
        """Count the routers' tokens at ``index`` (ModelInput.index) during this forward."""
        self.index = index
        try:
            yield
        finally:
            self.index = None

    def metrics(self) -> dict[str, float]:
        """The statistics since the last call, over every replica's tokens and every layer
        (collective over all ranks); then start again."""
        sums, self.sums = self.sums, torch.zeros_like(self.sums)
        dist.all_reduce(sums)
        tokens = sums[:, 1].clamp(min=1)
        mean_prob = sums[:, 2:2 + self.experts] / tokens[:, None]
        share = sums[:, 2 + self.experts:2 + 2 * self.experts] / (tokens[:, None] * self.topk)  # f_e
        metrics = {"router/z_loss": float((sums[:, 0] / tokens).mean()),
                   "router/aux_loss": float((self.experts * (share * mean_prob).sum(-1)).mean()),
                   "router/load_max": float(self.experts * share.max())}
        if self.replayed:
            metrics["router/replay_agreement"] = float((sums[:, -1] / (tokens * self.topk)).mean())
        return metrics
