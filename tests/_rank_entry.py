"""Per-rank entry point used by tests/torchrun.py: import the body, run it, pickle the outcome."""
import importlib
import pickle
import sys
import traceback
from pathlib import Path


class RankContext:
    """What a test body gets: its rank, the world size and the test's keyword arguments."""

    def __init__(self, args: dict):
        import os
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.args = args


def main() -> None:
    target, tmp = sys.argv[1], Path(sys.argv[2])
    ctx = RankContext(pickle.loads((tmp / "args.pkl").read_bytes()))
    module_name, fn_name = target.split(":")
    try:
        body = getattr(importlib.import_module(module_name), fn_name)
        outcome = (True, body(ctx))
    except BaseException:  # the test must see every failure, SystemExit included
        outcome = (False, traceback.format_exc())
    (tmp / f"rank{ctx.rank}.pkl").write_bytes(pickle.dumps(outcome))
    try:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    if not outcome[0]:
        sys.exit(1)


if __name__ == "__main__":
    main()
