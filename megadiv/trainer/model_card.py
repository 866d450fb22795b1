"""The model card of an exported policy: ``run_dir/hf/README.md`` in the Hugging Face layout (YAML
front matter, then Markdown), so that the directory can be pushed to a hub as it is.

It states the base model, the recipe (advantage estimator, policy loss and its divergence, the key
hyper-parameters), the data, the steps trained and the held-out figures before and after, taken
from the run's summary. The front matter's ``model-index`` holds the figures after training (the
exported model's own); the table in the body holds both.
"""
from __future__ import annotations

from pathlib import Path

import yaml

from megadiv.data import DATASETS, DataConfig
from megadiv.trainer.config import TrainConfig

# The loss keys that act with each built-in surrogate (megadiv.divergence.PolicyLossConfig).
LOSS_KEYS = {"clip": ("eps_low", "eps_high", "dual_clip_c"), "gspo": ("eps_low", "eps_high", "dual_clip_c"),
             "divergence_clip": ("measure", "delta", "delta_high", "dual_clip_c"), "sapo": ("tau_pos", "tau_neg")}


def write_model_card(hf_dir: Path, cfg: TrainConfig, summary: dict) -> Path:
    """Write ``hf_dir/README.md`` for the run ``cfg`` whose summary.json is ``summary``."""
    path = hf_dir / "README.md"
    path.write_text(render_model_card(cfg, summary))
    return path


def render_model_card(cfg: TrainConfig, summary: dict) -> str:
    front = {"library_name": "transformers", "pipeline_tag": "text-generation"}
    if cfg.checkpoint.base_model_id is not None:
        front["base_model"] = cfg.checkpoint.base_model_id
    front["tags"] = list(dict.fromkeys(["megadiv", "reinforcement-learning", cfg.advantage.estimator,
                                        cfg.loss.policy_loss] + _divergence_tags(cfg)))
    after = summary.get("eval_after") or {}
    if cfg.eval.data is not None and after:
        front["model-index"] = [{"name": cfg.run.name, "results": [{
            "task": {"type": "text-generation"},
            "dataset": {"name": _data_text(cfg.eval.data), "type": cfg.eval.data.name, "split": cfg.eval.data.split},
            "metrics": [{"type": key.rsplit("/", 1)[-1], "name": key, "value": value}
                        for key, value in after.items() if isinstance(value, (int, float))]}]}]
    lines = ["---", yaml.safe_dump(front, sort_keys=False).rstrip(), "---", "", f"# {cfg.run.name}", "",
             f"{_base_text(cfg)}, trained with megadiv by reinforcement learning for {summary['steps']} steps "
             f"({cfg.advantage.estimator} advantages, {cfg.loss.policy_loss} policy loss).", "",
             "## Recipe", "", "| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in _recipe(cfg, summary)), "",
             "## Data", "", f"- training: {_data_text(cfg.data)}",
             f"- held-out: {_data_text(cfg.eval.data) if cfg.eval.data is not None else 'none'}",
             *(f"- held-out (extra): {_data_text(d)}" for d in cfg.eval.extra_data), "",
             "## Held-out results", "", *_results(summary), "",
             "The run directory's config.yaml holds the full resolved configuration, metrics.jsonl every step's "
             "metrics.", ""]
    return "\n".join(lines)


def _recipe(cfg: TrainConfig, summary: dict) -> list[tuple[str, str]]:
    loss, g, r = cfg.loss, cfg.grpo, cfg.rollout
    surrogate = ", ".join(f"{k} {getattr(loss, k)}" for k in LOSS_KEYS.get(loss.policy_loss, ())
                          if getattr(loss, k) is not None)
    rows = [("advantage", f"{cfg.advantage.estimator}, group size {cfg.advantage.group_size}"),
            ("policy loss", f"{loss.policy_loss}" + (f" ({surrogate})" if surrogate else "")
             + f", aggregation {loss.loss_agg}"),
            ("KL to the reference", f"{loss.kl_coef} x {loss.kl_estimator} in the {loss.kl_placement}"
             if loss.kl_coef else "none")]
    if loss.regularizer is not None:
        rows.append(("regulariser", f"{loss.regularizer}, weight {loss.regularizer_coef}"))
    if loss.tis_cap is not None:
        rows.append(("truncated importance sampling", f"cap {loss.tis_cap}"))
    rows += [("steps", f"{summary['steps']} of {g.steps}" if summary["steps"] != g.steps else str(g.steps)),
             ("batch", f"{g.prompts_per_step} prompts x {r.n_samples} samples, {g.ppo_epochs} epoch(s) x "
                       f"{g.mini_batches} mini-batch(es)"),
             ("optimizer", f"{cfg.optim.optimizer}, lr {cfg.optim.lr} ({cfg.optim.decay_style}, warm-up "
                           f"{cfg.optim.warmup_steps}), gradient clip {cfg.optim.clip_grad}"),
             ("sampling", f"temperature {r.temperature}, top-p {r.top_p}, at most {r.max_new_tokens} new tokens"),
             ("reward", cfg.reward.name),
             ("backend", f"{cfg.model.backend}, TP {cfg.parallel.tensor_parallel} x PP {cfg.parallel.pipeline_parallel}"
                         f", {cfg.model.params_dtype}"),
             ("seed", str(cfg.run.seed))]
    return rows


def _results(summary: dict) -> list[str]:
    before, after = summary.get("eval_before") or {}, summary.get("eval_after") or {}
    keys = [k for k in dict.fromkeys([*before, *after]) if isinstance(before.get(k, after.get(k)), (int, float))]
    if not keys:
        return ["No held-out evaluation was configured."]
    def cell(figures: dict, key: str) -> str:
        return f"{figures[key]:.4f}" if isinstance(figures.get(key), (int, float)) else "-"

    return ["| metric | before | after |", "|---|---|---|",
            *(f"| {k} | {cell(before, k)} | {cell(after, k)} |" for k in keys)]


def _divergence_tags(cfg: TrainConfig) -> list[str]:
    tags = [cfg.loss.measure] if cfg.loss.policy_loss == "divergence_clip" else []
    return tags + ([cfg.loss.regularizer] if cfg.loss.regularizer else [])


def _base_text(cfg: TrainConfig) -> str:
    if cfg.warm_start.make_model != "none":
        return (f"A random {cfg.warm_start.make_model} model made by megadiv (warm_start.make_model), warm-started "
                f"for {cfg.warm_start.sft_steps} supervised steps")
    return f"Based on {cfg.checkpoint.base_model_id or Path(cfg.model.hf_dir).name}"


def _data_text(d: DataConfig) -> str:
    """What a reader of the card can identify: a registered dataset's name, split and description;
    a user's file by its name (not its local path) and the fields read."""
    if d.user_file:
        fields = ", ".join(f"{k} {getattr(d, k)}" for k in ("prompt_field", "answer_field", "tests_field")
                           if getattr(d, k) is not None)
        return f"{Path(d.path).name} ({d.name}; {fields})"
    spec = DATASETS.get(d.name)
    return f"{d.name} {d.split}" + (f" ({spec.description})" if spec is not None and spec.description else "")
