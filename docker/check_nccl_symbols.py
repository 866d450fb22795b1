"""Does the image's NCCL define every NCCL function the SGLang environment's torch calls?

    python docker/check_nccl_symbols.py PROVIDER CONSUMER [CONSUMER ...]

The SGLang venv preloads the image's libnccl.so.2 (PROVIDER), so torch 2.14.1's CUDA libraries
(CONSUMERs) bind their NCCL symbols there instead of in the nvidia-nccl wheel they were built
against, which may be newer (torch 2.14.1: NCCL 2.30; an NGC 25.12 image: 2.28). Functions are
bound lazily: one the image's NCCL lacks would end a run at its first call, not at start-up. This
lists each consumer's undefined dynamic symbols named nccl*/pnccl* (``nm -D``) and looks each up in
the provider (dlsym through ctypes); exit 1 names the missing ones and what to do, exit 0 is silent.
"""
from __future__ import annotations

import ctypes
import subprocess
import sys


def needed(consumer: str) -> set[str]:
    """The NCCL functions ``consumer`` imports (undefined dynamic symbols, version suffix cut)."""
    out = subprocess.run(["nm", "-D", "--undefined-only", consumer], capture_output=True, text=True, check=True)
    names = (line.split()[-1].split("@")[0] for line in out.stdout.splitlines() if line.strip())
    return {n for n in names if n.startswith(("nccl", "pnccl"))}


def missing(provider: str, consumers: list[str]) -> dict[str, list[str]]:
    """{consumer: the NCCL symbols it needs that ``provider`` does not define}, consumers with none left out."""
    lib = ctypes.CDLL(provider)
    gaps = {c: sorted(n for n in needed(c) if not hasattr(lib, n)) for c in consumers}
    return {c: names for c, names in gaps.items() if names}


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    provider, consumers = argv[0], argv[1:]
    gaps = missing(provider, consumers)
    if gaps:
        listed = "; ".join(f"{c} needs {', '.join(names)}" for c, names in gaps.items())
        print(f"the image's NCCL ({provider}) lacks functions the SGLang environment's torch calls: {listed}. Pick a "
              f"base image whose NCCL is at least the nvidia-nccl wheel torch pins (pip show nvidia-nccl-cu13 in "
              f"/opt/sglang), or drop the preload (.pth) and give both environments that wheel's NCCL; without one "
              f"NCCL, use rollout.sync_method tensor or disk (no NCCL group between trainer and servers)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
