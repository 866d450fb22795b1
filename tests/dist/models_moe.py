"""Rank bodies for tests/test_models_moe.py: the Qwen3-MoE family against transformers, and
expert parallelism (EP=2) against EP=1.

``ctx.args``: {"models": {name: hf_dir}, "tmp": scratch dir shared by the ranks}. Each body
returns a dict of named figures for the tests to assert on.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tests.dist.models import (SEQ, _error, _export, _hf_logits, _hf_tensors, _megatron_logits, _same_tensors,
                               _shared_tmp, _tokens)


def _layout(ep: int, pp: int = 1):
    """(Re)build megatron's parallel state with TP = 1, ``pp`` stages and ``ep`` expert-parallel ranks."""
    from megadiv.config import ParallelConfig
    from megadiv.parallel import initialize, shutdown

    shutdown(keep_default_group=True)
    return initialize(ParallelConfig(pipeline_parallel=pp, expert_parallel=ep))


def _token_log_probs(chunk, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """log p(token t+1 | tokens <= t) for every position: [b, s-1]."""
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    logits = chunk(tokens, positions, attention_mask=None)[..., :vocab]  # [b, s, V] (padding columns dropped)
    return logits[:, :-1].log_softmax(-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def _param_numel(model) -> dict[str, int]:
    """What megatron allocates on this rank (one pipeline stage): parameter elements of experts and
    of the rest, and those of the vocabulary padding rows (embedding and, untied, output layer)."""
    numel = {"experts": 0, "dense": 0}
    for chunk in model.chunks:
        for name, p in chunk.named_parameters():
            numel["experts" if ".experts." in name else "dense"] += p.numel()
    padding_rows = model.chunks[0].embedding.word_embeddings.weight.shape[0] - model.vocab_size
    untied = not model.chunks[0].share_embeddings_and_output_weights
    numel["vocab_padding"] = padding_rows * model.config.hidden_size * (1 + untied)
    return numel


def one_rank(ctx) -> dict:
    """EP=1, the Qwen3-MoE and (under "shared") the Qwen2-MoE: logits against transformers,
    bit-exact export and HF tensor views, and the HF -> megatron -> HF round trip through
    ``megadiv convert``."""
    _layout(1)
    return _whole_model(ctx, "moe") | {"shared": _whole_model(ctx, "shared")}


def _whole_model(ctx, name: str) -> dict:
    from megadiv.cli import main
    from megadiv.models import build_model
    from megadiv.models.export import hf_weight_views

    hf_dir = ctx.args["models"][name]
    results: dict = {}
    model = build_model(hf_dir, role="reference")
    tokens = _tokens(model.vocab_size)
    with torch.no_grad():
        logits = model.chunks[0](tokens, torch.arange(tokens.shape[1]).unsqueeze(0), attention_mask=None)
    results["logit_diff"] = _max_diff(logits[..., :model.vocab_size], _hf_logits(hf_dir, tokens))
    results["padding_logit_max"] = float(logits[..., model.vocab_size:].abs().max())
    results["param_numel"] = _param_numel(model)
    hf = _hf_tensors(hf_dir)
    exported, results["buckets"] = _export(model, 16 << 10)
    results["export_exact"] = _same_tensors(exported, hf)
    results["views_exact"] = _same_tensors(dict(hf_weight_views(model)), hf)
    results["expert_tensors"] = sum(".mlp.experts." in n for n in hf)

    tmp = _shared_tmp(ctx, f"convert-{name}")
    mcore, hf_out = tmp / "mcore", tmp / "hf"
    results["cli_rc"] = (main(["convert", "hf-to-megatron", "--hf-dir", hf_dir, "--out", str(mcore)]),
                         main(["convert", "megatron-to-hf", "--ckpt-dir", str(mcore), "--hf-template", hf_dir,
                               "--out", str(hf_out), "--shard-size", "64KB"]))
    results["roundtrip_exact"] = _same_tensors(_hf_tensors(str(hf_out)), hf)
    return results


def _ep2_vs_ep1(ctx, hf_dir: str, results: dict):
    """Every rank trains its own sequence at EP=2 (world = DP ranks, each holding E/2 experts)
    against an EP=1 reference that runs all the world's sequences on each rank: per-token
    log-probs, and every gradient after megatron's DDP reduction (dense over DP, experts over
    their expert-data-parallel group only). Returns (EP=2 model, tokens, EP=1 logits)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megadiv.models import build_model
    from megadiv.models.loading import megatron_params

    # sum of token log-probs: megatron's per-token-loss mode leaves DDP's sums unscaled, so the
    # EP=2 gradients are those of the loss summed over all ranks' sequences
    overrides = {"calculate_per_token_loss": True}

    # EP=1 reference on every rank: all sequences, plain autograd
    world = _layout(1).world_size
    reference = build_model(hf_dir, role="actor", config_overrides=overrides)
    tokens = torch.randint(0, reference.vocab_size, (world, SEQ), generator=torch.Generator().manual_seed(0))
    ref_logp = _token_log_probs(reference.chunks[0], tokens, reference.vocab_size)  # [world, s-1]
    ref_logp.sum().backward()
    ref_grads = {name: p.grad.clone() for name, p in megatron_params(reference)}
    with torch.no_grad():
        ref_logits = reference.chunks[0](tokens, torch.arange(SEQ).unsqueeze(0), attention_mask=None)

    info = _layout(2)
    results["ep_rank"], results["dp_size"] = info.ep_rank, info.dp_size
    results["expert_dp_size"] = parallel_state.get_expert_data_parallel_world_size()
    actor = build_model(hf_dir, role="actor", config_overrides=overrides)
    names = [name for name, _ in megatron_params(actor)]
    results["experts_held"] = sorted({int(n.split(".mlp.experts.local_experts.")[1].split(".")[0])
                                      for n in names if ".local_experts." in n})
    results["param_numel"] = _param_numel(actor)
    ddp = DistributedDataParallel(
        config=actor.config, module=actor.chunks[0],
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False,
                                                 average_in_collective=False))
    mine = tokens[ctx.rank:ctx.rank + 1]
    logp = _token_log_probs(ddp, mine, actor.vocab_size)  # [1, s-1]
    results["logp_diff"] = _max_diff(logp, ref_logp[ctx.rank:ctx.rank + 1])
    logp.sum().backward()
    ddp.finish_grad_sync()
    grads = dict((name, p.main_grad) for name, p in megatron_params(actor))
    results["grad_names_match"] = set(grads) <= set(ref_grads) and len(grads) == len(names)
    # per tensor: max |g - g_ref| / max |g_ref| (in float32 ulps of the tensor's largest entry)
    rel = {n: _max_diff(grads[n], ref_grads[n]) / float(ref_grads[n].abs().max()) / 1.19e-7 for n in grads}
    expert = [n for n in grads if ".local_experts." in n]
    results["expert_grad_ulps"] = max(rel[n] for n in expert)
    results["dense_grad_ulps"] = max(rel[n] for n in grads if n not in expert)
    results["router_grad_ulps"] = max(rel[n] for n in grads if n.endswith("router.weight"))
    results["experts_without_grad"] = sorted(n for n in expert if not grads[n].any())
    return actor, tokens, ref_logits


def two_ranks(ctx) -> dict:
    """EP=2 on 2 ranks (expert-data-parallel size 1) against EP=1 (_ep2_vs_ep1); export gathered
    over EP; a checkpoint written at EP=2 loaded at EP=1; the refusals; PP=2 logits and export."""
    from megadiv.models import build_model, load_megatron_checkpoint, save_megatron_checkpoint

    hf_dir = ctx.args["models"]["moe"]
    results: dict = {"shared": {}}
    _ep2_vs_ep1(ctx, ctx.args["models"]["shared"], results["shared"])
    actor, tokens, ref_logits = _ep2_vs_ep1(ctx, hf_dir, results)

    # export at EP=2: every rank yields every expert, gathered over the EP group
    exported, _ = _export(actor, 16 << 10)
    results["export_exact"] = _same_tensors(exported, _hf_tensors(hf_dir))

    # a checkpoint written at EP=2 reloads at EP=1 with the same logits as built from HF
    tmp = _shared_tmp(ctx, "ep2-ckpt")
    save_megatron_checkpoint(actor, tmp / "ckpt")
    _layout(1)
    resharded = build_model(hf_dir, role="reference", load_weights=False)
    load_megatron_checkpoint(resharded, tmp / "ckpt")
    with torch.no_grad():
        logits = resharded.chunks[0](tokens, torch.arange(SEQ).unsqueeze(0), attention_mask=None)
    results["ep2_to_ep1_bitwise"] = bool(torch.equal(logits, ref_logits))

    # megadiv convert at EP=2 (each rank reads and writes its half of the experts), both ways
    from megadiv.cli import main

    _layout(2)
    mcore, hf_out = tmp / "convert-ep2", tmp / "convert-ep2-hf"
    results["convert_ep2_rc"] = (
        main(["convert", "hf-to-megatron", "--hf-dir", hf_dir, "--out", str(mcore), "--ep", "2"]),
        main(["convert", "megatron-to-hf", "--ckpt-dir", str(mcore), "--hf-template", hf_dir, "--out", str(hf_out),
              "--ep", "2", "--shard-size", "64KB"]))
    dist.barrier()
    results["convert_ep2_roundtrip_exact"] = _same_tensors(_hf_tensors(str(hf_out)), _hf_tensors(hf_dir))
    results["error/convert_ep"] = main(["convert", "hf-to-megatron", "--hf-dir", hf_dir, "--out", str(tmp / "x"),
                                        "--ep", "1"])  # the running job's layout is EP=2

    # refusals, before any group or model is built
    from megadiv.config import ParallelConfig

    results["error/ep_world"] = _error(lambda: ParallelConfig(expert_parallel=4).data_parallel_size(2))
    _layout(2)
    results["error/ep_experts"] = _error(lambda: build_model(ctx.args["models"]["moe3"], role="reference"))
    results["error/ep_dense"] = _error(lambda: build_model(ctx.args["models"]["dense"], role="reference"))

    # PP=2 (one MoE layer per stage) through megatron's pipeline schedule: logits and export
    _layout(1, pp=2)
    staged = build_model(hf_dir, role="reference")
    logits = _megatron_logits(staged, tokens)
    if logits is not None:
        results["pp2_logit_diff"] = _max_diff(logits[..., :staged.vocab_size], _hf_logits(hf_dir, tokens))
    results["pp2_export_exact"] = _same_tensors(_export(staged, 16 << 10)[0], _hf_tensors(hf_dir))
    dist.barrier()
    return results


def four_ranks(ctx) -> dict:
    """DP=4 x EP=2 (expert-data-parallel size 2: each expert on two ranks, its gradients reduced
    over those two) against EP=1 (_ep2_vs_ep1)."""
    results: dict = {}
    _ep2_vs_ep1(ctx, ctx.args["models"]["moe"], results)
    return results


def policies_with_skewed_rows(ctx) -> dict:
    """The trainer's Policy at DP=2 x EP=2 against DP=2 x EP=1, the same rows on each replica:
    replica 0 the long ones, replica 1 the short ones (tests/dist/token_budget.py), so each
    replica's micro-batches grouped by length have widths of their own, which the EP=2 forward
    (collective over both replicas) must bring to the widest of the two. Old log-probs, two SGD
    steps, the log-probs and weights after."""
    from megadiv.config import ModelConfig, OptimConfig, ParallelConfig
    from megadiv.divergence import PolicyLossConfig
    from megadiv.policy.batches import row_lengths
    from megadiv.policy.megatron import Policy
    from megadiv.policy.objectives import grpo_objective
    from tests.dist.token_budget import RESPONSE_LENGTHS, skewed_batch

    model = ModelConfig(hf_dir=ctx.args["models"]["moe"])
    per = len(RESPONSE_LENGTHS) // 2
    out: dict = {}
    for ep in (1, 2):
        info = _layout(ep)
        batch = skewed_batch().rows(slice(info.dp_rank * per, (info.dp_rank + 1) * per))
        actor = Policy(model, ParallelConfig(expert_parallel=ep), "actor",
                       OptimConfig(optimizer="sgd", lr=0.5, clip_grad=1.0), total_steps=1)
        batch.logp_old = actor.log_probs(batch, 2)
        steps = [actor.train_step(batch, grpo_objective(PolicyLossConfig(policy_loss="clip")), 2) for _ in range(2)]
        out[ep] = {"lengths": row_lengths(batch.loss_mask).tolist(), "logp_old": batch.logp_old, "steps": steps,
                   "logp_after": actor.log_probs(batch, 2),
                   "weights": {name: t for bucket in actor.export_buckets(64 << 20) for name, t in bucket}}
    return out


def routing_replay(ctx) -> dict:
    """R2 on the trainer's Policy at DP=2 x EP=2 with skewed rows (policies_with_skewed_rows). Part
    1, routing that agrees: the old-log-prob pass records, a train step replays on the same
    weights; against a policy without replay. Part 2, routing that does not: the router weights
    perturbed after the recording; log-probs of the rows replayed and by the routers' own choice,
    the routing recorded and the weights, for a transformers reference; a train step's
    router/replay_agreement."""
    from megadiv.config import ModelConfig, OptimConfig, ParallelConfig
    from megadiv.divergence import PolicyLossConfig
    from megadiv.policy.megatron import Policy
    from megadiv.policy.objectives import grpo_objective
    from tests.dist.token_budget import RESPONSE_LENGTHS, skewed_batch

    model, parallel = ModelConfig(hf_dir=ctx.args["models"]["moe"]), ParallelConfig(expert_parallel=2)
    info = _layout(2)
    per = len(RESPONSE_LENGTHS) // 2
    rows = slice(info.dp_rank * per, (info.dp_rank + 1) * per)
    objective = grpo_objective(PolicyLossConfig(policy_loss="clip"))
    optim = OptimConfig(optimizer="sgd", lr=0.5, clip_grad=1.0)
    plain, replayed = (Policy(model, parallel, "actor", optim, 1, routing_replay=on) for on in (False, True))

    def weights(policy):
        return {name: t for bucket in policy.export_buckets(64 << 20) for name, t in bucket}

    out: dict = {}
    batches = {}
    for name, policy in (("plain", plain), ("replayed", replayed)):
        batch = skewed_batch().rows(rows)
        batch.logp_old = policy.log_probs(batch, 2, record_routing=True)  # records only with replay
        out[name] = {"routing_recorded": batch.routing is not None, "step": policy.train_step(batch, objective, 2),
                     "weights": weights(policy)}
        batches[name] = batch

    batch = batches["replayed"]
    with torch.no_grad():  # the same perturbation on every rank: the routers are replicated
        g = torch.Generator().manual_seed(5)
        for chunk in replayed.model.chunks:
            for name, p in sorted(chunk.named_parameters()):
                if name.endswith("router.weight"):
                    p.add_(3 * p.abs().mean() * torch.randn(p.shape, generator=g))
    own = batch.rows(slice(0, len(batch)))
    own.routing = None
    out["perturbed"] = {"logp_replayed": replayed.log_probs(batch, 2), "logp_own": replayed.log_probs(own, 2),
                        "routing": batch.routing, "weights": weights(replayed), "rows": [rows.start, rows.stop]}
    out["perturbed"]["step"] = replayed.train_step(batch, objective, 2)
    return out


def make_moe_models(root) -> dict[str, str]:
    """The tiny checkpoints (float32, random): ``moe`` a 2-layer Qwen3-MoE with 8 experts of width
    32, top-2 with renormalised probabilities, head_dim 16, untied; ``shared`` a Qwen2-MoE like
    it (q/k/v biases, top-2 of the softmax not renormalised, a gated shared expert of width 64);
    ``moe3`` the Qwen3-MoE with 3 experts (EP=2 must be refused); ``dense`` a qwen3 (EP needs
    experts)."""
    from megadiv.models.tiny import make_tiny_model

    specs = {"moe": dict(family="qwen3_moe", head_dim=16, ffn=32, experts=8, experts_per_token=2),
             "shared": dict(family="qwen2_moe", head_dim=16, ffn=32, experts=8, experts_per_token=2),
             "moe3": dict(family="qwen3_moe", head_dim=16, ffn=32, experts=3, experts_per_token=2),
             "dense": dict(family="qwen3")}
    return {name: str(make_tiny_model(root / name, **spec)) for name, spec in specs.items()}


def _gradients(policy) -> dict[str, torch.Tensor]:
    """The policy's gradients (DDP's reduced main_grad) as HF tensors: exported in place of the
    weights, gathered over TP, EP and PP as they are; the weights restored after."""
    params = [p for chunk in policy.chunks for p in chunk.parameters()]
    weights = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.copy_(p.main_grad)
        grads = {n: t for bucket in policy.export_buckets(64 << 20) for n, t in bucket}
        for p, w in zip(params, weights):
            p.copy_(w)
    return grads


# name -> (model, ParallelConfig fields) of the 4-rank runs; each compared with its model's EP=1 (DP=4).
# ep2: two expert-parallel groups (DP=2 x EP=2: each expert on two ranks), ep4: each expert on one.
TP2_EP2 = dict(tensor_parallel=2, sequence_parallel=True, expert_parallel=2)
LAYOUTS = {"ep1": ("moe", {}), "ep2": ("moe", dict(expert_parallel=2)), "ep4": ("moe", dict(expert_parallel=4)),
           "tp2-ep2": ("moe", TP2_EP2), "pp2-ep2": ("moe", dict(pipeline_parallel=2, expert_parallel=2)),
           "tp2-etp1-ep2": ("moe", TP2_EP2 | dict(expert_tensor_parallel=1)),
           "tp2-etp1-ep4": ("moe", TP2_EP2 | dict(expert_tensor_parallel=1, expert_parallel=4)),
           "shared-ep1": ("shared", {}), "shared-tp2-ep2": ("shared", TP2_EP2)}


def layouts(ctx) -> dict:
    """The trainer's Policy with R2 routing replay at each of LAYOUTS on 4 ranks, in float64 (the
    Python API's params_dtype; megatron computes in it throughout, its grad norm aside), the 8
    skewed rows (tests/dist/token_budget.py) split over the DP replicas: old log-probs (recording the routing;
    PP=2 x EP=2 is given EP=1's recording of all layers instead, as R3 is the engine's),
    two unclipped SGD steps (the second replays routing the first step has moved the routers away
    from), and each step's gradients as HF tensors (_gradients). The TP=2 x ETP=1 x EP=2 actor's
    checkpoint (megatron's distributed format) is loaded at EP=1 (TP = 1, each expert whole on
    every rank): its weights exported there, and as the actor exported them."""
    from megadiv.config import ModelConfig, OptimConfig, ParallelConfig
    from megadiv.divergence import PolicyLossConfig
    from megadiv.models import build_model, load_megatron_checkpoint, save_megatron_checkpoint
    from megadiv.parallel import initialize, shutdown
    from megadiv.policy.megatron import Policy
    from megadiv.policy.objectives import grpo_objective
    from tests.dist.token_budget import RESPONSE_LENGTHS, skewed_batch

    objective = grpo_objective(PolicyLossConfig(policy_loss="clip"))
    out = {}
    for name, (hf, fields) in LAYOUTS.items():
        model = ModelConfig(hf_dir=ctx.args["models"][hf], params_dtype="float64")
        shutdown(keep_default_group=True)
        parallel = ParallelConfig(**fields)
        info = initialize(parallel)
        per = len(RESPONSE_LENGTHS) // info.dp_size
        rows = slice(info.dp_rank * per, (info.dp_rank + 1) * per)
        batch = skewed_batch().rows(rows)
        actor = Policy(model, parallel, "actor", OptimConfig(optimizer="sgd", lr=0.5, clip_grad=0.0), 1,
                       routing_replay=True)
        if name == "pp2-ep2":  # R3's path: every layer's routing from elsewhere (EP=1's), each stage its own
            batch.routing = torch.stack([actor.routing_replay.fit(recorded[i][None], batch.tokens.shape[1])[0]
                                         for i in range(rows.start, rows.stop)])
            batch.logp_old = actor.log_probs(batch, 2)
        else:
            batch.logp_old = actor.log_probs(batch, 2, record_routing=True)
        if name == "ep1":  # every row's routing, on every rank
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, (rows.start, batch.routing))
            recorded = {start + i: row for start, routing in parts for i, row in enumerate(routing)}
        steps, grads = [], []
        for _ in range(2):
            steps.append(actor.train_step(batch, objective, 2))
            grads.append(_gradients(actor))
        out[name] = {"rows": [rows.start, rows.stop], "logp_old": batch.logp_old, "steps": steps, "grads": grads}
        if name == "tp2-etp1-ep2":
            ckpt = _shared_tmp(ctx, "etp1-ckpt")
            save_megatron_checkpoint(actor.model, ckpt)
            out["etp1-ckpt"] = {"saved": dict(_export(actor.model, 64 << 20)[0])}
    shutdown(keep_default_group=True)
    initialize(ParallelConfig())
    resharded = build_model(ModelConfig(hf_dir=ctx.args["models"]["moe"], params_dtype="float64"), role="reference",
                            load_weights=False)
    load_megatron_checkpoint(resharded, ckpt)
    out["etp1-ckpt"]["loaded"] = dict(_export(resharded, 64 << 20)[0])
    shutdown(keep_default_group=True)
    return out


def load_balancing(ctx) -> dict:
    """model.moe_aux_loss_coeff at DP=2: one train step of the trainer's Policy on the skewed rows
    (one fixed-width micro-batch per replica) with the coefficient and without, from the same
    weights. The last layer's router input (captured) and weight, and its gradient with each."""
    from megadiv.config import ModelConfig, OptimConfig, ParallelConfig
    from megadiv.divergence import PolicyLossConfig
    from megadiv.policy.megatron import Policy
    from megadiv.policy.objectives import grpo_objective
    from tests.dist.token_budget import RESPONSE_LENGTHS, skewed_batch

    info = _layout(1)
    per = len(RESPONSE_LENGTHS) // info.dp_size
    batch = skewed_batch().rows(slice(info.dp_rank * per, (info.dp_rank + 1) * per))
    out = {"loss_tokens": float(batch.loss_mask.sum()), "width": batch.tokens.shape[1], "rows": len(batch)}
    for coeff in (0.0, 0.3):
        actor = Policy(ModelConfig(hf_dir=ctx.args["models"]["moe"], moe_aux_loss_coeff=coeff), ParallelConfig(),
                       "actor", OptimConfig(optimizer="sgd", lr=0.5, clip_grad=0.0), 1, group_by_length=False)
        router = [m for m in actor.chunks[0].modules() if type(m).__name__ == "TopKRouter"][-1]
        captured = []
        hook = router.register_forward_hook(lambda m, args, output: captured.append(args[0].detach().clone()))
        weight = router.weight.detach().clone()
        actor.train_step(batch, grpo_objective(PolicyLossConfig(policy_loss="clip")), per)
        hook.remove()
        out[coeff] = {"grad": router.weight.main_grad.clone(), "hidden": captured[0], "weight": weight}
    return out


def te_experts_vs_local(ctx) -> dict:
    """GPU, one rank, float32 without TF32: each tiny MoE family built with Transformer Engine's
    spec (TEGroupedMLP experts, TE attention and norms) against transformers and against megatron's
    local spec. Figures: the TE model's logits against transformers' (max abs), its export against
    the checkpoint (bit for bit), the local spec's checkpoint loaded into a TE model (logits against
    the TE model built from HF), and the trainer's Policy's old log-probs and first SGD step's
    gradients (HF tensors) in TE against local."""
    from megadiv.config import ModelConfig, OptimConfig, ParallelConfig
    from megadiv.divergence import PolicyLossConfig
    from megadiv.models import build_model, load_megatron_checkpoint, save_megatron_checkpoint
    from megadiv.policy.megatron import Policy
    from megadiv.policy.objectives import grpo_objective
    from tests.dist.token_budget import skewed_batch

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    _layout(1)
    out = {}
    for name in ("moe", "shared"):
        hf_dir = ctx.args["models"][name]
        te, local = (ModelConfig(hf_dir=hf_dir, transformer_impl=impl) for impl in ("transformer_engine", "local"))
        model = build_model(te, role="reference")
        tokens = _tokens(model.vocab_size)
        positions = torch.arange(tokens.shape[1], device="cuda").unsqueeze(0)
        with torch.no_grad():
            logits = model.chunks[0](tokens.cuda(), positions, attention_mask=None)[..., :model.vocab_size].cpu()
        r = {"grouped": any("TEGroupedMLP" == type(m).__name__ for m in model.chunks[0].modules()),
             "logit_diff": _max_diff(logits, _hf_logits(hf_dir, tokens)),
             "export_exact": _same_tensors({k: v.cpu() for k, v in _export(model, 16 << 10)[0].items()},
                                           _hf_tensors(hf_dir))}
        ckpt = _shared_tmp(ctx, f"local-{name}")
        save_megatron_checkpoint(build_model(local, role="reference"), ckpt)
        loaded = build_model(te, role="reference", load_weights=False)
        try:  # the local spec's checkpoint has no TE _extra_state: a refusal is a figure too
            load_megatron_checkpoint(loaded, ckpt)
            with torch.no_grad():
                again = loaded.chunks[0](tokens.cuda(), positions, attention_mask=None)[..., :model.vocab_size].cpu()
            r["local_ckpt_logit_diff"] = _max_diff(again, logits)
        except Exception as e:  # noqa: BLE001 - reported to the test, which fails on it
            r["local_ckpt_error"] = f"{type(e).__name__}: {e}"[:2000]
        runs = {}
        for impl, cfg in (("te", te), ("local", local)):
            actor = Policy(cfg, ParallelConfig(), "actor", OptimConfig(optimizer="sgd", lr=0.5, clip_grad=0.0), 1)
            batch = skewed_batch()
            batch.logp_old = actor.log_probs(batch, 4)
            actor.train_step(batch, grpo_objective(PolicyLossConfig(policy_loss="clip")), 4)
            runs[impl] = {"logp": batch.logp_old.cpu(), "grads": {k: v.cpu() for k, v in _gradients(actor).items()}}
        r["logp_diff"] = _max_diff(runs["te"]["logp"], runs["local"]["logp"])
        grads, ref = runs["te"]["grads"], runs["local"]["grads"]
        r["grad_names_match"] = grads.keys() == ref.keys()
        r["grad_rel"] = max(float((grads[k] - ref[k]).abs().max() / ref[k].abs().max()) for k in ref)
        out[name] = r
    return out
