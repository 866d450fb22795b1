"""Checkpoints across specs and asynchronous saves' staging (rank body: tests/dist/checkpoint_te_staging.py).

- A local-spec checkpoint (what a CPU run writes) loads into a model that asks for what a
  Transformer Engine model asks for: the extra state of its norms, which the checkpoint lacks,
  is left to the model; any other entry the checkpoint lacks is refused by name.
- An asynchronous save holds the host copies it staged until the save is sealed, and a staged
  copy that changes under the writer fails the save instead of being written with checksums that
  pass.
- megatron validates a saver's first save only (the run's structure stays), and the next seals.
"""
import pytest
import torch

from tests.dist.models_moe import make_moe_models
from tests.torchrun import run_torchrun


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    models = make_moe_models(tmp_path_factory.mktemp("tiny"))
    (result,) = run_torchrun("tests.dist.checkpoint_te_staging:one_rank", 1, timeout_s=400,
                             args={"models": models, "tmp": str(tmp_path_factory.mktemp("ckpt"))})
    return result


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_a_local_spec_checkpoint_loads_into_a_transformer_engine_shaped_model(ran, name):
    r = ran[name]
    print(name, "asks for, absent from the checkpoint:", r["absent"])
    # the norms' extra state: final, q/k, and the pre-attention and pre-MLP norms under the fused keys
    assert "decoder.final_layernorm._extra_state" in r["absent"]
    assert "decoder.layers.self_attention.q_layernorm._extra_state" in r["absent"]
    assert len(r["absent"]) == 5 and all(k.endswith("_extra_state") for k in r["absent"])
    assert r["equal"]
    # every such module kept the extra state it was built with (given back to it, not skipped)
    assert r["extra_state_kept"] and set(r["extra_state_kept"]) == {"Tensor"}


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_any_other_entry_the_checkpoint_lacks_is_refused_by_name(ran, name):
    assert "decoder.final_layernorm.bias" in ran[name]["refused"], ran[name]["refused"]


def test_a_local_spec_training_checkpoint_resumes_a_transformer_engine_shaped_actor(ran):
    assert ran["trainer_state"] == {"step": 1}
    assert ran["loaded_weights"].keys() == ran["saved_weights"].keys()
    assert all(torch.equal(w, ran["saved_weights"][k]) for k, w in ran["loaded_weights"].items())
    assert ran["next_step_equal"]  # Adam's state came with it


def test_an_async_save_holds_its_staged_copies_until_sealed(ran):
    assert ran["staged"] > 0
    assert ran["held_while_writing"] == ran["staged"]
    assert ran["held_after_sealed"] == 0


def test_a_staged_copy_changed_under_the_writer_fails_the_save(ran):
    assert "staged copy changed while its writer wrote it" in ran["corrupt_refused"], ran["corrupt_refused"]
    assert not ran["corrupt_sealed"]


def test_megatron_validates_the_first_save_of_a_run_only(ran):
    assert ran["validations"] == [1, 1] and ran["second_intact"] is None
