"""Rollout throughput of both engines and weight-sync bandwidth, against a plain loopback copy.

    .venv/bin/python benchmarks/bench_rollout.py                 # CPU: embedded + a launched SGLang server
    .venv/bin/python benchmarks/bench_rollout.py --engines embedded

Builds a random Qwen2 checkpoint (megadiv make-tiny-model; --hidden/--layers/--ffn set its size),
then, per engine:
- rollout tokens/s: ``--prompts`` prompts x ``--new-tokens`` sampled tokens (T=1, EOS ignored by
  using a stop set of none and counting what came back), after one warm-up call;
- weight sync MB/s: ``update_weights`` of the full model (fp32) in ``--bucket-mb`` buckets, per sync
  method, best of ``--repeats``.
The baseline is the same number of bytes, in the same bucket sizes, sent over a loopback TCP
socket to a child process that receives them into a buffer: what the transport alone allows here.
"""
from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megadiv.models.tiny import make_tiny_model  # noqa: E402
from megadiv.rollout import RolloutConfig, SamplingParams  # noqa: E402


def buckets_of(sd: dict, bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    out, cur, size = [], [], 0
    for name, t in sd.items():
        if cur and size + t.numel() * t.element_size() > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append((name, t))
        size += t.numel() * t.element_size()
    return out + [cur] if cur else out


def rollout_tokens_per_s(engine, prompts, new_tokens: int) -> float:
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=new_tokens)
    engine.generate(prompts[:2], params)  # warm-up
    t0 = time.perf_counter()
    groups = engine.generate(prompts, params)
    seconds = time.perf_counter() - t0
    return sum(len(c.token_ids) for g in groups for c in g) / seconds


def sync_mb_per_s(engine, buckets, repeats: int) -> float:
    best = 0.0
    for i in range(repeats):
        bumped = [[(n, t + 1e-3 * (i + 1)) for n, t in b] for b in buckets]  # new values every time
        best = max(best, engine.update_weights(iter(bumped), f"bench-{i}").mb_per_s)
    return best


def _receive(port: int, total: int) -> None:
    buf = bytearray(total)
    view = memoryview(buf)
    with socket.create_connection(("127.0.0.1", port)) as s:
        got = 0
        while got < total:
            got += s.recv_into(view[got:], total - got)
        s.sendall(b"k")


def loopback_mb_per_s(buckets, repeats: int) -> float:
    """Send every bucket's bytes over loopback TCP to a child process (bytes received into a buffer)."""
    flats = [torch.cat([t.contiguous().view(-1).view(torch.uint8) for _, t in b]).numpy() for b in buckets]
    total = sum(f.nbytes for f in flats)
    best = 0.0
    for _ in range(repeats):
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen(1)
            child = mp.get_context("spawn").Process(target=_receive, args=(server.getsockname()[1], total))
            child.start()
            conn, _ = server.accept()
            with conn:
                t0 = time.perf_counter()
                for f in flats:
                    conn.sendall(memoryview(f))
                conn.recv(1)  # the child has everything
                seconds = time.perf_counter() - t0
            child.join(timeout=60)
        best = max(best, total / 1e6 / seconds)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", default=["embedded", "sglang"], choices=["embedded", "sglang"])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--bucket-mb", type=float, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp:
        return run(args, Path(tmp))


def run(args, tmp: Path) -> int:
    hf_dir = str(make_tiny_model(tmp / "model", "qwen2", hidden=args.hidden, layers=args.layers, ffn=args.ffn,
                                 heads=8, kv_heads=4, max_positions=1024))
    from safetensors.torch import load_file
    sd = load_file(str(Path(hf_dir) / "model.safetensors"))
    bucket_bytes = int(args.bucket_mb * (1 << 20))
    buckets = buckets_of(sd, bucket_bytes)
    total_mb = sum(t.numel() * t.element_size() for t in sd.values()) / 1e6
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 100, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    print(f"model: qwen2 hidden {args.hidden}, {args.layers} layers, ffn {args.ffn}: {total_mb:.1f} MB fp32 in "
          f"{len(buckets)} buckets of <= {args.bucket_mb:g} MiB; rollout {args.prompts} x {args.new_tokens} tokens; "
          f"torch threads {torch.get_num_threads()}")

    rows = [("loopback TCP copy (baseline)", "-", f"{loopback_mb_per_s(buckets, args.repeats):.0f}")]
    cfg = RolloutConfig(bucket_bytes=bucket_bytes, sync_timeout_s=600, startup_timeout_s=600)
    for name in args.engines:
        if name == "embedded":
            from megadiv.rollout.embedded import EmbeddedEngine
            engine = EmbeddedEngine(hf_dir, dataclasses.replace(cfg, engine="embedded"))
            methods = ["in-process copy"]
        else:
            from megadiv.rollout.sglang_engine import SGLangEngine
            engine = SGLangEngine(hf_dir, dataclasses.replace(cfg, engine="sglang", log_dir=str(tmp)))
            methods = ["distributed", "disk"]
        try:
            tps = rollout_tokens_per_s(engine, prompts, args.new_tokens)
            for method in methods:
                if name == "sglang":
                    engine.cfg = dataclasses.replace(engine.cfg, sync_method=method)
                rows.append((f"{name}: {method}", f"{tps:.0f}", f"{sync_mb_per_s(engine, buckets, args.repeats):.0f}"))
        finally:
            engine.shutdown()
    print("\n| engine / sync method | rollout tokens/s | weight sync MB/s |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
