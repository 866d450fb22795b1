"""Process groups for torchrun launches and megatron-core's parallel state (TP, PP, DP)."""
from megadiv.parallel.distributed import ParallelInfo, info, initialize, shutdown

__all__ = ["ParallelInfo", "info", "initialize", "shutdown"]
