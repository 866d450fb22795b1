"""Weight sync on one GPU, the colocated set-up docs/rollout.md recommends: the launched SGLang
server shares GPU 0 with this (trainer) process, takes its memory share, and ``sync_method: auto``
resolves to CUDA-IPC handles (``tensor``; a broadcast group cannot span one GPU). After a sync the
server's log-probs match a transformers reference with the new weights (the server computes in
bf16: the mean limit is rollout.probe_floor's default), before it they do not."""
import os

import pytest
from safetensors.torch import load_file

pytestmark = [pytest.mark.gpu, pytest.mark.sglang]


@pytest.mark.timeout(900)
def test_colocated_server_syncs_by_cuda_ipc(tmp_path):
    from megadiv.models.tiny import make_tiny_model
    from megadiv.rollout import RolloutConfig, WeightSyncError, check_mismatch
    from megadiv.rollout.sglang_engine import SGLangEngine
    from tests.test_rollout import Reference, buckets_of, perturbed, random_probe

    hf_dir = str(make_tiny_model(tmp_path / "tiny-qwen2", "qwen2"))
    base = load_file(os.path.join(hf_dir, "model.safetensors"))
    cfg = RolloutConfig(engine="sglang", mem_fraction_static=0.3, startup_timeout_s=600, sync_timeout_s=120,
                        log_dir=str(tmp_path / "log"))
    engine = SGLangEngine(hf_dir, cfg)
    try:
        assert engine.gpu.base_gpu_id == 0 and engine.gpu.shares_trainer_gpus
        assert engine.sync_method == "tensor"
        new = perturbed(base, seed=1)
        probe = random_probe(seed=0)
        trainer = Reference(hf_dir).load(new).logprobs(probe.prompts, probe.responses)
        with pytest.raises(WeightSyncError, match="differ from the trainer's"):
            check_mismatch(engine, probe, trainer, cfg.probe_floor, "stale")
        on_gpu = [[(n, t.cuda()) for n, t in bucket] for bucket in buckets_of(new, per=3)]
        report = engine.update_weights(iter(on_gpu), "step-1")
        assert report.num_tensors == len(new) and engine.weight_version == "step-1"
        mismatch = check_mismatch(engine, probe, trainer, cfg.probe_floor, "step-1")
        print(f"tensor sync: {report.mb_per_s:.1f} MB/s; probe mean {mismatch.mean_abs:.4f} "
              f"max {mismatch.max_abs:.4f}")
    finally:
        engine.shutdown()
