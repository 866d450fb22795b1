"""Stand-in for the CPU ops of ``sgl_kernel``, on the SGLang CPU server's PYTHONPATH only.

SGLang's CPU path imports ``sgl_kernel`` unconditionally, but the real package is a 373 MB CUDA
wheel, and its CPU kernels (AVX512/AMX C++) exist only as source. Without those kernels SGLang
computes the model with plain torch: it registers no ``torch.ops.sgl_kernel.*`` operator here, so
``cpu_has_amx_support()`` is False and the Intel AMX backend stays off. Of the ops it imports, a
dense text model (Qwen2, Llama) only calls ``assign_req_to_token_pool_cpu``, implemented below in
torch; every other name resolves to a function that raises if called, so a code path that would
need a real kernel fails loudly instead of computing something wrong.
"""
import torch


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """Write each request's new KV-cache slots into its row of the request -> token table.

    req_to_token: [pool_size, pool_len]; for request i (row ``req_pool_indices[i]``) its slots
    ``out_cache_loc[sum_{j<i} (end_j - start_j) : ... + end_i - start_i]`` go to columns
    ``start_offset[i]:end_offset[i]`` (SGLang's Triton kernel ``assign_req_to_token_pool``).
    """
    starts, ends = start_offset.tolist(), end_offset.tolist()
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), starts, ends):
        req_to_token[row, start:end] = out_cache_loc[offset:offset + end - start]
        offset += end - start


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} has no CPU stand-in in megadiv (only the ops a "
                                  "dense text model calls are provided; see megadiv/rollout/sglang_cpu)")
    return missing
