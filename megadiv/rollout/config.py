"""RolloutConfig: which engine generates, how it samples, and how the trainer's weights reach it.

Light on purpose (no torch import): megadiv.config loads it with the rest of the run config.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Literal
from urllib.parse import urlparse

from megadiv.config import ConfigError

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
"""Hosts whose servers run on the trainer's machine."""


@dataclass(frozen=True)
class RolloutConfig:
    """The rollout engine section (``rollout.*``). Validated on construction; errors name the key."""

    engine: Literal["auto", "embedded", "sglang"] = "auto"
    """``embedded`` (transformers in the trainer process), ``sglang`` (server processes), or
    ``auto``: SGLang when CUDA and sglang are available, embedded otherwise (the CPU default)."""

    # -- sampling defaults (megadiv.rollout.SamplingParams.from_config) --
    n_samples: int = 8
    """Completions per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature; 0 means greedy. Log-probs are of softmax(logits / T) (docs/rollout.md)."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1 disables."""
    top_k: int = -1
    """-1 disables top-k."""
    max_new_tokens: int = 256
    """Longest response; longer ones end with finish reason 'length'."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end a completion besides the model's EOS tokens; the stop token is kept."""

    # -- SGLang servers --
    server_urls: tuple[str, ...] = ()
    """Attach to these running servers (``http://host:port``, any node) instead of launching any;
    with several, each GRPO group goes to the least-loaded one (docs/rollout.md)."""
    num_servers: int = 1
    """Servers to launch on this node when ``server_urls`` is empty (each ``server_tp`` GPUs);
    with several, each GRPO group goes to the least-loaded one."""
    server_tp: int = 1
    """Tensor-parallel size of a launched server (GPU only; CPU servers run TP=1)."""
    mem_fraction_static: float = 0.8
    """GPU memory fraction a launched server reserves for weights + KV cache (GPU only). Beside the
    trainer: the share of the memory free at its start for the server plus the trainer's optimizer
    state to come; (1 - this) of it stays free for the trainer's activations (docs/rollout.md)."""
    server_args: tuple[str, ...] = ()
    """Extra ``sglang.launch_server`` flags for a launched server, e.g. ("--max-running-requests", "64")."""
    server_python: str | None = None
    """The Python that runs a launched server (``-m sglang.launch_server``); it must import sglang.
    None: the container's SGLang environment, /opt/sglang/bin/python, where it exists (docker/),
    else the trainer's own interpreter. Checked by check-config when servers are launched."""
    log_dir: str | None = None
    """Where a launched server writes its log; None: a temporary directory (path logged)."""
    startup_timeout_s: float = 600.0
    """Limit for a launched server to answer /health (CPU start-up: 20-80 s)."""
    request_timeout_s: float = 1800.0
    """Limit for one generate/score HTTP request (a whole batch of completions)."""
    shutdown_grace_s: float = 10.0
    """SIGTERM -> SIGKILL grace period when stopping a launched server."""
    max_inflight_groups: int | None = None
    """GRPO groups one server generates at once (one request each); the rest wait in the trainer's
    stream and go to whichever server frees a slot first, so a slow server takes fewer. None: what
    the server's KV cache holds, its max_total_num_tokens / (n_samples x expected tokens per sample:
    mean prompt + mean completion so far, max_new_tokens / 2 before any), at most its
    max_running_requests / n_samples (docs/rollout.md)."""
    heartbeat_s: float = 10.0
    """While groups are generated, every server (launched or attached) answers /health_generate
    this often; one that misses it is dropped from the fleet and its groups are sent elsewhere."""
    heartbeat_timeout_s: float = 60.0
    """Longest a server may take to answer one heartbeat (a 1-token generation when idle); also how
    long attached servers still silent at start-up are waited for once another answers."""

    handoff_timeout_s: float = 7200.0
    """Longest a trainer rank waits for the rollout driver: a batch, the engine going quiet before a
    weight push, an evaluation. The ranks wait on a store key, not in a collective, so
    parallel.timeout_s stays short enough to catch a real hang in training (docs/rollout.md)."""

    # -- weight sync --
    sync_method: Literal["auto", "distributed", "tensor", "disk"] = "auto"
    """distributed: broadcast over a process group trainer -> servers (gloo on CPU, NCCL on GPU;
    servers on GPUs of their own); tensor: CUDA-IPC handles (servers on the trainer's machine);
    disk: safetensors in ``sync_dir`` (servers must see that directory); auto: tensor for a
    server launched on the trainer's GPUs (colocated), distributed otherwise. None of them needs
    sglang in the trainer's Python."""
    bucket_bytes: int = 512 << 20
    """Bytes per weight bucket (one broadcast / one request); bigger is faster, smaller uses less memory."""
    sync_timeout_s: float = 600.0
    """Limit for one weight sync (every HTTP call and every collective in it)."""
    sync_dir: str | None = None
    """Directory for disk syncs; None: a temporary directory (single-node only)."""
    check_weight_names: bool = True
    """Check every pushed tensor's name and shape against the served checkpoint before sending
    (SGLang silently ignores unknown names). Skipped when the checkpoint is not readable here."""

    # -- mismatch check (after a weight push; how often: grpo.check_mismatch_every) --
    probe_floor: float = 0.05
    """The smallest limit on the mean |engine log-prob - trainer log-prob| over the probe tokens after
    a push: a figure at or below it always passes. It rules where the step-0 baseline is tiny
    (float32: ~1e-7), so that noise a little above that baseline is not an error."""
    probe_factor: float = 4.0
    """The limit after a push is max(probe_floor, probe_factor x the baseline), the baseline being the
    same figure on identical weights before any training (taken again at the loaded weights on
    resume). bf16 or FP8 noise scales the limit; a stale, missing or misnamed tensor moves the
    figure by O(1) (docs/rollout.md)."""
    probe_max_limit: float = 0.5
    """The largest limit the baseline may set: a baseline x probe_factor above it stops the run at its
    start (engine and trainer disagree on the same weights, so an O(1) corruption would pass)."""
    probe_prompts: int = 4
    """Sequences in the probe batch: held-out prompts (the first eval split, else the training data,
    spread evenly) with the run's template, and the engine's own answers to them."""
    probe_response_len: int = 16
    """Longest answer the engine draws for each probe prompt (the compared log-probs; an answer that
    ends early is shorter)."""

    RETIRED_KEYS: ClassVar[dict[str, str]] = {
        "mismatch_threshold": "the post-sync limit is now max(rollout.probe_floor, rollout.probe_factor x a "
                              "baseline taken on identical weights), capped by rollout.probe_max_limit",
        "mismatch_threshold_fp8": "the step-0 baseline includes FP8's rounding; set rollout.probe_factor / "
                                  "rollout.probe_max_limit instead",
        "probe_prompt_len": "the probe uses whole held-out prompts, rendered with the run's template",
    }
    """Keys this section no longer takes, with what replaced them (the loader's refusal names it)."""

    def __post_init__(self):
        def fail(key: str, why: str):
            raise ConfigError(f"rollout.{key} {why}, got {getattr(self, key)!r}")

        for key in ("n_samples", "max_new_tokens", "server_tp", "num_servers", "bucket_bytes", "probe_prompts",
                    "probe_response_len"):
            if getattr(self, key) < 1:
                fail(key, "must be >= 1")
        if self.max_inflight_groups is not None and self.max_inflight_groups < 1:
            fail("max_inflight_groups", "must be >= 1 (or null: what each server's KV cache holds)")
        if self.temperature < 0:
            fail("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            fail("top_p", "must lie in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            fail("top_k", "must be -1 (disabled) or >= 1")
        if any(t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must be token ids >= 0")
        if not 0 < self.mem_fraction_static < 1:
            fail("mem_fraction_static", "must lie in (0, 1)")
        for key in ("startup_timeout_s", "request_timeout_s", "shutdown_grace_s", "sync_timeout_s", "handoff_timeout_s",
                    "heartbeat_s", "heartbeat_timeout_s", "probe_floor"):
            if getattr(self, key) <= 0:
                fail(key, "must be > 0")
        for url in self.server_urls:
            if not url.startswith(("http://", "https://")):
                fail("server_urls", f"entries must start with http:// or https:// ({url!r} does not)")
        if self.server_urls and self.engine == "embedded":
            fail("server_urls", "are only used by engine 'sglang' (engine is 'embedded')")
        if self.num_servers > 1 and self.server_urls:
            fail("num_servers", f"launches servers, but rollout.server_urls attaches to {len(self.server_urls)} "
                                "running ones: set one of the two")
        if self.num_servers > 1 and self.engine == "embedded":
            fail("num_servers", "is only used by engine 'sglang' (engine is 'embedded')")
        if self.server_python is not None and not self.server_python.startswith("/"):
            fail("server_python", "must be an absolute path to a Python interpreter")
        if self.server_python is not None and (self.server_urls or self.engine == "embedded"):
            fail("server_python", "runs launched servers; this config launches none (engine 'embedded' or "
                                  "rollout.server_urls set)")
        if len(set(self.server_urls)) != len(self.server_urls):
            fail("server_urls", "must not repeat a server")
        remote = [u for u in self.server_urls if urlparse(u).hostname not in LOOPBACK_HOSTS]
        if self.sync_method == "tensor" and remote:
            fail("sync_method", f"passes CUDA-IPC handles, which only a server on the trainer's machine can open "
                                f"(rollout.server_urls has {remote}): use 'distributed' or 'disk'")
        if not self.probe_factor >= 1:
            fail("probe_factor", "must be >= 1 (below it the limit would lie under the noise it is scaled from)")
        if not self.probe_max_limit > self.probe_floor:
            fail("probe_max_limit", f"must be above rollout.probe_floor={self.probe_floor:g}")

    def attached(self, urls, **changes) -> "RolloutConfig":
        """This config for engines on running servers at ``urls`` (the fleet's members, the driver's
        view of rank 0's fleet): it launches nothing, so it has no server_python."""
        return dataclasses.replace(self, server_urls=tuple(urls), num_servers=1, server_python=None, **changes)
