"""Seconds per bucket of a weight push to an SGLang fleet, against the push that probed every
server's /health before each bucket (re-created here as the baseline), in the same process.

    .venv/bin/python benchmarks/bench_push.py                        # launches 2 SGLang CPU servers
    .venv/bin/python benchmarks/bench_push.py --hf-dir DIR --server-urls URL1 URL2   # attached

The push is FleetEngine.update_weights (``distributed``: one broadcast group over the fleet) of
the served model's own weights, perturbed each time, cut into buckets of at most ``--bucket-kb``
(one tensor per bucket when tensors are larger). The baseline runs the same push with
``SGLangEngine._push_distributed`` wrapped to call /health on every server, concurrently, before
each bucket, as the push did before. In SGLang 0.5.23 /health is /health_generate: a one-token
generation answered no sooner than after a 1 s sleep, so the baseline pays >= 1 s per bucket
whatever the bucket's size. Without --hf-dir a random Qwen2 checkpoint is built
(make-tiny-model: --hidden/--layers/--ffn) and two servers are launched on it (CPU start-up 20-90 s).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_rollout import buckets_of  # noqa: E402
from megadiv.rollout import RolloutConfig, RolloutError, make_engine  # noqa: E402
from megadiv.rollout.sglang_engine import SGLangEngine  # noqa: E402
from megadiv.rollout.weight_sync import answers  # noqa: E402


@contextlib.contextmanager
def probing_every_bucket():
    """Baseline: the push as it was, every server's /health answered before each bucket is sent."""
    push = SGLangEngine._push_distributed

    def probed(self, bucket, where):
        with ThreadPoolExecutor(len(self.urls)) as pool:
            dead = [u for u, ok in zip(self.urls, pool.map(answers, self.urls)) if not ok]
        if dead:
            raise RolloutError(f"{where}: {dead} do not answer /health: nothing sent")
        return push(self, bucket, where)

    with mock.patch.object(SGLangEngine, "_push_distributed", probed):
        yield


def seconds_per_push(fleet, sd: dict, bucket_bytes: int, repeats: int, label: str) -> float:
    """Best of ``repeats`` pushes, each of new values (every bucket is really sent)."""
    best = float("inf")
    for i in range(repeats):
        bumped = {n: t + 1e-3 * (i + 1) for n, t in sd.items()}
        t0 = time.perf_counter()
        fleet.update_weights(iter(buckets_of(bumped, bucket_bytes)), f"{label}-{i}")
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-dir", help="the served checkpoint (with --server-urls); default: a new random one")
    parser.add_argument("--server-urls", nargs="+", help="running SGLang servers serving --hf-dir")
    parser.add_argument("--servers", type=int, default=2, help="servers to launch without --server-urls")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=128)
    parser.add_argument("--bucket-kb", type=float, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if bool(args.hf_dir) != bool(args.server_urls):
        parser.error("--hf-dir and --server-urls go together")
    with tempfile.TemporaryDirectory(prefix="bench-push-") as tmp:
        return run(args, Path(tmp))


def run(args, tmp: Path) -> int:
    from safetensors.torch import load_file

    if args.hf_dir:
        hf_dir = args.hf_dir
        cfg = RolloutConfig(engine="sglang", server_urls=tuple(args.server_urls), sync_method="distributed",
                            sync_timeout_s=600)
    else:
        from megadiv.models.tiny import make_tiny_model
        hf_dir = str(make_tiny_model(tmp / "model", "qwen2", hidden=args.hidden, layers=args.layers, ffn=args.ffn))
        cfg = RolloutConfig(engine="sglang", num_servers=args.servers, sync_method="distributed", sync_timeout_s=600,
                            startup_timeout_s=600, log_dir=str(tmp / "logs"))
    sd = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        sd |= load_file(str(f))
    bucket_bytes = int(args.bucket_kb * 1024)
    n_buckets = len(buckets_of(sd, bucket_bytes))
    model_mb = sum(t.numel() * t.element_size() for t in sd.values()) / 1e6
    fleet = make_engine(cfg, hf_dir)
    try:
        print(f"model: {model_mb:.2f} MB in {n_buckets} buckets of <= {args.bucket_kb:g} KiB; {len(fleet.urls)} SGLang "
              f"servers ({'attached' if args.server_urls else 'launched'}); best of {args.repeats}; torch threads "
              f"{torch.get_num_threads()}")
        seconds_per_push(fleet, sd, bucket_bytes, 1, "warm-up")  # the broadcast group forms here
        with probing_every_bucket():
            before = seconds_per_push(fleet, sd, bucket_bytes, args.repeats, "baseline")
        after = seconds_per_push(fleet, sd, bucket_bytes, args.repeats, "now")
    finally:
        fleet.shutdown()
    print("\n| push | seconds | seconds per bucket |\n|---|---|---|")
    print(f"| baseline: /health on every server before each bucket | {before:.2f} | {before / n_buckets:.3f} |")
    print(f"| now: /server_info once per server per push | {after:.2f} | {after / n_buckets:.3f} |")
    print(f"\nratio baseline / now: {before / after:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
