"""The exported model's card (hf/README.md) in the Hugging Face layout, parsed back by the Hub's own
client (huggingface_hub.ModelCard): base model, recipe, data, steps, before/after figures.
tests/test_trainer_files.py checks the card of a real run."""
from __future__ import annotations

from pathlib import Path

import pytest

from megadiv.config import ConfigError, load_config
from megadiv.trainer.config import TrainConfig
from megadiv.trainer.model_card import render_model_card, write_model_card

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "tiny" / "grpo.yaml"

SUMMARY = {"steps": 200, "eval_before": {"eval/accuracy": 0.093, "eval/avg@4": 0.05, "eval/pass@4": 0.2},
           "eval_after": {"eval/accuracy": 0.274, "eval/avg@4": 0.21, "eval/pass@4": 0.5}}


def test_card_of_a_hub_base_model_parses_with_the_hub_client(tmp_path):
    from huggingface_hub import ModelCard

    model = tmp_path / "Qwen2.5-Math-1.5B"
    model.mkdir()
    (model / "config.json").write_text('{"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}')
    overrides = [f"model.hf_dir={model}", "warm_start.make_model=none", "warm_start.sft_steps=0", "data.name=gsm8k",
                 "data.template=auto", "eval.data={name: gsm8k, split: test}", "reward.name=math",
                 "loss.policy_loss=clip", "loss.eps_high=0.28", "loss.kl_coef=0.001", "run.name=qwen-gsm8k"]
    local = render_model_card(load_config(TrainConfig, CONFIG, overrides), SUMMARY)
    assert "base_model" not in local.split("---")[1]  # no hub id given: no link in the metadata
    assert "Based on Qwen2.5-Math-1.5B," in local  # the directory's name, not its local path
    assert str(tmp_path) not in local

    cfg = load_config(TrainConfig, CONFIG, [*overrides, "checkpoint.base_model_id=Qwen/Qwen2.5-Math-1.5B"])
    hf = tmp_path / "hf"
    hf.mkdir()
    card = ModelCard.load(write_model_card(hf, cfg, SUMMARY))
    assert card.data.base_model == "Qwen/Qwen2.5-Math-1.5B" and card.data.library_name == "transformers"
    assert card.data.pipeline_tag == "text-generation" and card.data.tags[:3] == ["megadiv", "reinforcement-learning",
                                                                                  "grpo"]
    assert {r.metric_name: r.metric_value for r in card.data.eval_results} == SUMMARY["eval_after"]
    assert {r.dataset_type for r in card.data.eval_results} == {"gsm8k"}
    text = card.text
    assert "| policy loss | clip (eps_low 0.2, eps_high 0.28), aggregation token-mean |" in text
    assert "| KL to the reference | 0.001 x k3 in the loss |" in text and "| steps | 200 |" in text
    assert "- training: gsm8k train (Grade-school maths word problems" in text
    for key in SUMMARY["eval_after"]:
        assert f"| {key} | {SUMMARY['eval_before'][key]:.4f} | {SUMMARY['eval_after'][key]:.4f} |" in text


def test_card_without_held_out_data_says_so(tmp_path):
    cfg = load_config(TrainConfig, CONFIG, [f"model.hf_dir={tmp_path}/init", "eval.data=null", "grpo.stop_after=50"])
    text = render_model_card(cfg, {"steps": 50, "eval_before": {}, "eval_after": {}})
    assert "model-index" not in text and "No held-out evaluation was configured." in text
    assert "| steps | 50 of 200 |" in text and "A random qwen2 model made by megadiv" in text
    for bad, message in [("checkpoint.base_model_id=/local/dir", "must be a hub id 'owner/name'"),
                         ("checkpoint.export_hf=false", "needs checkpoint.export_hf=true")]:
        with pytest.raises(ConfigError, match=message):
            load_config(TrainConfig, CONFIG, [f"model.hf_dir={tmp_path}/init", "checkpoint.base_model_id=a/b", bad])
