"""``megadiv eval --model HF_DIR_OR_RUN_DIR --data NAME[:SPLIT][,NAME...] [--limit N] [--samples K
--temperature T --top-p P] [--max-new-tokens M] [--out FILE.json]``.

Greedy pass@1 on each split (default split: test), and with ``--samples K`` also avg@K and pass@K
at the given temperature / top-p, and the mean and median response length in tokens (all, correct,
incorrect responses); prints tables and writes JSON. Each split shows a progress bar (rate, ETA). A
split that fails (cannot be loaded or rendered, or its generation fails) gets its own entry with the
error and the others still run; the exit status is 1 only when every split failed. The engine is the
configured one (``--engine auto``: SGLang when CUDA and sglang are there, else the embedded engine).

The longest response (``--max-new-tokens``) is by default each data set's own (``eval_max_new_tokens``
in the registry; docs/data_and_rewards.md), and a run's own for a run's own data set.

``--model`` takes a Hugging Face directory or a run directory (its ``hf/`` export). For a run
directory, or its ``hf/``, the run's config supplies the defaults: the prompt template settings
(template, prompt_style, enable_thinking, system_prompt; a ``raw`` template only for data sets whose
prompts ask for no answer format, since other sets' raw text carries no instruction), the engine
settings, and for the run's own held-out dataset its exact data config, reward and max_new_tokens.
Otherwise each split uses its dataset's reward (math-verify, the code sandbox, exact match) and the
template ``auto`` (``raw`` for the synthetic arithmetic task).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import yaml

from megadiv.config import ConfigError, from_dict
from megadiv.data import DATASETS, DataConfig
from megadiv.rewards import RewardConfig
from megadiv.rollout import RolloutConfig

TEMPLATE_KEYS = ("template", "prompt_style", "enable_thinking", "system_prompt")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint directory or run directory")
    parser.add_argument("--data", required=True, help="NAME[:SPLIT][,NAME[:SPLIT]...] (split default: test)")
    parser.add_argument("--limit", type=int, default=None, help="first N problems of each split")
    parser.add_argument("--samples", type=int, default=0, help="k of avg@k / pass@k (0: greedy pass@1 only)")
    parser.add_argument("--temperature", type=float, default=1.0, help="temperature of the k samples")
    parser.add_argument("--top-p", type=float, default=1.0, help="top-p of the k samples")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="longest response (default: the run's for its own data set, else the data set's)")
    parser.add_argument("--out", default=None, help="JSON results (default: RUN_DIR/eval.json for a run, else ./eval.json)")
    parser.add_argument("--engine", choices=("auto", "embedded", "sglang"), default=None,
                        help="rollout engine (default: the run's, else auto)")
    parser.add_argument("--template", choices=("auto", "chat", "plain", "raw"), default=None)
    parser.add_argument("--prompt-style", choices=("default", "gbmpo_eval", "gbmpo_train"), default=None)
    parser.add_argument("--enable-thinking", choices=("true", "false"), default=None,
                        help="passed to chat templates that take it (Qwen3)")
    parser.add_argument("--system-prompt", default=None)
    parser.add_argument("--reward", default=None, help="reward registry name for every split (default: per split)")


def run(args: argparse.Namespace) -> int:
    try:
        hf_dir, run_dir, run_cfg = resolve_model(Path(args.model))
        data_cfgs, reward_cfgs, max_new = plan(args, run_cfg)
        rollout = _rollout_config(args, run_cfg)
        from megadiv.evaluation import EvalSampling

        if (args.max_new_tokens is not None and args.max_new_tokens < 1) or args.samples < 0:
            raise ValueError(f"need --max-new-tokens >= 1 and --samples >= 0, got {args.max_new_tokens} and "
                             f"{args.samples}")
        sampling = EvalSampling(args.max_new_tokens, args.samples, args.temperature, args.top_p)
    except (ConfigError, ValueError, OSError) as e:
        print(f"megadiv eval: {e}", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    from megadiv.evaluation import EvalSuite
    from megadiv.rollout import make_engine, resolve_engine_name

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    suite = EvalSuite.build(data_cfgs, reward_cfgs, tokenizer, max_new_tokens=max_new, keep_going=True)
    engine = None
    try:
        engine = make_engine(rollout, str(hf_dir))
        start = time.time()
        results = suite.run(engine, sampling, keep_going=True)
    finally:
        if engine is not None:
            engine.shutdown()
        suite.close()
    report = {"model": str(hf_dir), "engine": resolve_engine_name(rollout), "samples": args.samples,
              "temperature": args.temperature, "top_p": args.top_p, "seconds": round(time.time() - start, 1),
              "results": results}
    out = Path(args.out) if args.out else (run_dir / "eval.json" if run_dir else Path("eval.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(format_table(results))
    print(format_lengths(results))
    print(f"results: {out}")
    failed = [name for name, r in results.items() if "error" in r]
    if failed:
        print(f"megadiv eval: {len(failed)} of {len(results)} splits failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if len(failed) == len(results) else 0


def resolve_model(path: Path) -> tuple[Path, Path | None, dict | None]:
    """(HF directory, run directory or None, the run's config as a dict or None)."""
    if (path / "config.yaml").is_file():  # a run directory
        hf = path / "hf"
        if not (hf / "config.json").is_file():
            raise ValueError(f"run directory {path} has no hf/ export (train with checkpoint.export_hf=true, "
                             f"or convert a checkpoint with megadiv convert)")
        return hf, path, yaml.safe_load((path / "config.yaml").read_text())
    if (path / "config.json").is_file():
        run_yaml = path.parent / "config.yaml"
        if path.name == "hf" and run_yaml.is_file():  # a run's export
            return path, path.parent, yaml.safe_load(run_yaml.read_text())
        return path, None, None
    raise ValueError(f"--model {path}: neither a Hugging Face checkpoint (config.json) nor a run directory "
                     f"(config.yaml)")


def plan(args: argparse.Namespace, run_cfg: dict | None
         ) -> tuple[list[DataConfig], list[RewardConfig], list[int | None]]:
    """The data and reward config of each requested split, and its max_new_tokens when the run sets it
    (None: the data set's default; --max-new-tokens overrides both at run time)."""
    run_eval = _section(DataConfig, (run_cfg or {}).get("eval", {}).get("data"))
    run_data = _section(DataConfig, (run_cfg or {}).get("data"))
    run_reward = _section(RewardConfig, (run_cfg or {}).get("reward"))
    overrides = {k: v for k, v in {"template": args.template, "prompt_style": args.prompt_style,
                                   "system_prompt": args.system_prompt,
                                   "enable_thinking": None if args.enable_thinking is None
                                   else args.enable_thinking == "true"}.items() if v is not None}
    data_cfgs, reward_cfgs, max_new = [], [], []
    for item in (s.strip() for s in args.data.split(",") if s.strip()):
        name, _, split = item.partition(":")
        if name not in DATASETS:
            raise ValueError(f"--data: unknown dataset {name!r}; registered: {sorted(DATASETS)}")
        split = split or "test"
        if split not in DATASETS[name].splits and not DATASETS[name].any_split:
            raise ValueError(f"--data: {name} has no split {split!r}; splits: {sorted(DATASETS[name].splits)}")
        own = next((c for c in (run_eval, run_data) if c is not None and c.name == name), None)
        like = own or run_eval or run_data
        base = own or DataConfig(name=name, **(_inherited_template(like, name) if like else
                                               {"template": "raw" if name == "arithmetic" else "auto"}))
        data_cfgs.append(replace(base, split=split, shuffle=False, max_items=args.limit, **overrides))
        max_new.append(_run_max_new_tokens(run_cfg) if own is not None else None)
        if args.reward:
            reward_cfgs.append(RewardConfig(name=args.reward))
        elif own is not None and run_reward is not None:
            reward_cfgs.append(run_reward)
        else:
            from megadiv.evaluation import default_reward

            reward_cfgs.append(default_reward(name))
    if not data_cfgs:
        raise ValueError("--data names no dataset")
    return data_cfgs, reward_cfgs, max_new


def _inherited_template(run_data: DataConfig, name: str) -> dict:
    """The run's template settings for data set ``name``; its ``raw`` template (the record's text as the
    whole prompt, e.g. the tiny demo's "17+25=") only for sets that ask for no answer format, where it
    is what the run's model was trained on: for the others it would drop the instruction, and with a
    character tokenizer every character outside its alphabet, down to an empty prompt (MBPP)."""
    template = {k: getattr(run_data, k) for k in TEMPLATE_KEYS}
    if template["template"] == "raw" and DATASETS[name].answer_format != "none":
        template["template"] = "auto"
    return template


def format_table(results: dict[str, dict]) -> str:
    """One row per split: n and the accuracy figures, or the split's error."""
    keys = sorted({k for r in results.values() for k in r if k.startswith(("pass@", "avg@"))},
                  key=lambda k: (k != "pass@1", k))
    rows = [["split", "n", *keys]]
    for name, r in results.items():
        n = "-" if r.get("n") is None else str(r["n"])
        rows.append([name, n, *(f"{r[k]:.3f}" if k in r else "-" for k in keys)] if "error" not in r else
                    [name, n, f"error: {r['error']}"])
    return _align(rows)


def format_lengths(results: dict[str, dict]) -> str:
    """Response length in tokens, one row per split and generation pass (greedy, samples@k)."""
    rows = [["response tokens", "n", "mean", "median", "correct: n", "mean", "median", "incorrect: n", "mean",
             "median"]]
    for name, r in results.items():
        for kind, stats in r.get("response_tokens", {}).items():
            rows.append([f"{name} {kind}", *(cell for group in ("all", "correct", "incorrect")
                                              for cell in _stats_cells(stats[group]))])
    return _align(rows)


def _stats_cells(stats: dict) -> list[str]:
    return [str(stats["n"]), *("-" if stats[k] is None else f"{stats[k]:.1f}" for k in ("mean", "median"))]


def _align(rows: list[list[str]]) -> str:
    """Columns padded to their widest cell; the last cell of a short row (an error) is left out of the
    widths so that it runs on instead of widening its column."""
    full = len(rows[0])
    widths = [max(len(row[i]) for row in rows if i < len(row) and (len(row) == full or i < len(row) - 1))
              for i in range(full)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def _section(cls, data: dict | None):
    return from_dict(cls, data) if data else None


def _rollout_config(args: argparse.Namespace, run_cfg: dict | None) -> RolloutConfig:
    base = _section(RolloutConfig, (run_cfg or {}).get("rollout")) or RolloutConfig()
    return replace(base, engine=args.engine) if args.engine else base


def _run_max_new_tokens(run_cfg: dict | None) -> int | None:
    if not run_cfg:
        return None
    return (run_cfg.get("eval") or {}).get("max_new_tokens") or (run_cfg.get("rollout") or {}).get("max_new_tokens")
