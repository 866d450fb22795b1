"""``megadiv plan CONFIG... --nodes N --gpus-per-node G --gpu-memory-gib M [--hf-config FILE] [--json]``.

Per-GPU memory of a run before it is launched (megadiv.models.plan): by component for the
configured TP x PP (DP is what the world leaves; with experts the configured EP and ETP), whether
it fits, and the smallest TP x PP (with experts, and EP and ETP) that fits. The architecture comes from
``model.hf_dir/config.json``, or before the checkpoint is on disk from ``--hf-config FILE`` or the
recipe model's public config in examples/hf_configs/ (stand_in.py). It also recommends
checkpoint.every from an estimated step time, an estimated checkpoint blocking time and
checkpoint.node_mtbf_hours (Young's rule), printing every assumption.
"""
from __future__ import annotations

import argparse
import json
import sys

from megadiv.cli.stand_in import add_hf_config_argument, hf_config_stand_in
from megadiv.cli.train import add_config_arguments, load_train_config
from megadiv.config import ConfigError
from megadiv.models import plan as estimates
from megadiv.models.families import arch_from_hf_config
from megadiv.models.hf_config import load_hf_config
from megadiv.models.plan import (
    GiB,
    Layout,
    Plan,
    StepEstimate,
    Workload,
    candidate_layouts,
    checkpoint_blocking_s,
    driver_batch_bytes,
    parameter_count,
    plan_layout,
    young_interval_steps,
)
from megadiv.rollout.fleet import QUEUE_DEPTH
from megadiv.trainer.config import TrainConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, required=True)
    parser.add_argument("--gpu-memory-gib", type=float, required=True, help="memory of one GPU, GiB")
    add_hf_config_argument(parser)
    parser.add_argument("--prompt-tokens", type=int, default=512,
                        help="longest prompt in tokens; rows are prompt + rollout.max_new_tokens (default 512)")
    parser.add_argument("--reserve-gib", type=float, default=3.0,
                        help="held back on every GPU for the CUDA context, NCCL and fragmentation (default 3)")
    parser.add_argument("--host-memory-gib", type=float, default=2048.0,
                        help="host memory of one node, GiB, shared by its ranks (default 2048: a DGX H100)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    world = args.nodes * args.gpus_per_node
    try:
        if (min(args.nodes, args.gpus_per_node, args.prompt_tokens) < 1 or args.gpu_memory_gib <= 0
                or args.host_memory_gib <= 0):
            raise ConfigError("--nodes, --gpus-per-node, --prompt-tokens must be >= 1 and --gpu-memory-gib, "
                              "--host-memory-gib > 0")
        with hf_config_stand_in(args) as (note, _):
            cfg = load_train_config(args, world)
            arch = arch_from_hf_config(load_hf_config(cfg.model.hf_dir))
            servers = launched_servers(cfg, args.gpus_per_node)
    except (ConfigError, OSError, ValueError) as e:
        print(f"megadiv: invalid config: {e}", file=sys.stderr)
        return 2
    if note:
        print(f"megadiv: {note}", file=sys.stderr)
    gpu_bytes = int(args.gpu_memory_gib * GiB)
    stage_layers = getattr(cfg.parallel, "stage_layers", None)

    def plan_for(layout: Layout, layers=None) -> Plan | None:
        work = workload(cfg, layout, args.prompt_tokens, int(args.reserve_gib * GiB),
                        int(args.host_memory_gib * GiB) // args.gpus_per_node)
        if work is None:
            return None
        try:
            return plan_layout(arch, layout, work, gpu_bytes, layers)
        except ValueError:  # layers that do not split over this PP
            return None

    tp, pp = cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel
    configured = plan_for(Layout(tp, pp, cfg.parallel.data_parallel_size(world), cfg.parallel.expert_parallel,
                                 cfg.parallel.expert_tensor_parallel_size), stage_layers)
    if configured is None:
        print(f"megadiv: invalid config: the batch (grpo.prompts_per_step x rollout.n_samples / grpo.mini_batches) "
              f"does not split into whole grpo.micro_batch_size={cfg.grpo.micro_batch_size} micro-batches over "
              f"DP={cfg.parallel.data_parallel_size(world)}, or the layers over PP={pp}", file=sys.stderr)
        return 2
    advice = checkpoint_advice(cfg, configured, step_estimate(cfg, arch, world, args.gpus_per_node, args.prompt_tokens, servers), args.nodes)
    smallest = next((p for p in map(plan_for, candidate_layouts(arch, world, args.gpus_per_node))
                     if p is not None and p.fits), None)
    if args.json:
        print(json.dumps(configured.as_dict() | {
            "nodes": args.nodes, "gpus_per_node": args.gpus_per_node, "gpu_memory_gib": args.gpu_memory_gib,
            "seq_len": args.prompt_tokens + cfg.rollout.max_new_tokens, "launched_servers": servers,
            "checkpoint_interval": advice,
            "smallest_fitting_layout": smallest.as_dict()["layout"] if smallest else None}, indent=2))
    else:
        print(table(configured, args, cfg))
        print(advice_text(advice, cfg))
        if servers:
            print(f"generation: {servers['count']} SGLang server(s) of TP={servers['tp']} on GPUs "
                  f"0-{servers['gpus'] - 1} of node 0, each GPU giving it {cfg.rollout.mem_fraction_static:g} of its "
                  f"memory (colocated_server)" + (f"; {servers['idle_gpus']} GPUs of node 0 generate nothing: "
                                                  f"rollout.num_servers={args.gpus_per_node // servers['tp']} uses "
                                                  f"them all" if servers["idle_gpus"] else ""))
        searched = "TP x PP x EP (ETP)" if arch.is_moe else "TP x PP"
        print(f"smallest {searched} that fits on {world} GPUs of {args.gpu_memory_gib:g} GiB: "
              + (f"{smallest.layout} ({smallest.worst.total / GiB:.1f} GiB per GPU)" if smallest else "none"))
    return 0


def workload(cfg: TrainConfig, layout: Layout, prompt_tokens: int, reserve_bytes: int,
             host_bytes_per_rank: int) -> Workload | None:
    """The run's per-GPU work at ``layout``; None when its batch does not split over layout.dp."""
    rows = cfg.grpo.prompts_per_step * cfg.rollout.n_samples
    batch_host_bytes = driver_batch_bytes(cfg.grpo.prompts_per_step, cfg.rollout.n_samples, prompt_tokens,
                                          cfg.rollout.max_new_tokens, 2 if cfg.grpo.overlap else 1)
    per_mini = rows // cfg.grpo.mini_batches
    if per_mini % (layout.dp * cfg.grpo.micro_batch_size):
        return None
    colocated = cfg.rollout.engine != "embedded" and not cfg.rollout.server_urls
    rows, seq_len, positions = cfg.grpo.micro_batch_size, prompt_tokens + cfg.rollout.max_new_tokens, \
        cfg.rollout.max_new_tokens
    in_flight = per_mini // (layout.dp * cfg.grpo.micro_batch_size)
    budget = cfg.grpo.max_tokens_per_micro_batch
    if budget is not None:
        # a token budget: a micro-batch holds at most min(budget, micro_batch_size x seq_len) tokens
        # (a longer row alone), counted as one row of that many tokens with logits at every response
        # position among them; as many micro-batches as rows at worst (1F1B keeps min(PP, them))
        tokens = max(seq_len, min(budget, rows * seq_len))
        rows, seq_len, positions = 1, tokens, min(tokens, cfg.grpo.micro_batch_size * positions)
        in_flight = per_mini // layout.dp
    servers = max(len(cfg.rollout.server_urls), cfg.rollout.num_servers) if cfg.rollout.engine != "embedded" else 0
    broadcasts = servers > 0 and _broadcasts(cfg.rollout.sync_method, colocated)
    return Workload(
        micro_batch_size=rows, seq_len=seq_len, logit_positions=positions, micro_batches_in_flight=in_flight,
        params_dtype=cfg.model.params_dtype, optimizer=cfg.optim.optimizer,
        distributed_optimizer=cfg.optim.distributed_optimizer, reference=cfg.needs_reference,
        log_probs_chunk=cfg.grpo.log_probs_chunk, sequence_parallel=cfg.parallel.sequence_parallel,
        spec="local" if cfg.model.transformer_impl == "local" else "te",
        recompute_method=cfg.model.recompute_method, recompute_num_layers=cfg.model.recompute_num_layers or 0,
        server_fraction=cfg.rollout.mem_fraction_static if colocated else 0.0, reserve_bytes=reserve_bytes,
        bucket_bytes=cfg.rollout.bucket_bytes, rank0_bucket_copies=int(servers > 0) + int(broadcasts),
        # one broadcast group spans the fleet; without one (tensor, disk) each member's sync thread
        # is fed through its own queue (QUEUE_DEPTH) and holds the bucket it sends
        rank0_queued_buckets=QUEUE_DEPTH + 1 if servers > 1 and not broadcasts else 0,
        rank0_communicators=int(broadcasts),
        batch_host_bytes=batch_host_bytes, host_bytes_per_rank=host_bytes_per_rank)


def flops_per_token_per_parameter(cfg: TrainConfig) -> int:
    """The passes one step makes over its rows (trainer/grpo.py _optimize), at 2 FLOPs per parameter
    per token forward and 4 backward: the reference's log-probs (with a reference model), the
    old policy's (several updates per batch, or a KL in the reward), then ppo_epochs training passes
    (forward + backward, one more forward with full recompute, and the reference's forward again
    for a vocabulary regulariser)."""
    g = cfg.grpo
    old = g.ppo_epochs * g.mini_batches > 1 or (cfg.loss.kl_coef > 0 and cfg.loss.kl_placement == "reward")
    train = 6 + 2 * (cfg.model.recompute_granularity == "full") + 2 * cfg.uses_vocab_regularizer
    return 2 * cfg.needs_reference + 2 * old + g.ppo_epochs * train


def step_estimate(cfg: TrainConfig, arch, world: int, gpus_per_node: int, prompt_tokens: int,
                  servers: dict | None) -> StepEstimate:
    """The step's workload: the servers' GPUs generate (launched: ``servers``; an attached one,
    whose size the config does not say, counted as one node's GPUs), the trainer's ranks with the
    embedded engine."""
    r = cfg.rollout
    gpus = (servers["gpus"] if servers else len(r.server_urls) * gpus_per_node) if r.engine != "embedded" else world
    rows = cfg.grpo.prompts_per_step * r.n_samples
    return StepEstimate(parameter_count(arch, active=True), rows * (prompt_tokens + r.max_new_tokens),
                        rows * r.max_new_tokens, flops_per_token_per_parameter(cfg), world, gpus, cfg.grpo.overlap)


def checkpoint_advice(cfg: TrainConfig, plan: Plan, step: StepEstimate, nodes: int) -> dict:
    """checkpoint.every from Young's rule, with every figure and assumption it comes from."""
    blocking = checkpoint_blocking_s(plan.host)
    mtbf_s = cfg.checkpoint.node_mtbf_hours * 3600 / nodes
    return {"every": young_interval_steps(blocking, mtbf_s, step.step_s), "step_s": step.step_s,
            "train_s": step.train_s, "generation_s": step.generation_s, "blocking_s": blocking, "mtbf_s": mtbf_s,
            "node_mtbf_hours": cfg.checkpoint.node_mtbf_hours, "nodes": nodes,
            "active_parameters": step.active_parameters, "train_tokens": step.train_tokens,
            "generated_tokens": step.generated_tokens,
            "flops_per_token_per_parameter": step.flops_per_token_per_parameter, "train_gpus": step.train_gpus,
            "generation_gpus": step.generation_gpus, "overlap": step.overlap,
            "assumptions": {name: getattr(estimates, name) for name in (
                "GPU_PEAK_FLOPS", "TRAIN_MFU", "DECODE_MFU", "HOST_COPY_BYTES_PER_S", "GATHERED_STATE_HOST_COPIES")}}


def advice_text(a: dict, cfg: TrainConfig) -> str:
    k = a["assumptions"]
    combine = "the longer of" if a["overlap"] else "the sum of"
    return "\n".join([
        f"checkpoint.every: {a['every']} recommended (configured: {cfg.checkpoint.every}): Young's rule "
        f"sqrt(2 x {a['blocking_s']:.1f} s blocking x {a['mtbf_s'] / 3600:.0f} h MTBF) / {a['step_s']:.0f} s per step",
        f"  estimated step: {combine} training {a['flops_per_token_per_parameter']} x "
        f"{a['active_parameters'] / 1e9:.2f}B x {a['train_tokens']:,} tokens on {a['train_gpus']} GPUs at "
        f"{k['TRAIN_MFU']:g} MFU ({a['train_s']:.0f} s) and generation 2 x "
        f"{a['active_parameters'] / 1e9:.2f}B x {a['generated_tokens']:,} tokens on "
        f"{a['generation_gpus']} GPUs{' (one node per attached server)' if cfg.rollout.server_urls else ''} at "
        f"{k['DECODE_MFU']:g} MFU ({a['generation_s']:.0f} s), "
        f"{k['GPU_PEAK_FLOPS'] / 1e12:g} TFLOP/s peak per GPU",
        f"  estimated blocking: {k['GATHERED_STATE_HOST_COPIES']} host copies of the gathered optimizer state + "
        f"the staged weights at {k['HOST_COPY_BYTES_PER_S'] / 1e9:g} GB/s; MTBF: checkpoint.node_mtbf_hours="
        f"{a['node_mtbf_hours']:g} / {a['nodes']} nodes"])


def launched_servers(cfg: TrainConfig, gpus_per_node: int) -> dict | None:
    """The SGLang servers rank 0 launches beside the trainer on node 0 (sglang_server.place_server:
    server i on GPUs [i x tp, (i+1) x tp) when the trainer's ranks fill the node), or None. Between
    training phases the trainer leaves those GPUs to generation, so every GPU of node 0 should
    carry a server. Raises ConfigError when they need more GPUs than the node has."""
    r = cfg.rollout
    if r.engine == "embedded" or r.server_urls:
        return None
    gpus = r.num_servers * r.server_tp
    if gpus > gpus_per_node:
        raise ConfigError(f"rollout.num_servers={r.num_servers} x rollout.server_tp={r.server_tp} needs {gpus} GPUs "
                          f"on node 0, which has {gpus_per_node}")
    return {"count": r.num_servers, "tp": r.server_tp, "gpus": gpus, "idle_gpus": gpus_per_node - gpus}


def _broadcasts(sync_method: str, colocated: bool) -> bool:
    """Whether weight syncs go through the fleet's broadcast group (rank 0 then holds the bucket's
    flattened copy, one for the whole fleet): 'auto' sends CUDA-IPC handles to a server on the
    trainer's GPUs (sglang_engine.resolve_sync_method)."""
    return sync_method == "distributed" or (sync_method == "auto" and not colocated)


def table(plan: Plan, args: argparse.Namespace, cfg: TrainConfig) -> str:
    names = list(plan.stages[0].components)
    head = ["component"] + [f"stage {s.stage} ({s.layers} layers)" for s in plan.stages]
    rows = [[n] + [f"{s.components[n] / GiB:.2f}" for s in plan.stages] for n in names]
    rows.append(["total"] + [f"{s.total / GiB:.2f}" for s in plan.stages])
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    verdict = "fits" if plan.worst.total <= plan.gpu_bytes else "does NOT fit"
    return "\n".join([
        f"{plan.parameters / 1e9:.2f}B parameters; {plan.layout} on {args.nodes} x {args.gpus_per_node} GPUs; "
        f"micro-batch {cfg.grpo.micro_batch_size} x {args.prompt_tokens + cfg.rollout.max_new_tokens} tokens; "
        f"GiB per GPU:", line(head), line(["-" * w for w in widths]), *map(line, rows),
        f"worst GPU: {plan.worst.total / GiB:.1f} of {args.gpu_memory_gib:g} GiB: {verdict}; activations with "
        f"full recompute: {plan.activations_with_recompute / GiB:.2f} GiB; weights per replica "
        f"{plan.weight_bytes_per_replica / GiB:.1f} GiB",
        "host memory of rank 0 and the rollout driver beside it: " + ", ".join(f"{k} {v / GiB:.2f}" for k, v in plan.host.items())
        + f" GiB; {plan.host_total / GiB:.1f} of {plan.host_bytes_per_rank / GiB:g} GiB per rank "
        f"({args.host_memory_gib:g} GiB per node): {'fits' if plan.host_fits else 'does NOT fit'}", *plan.notes])
