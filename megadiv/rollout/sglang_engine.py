"""SGLangEngine: the rollout protocol over SGLang HTTP servers, launched here or already running.

    engine = SGLangEngine(hf_dir, RolloutConfig(engine="sglang"))                 # launches one
    engine = SGLangEngine(hf_dir, RolloutConfig(engine="sglang",
                                                server_urls=("http://node7:30000", "http://node8:30000")))

The trainer holds its servers through a FleetEngine (fleet.py), one SGLangEngine per server (a
member), whose generation is the fleet's group stream (fleet_stream.py). On its own, an
SGLangEngine spreads prompts over its servers in contiguous slices (each prompt repeated n times,
so the order of completions is exact); requests run concurrently, one thread per server.

A weight sync (update_weights) sends every bucket to every server, by one of three methods:

- distributed: each bucket flattened into one byte tensor and broadcast from this process (rank 0)
  to all servers' TP ranks over a dedicated process group (gloo on CPU, NCCL on GPU), next to an
  ``/update_weights_from_distributed`` request per server carrying names, dtypes and shapes;
- tensor: shared CUDA-IPC handles in ``/update_weights_from_tensor`` (GPU, same machine);
- disk: one safetensors file per bucket in a fresh directory, then ``/update_weights_from_disk``.

distributed and tensor run inside SGLang's ``/begin_weight_update`` .. ``/end_weight_update``
session (required by 0.5.23). Every server must answer ``/server_info`` (no generation) once, at the
start of the push; nothing is probed per bucket. Every update request flushes the radix cache (its
KV came from the old weights; the server refuses if requests are running), and the weight version
is set last. Each step has a timeout; a refusal or a dead server raises WeightSyncError naming the
server and the version, and the session is closed again.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Sequence

import requests
import torch

from megadiv.rollout.config import RolloutConfig
from megadiv.rollout.engine import (
    Bucket,
    Completion,
    RolloutError,
    SamplingParams,
    SyncReport,
    WeightSyncError,
    check_prompts,
)
from megadiv.rollout.sglang_server import GpuPlacement, SGLangServer, TrainerMemory, place_server
from megadiv.rollout.weight_sync import (
    BroadcastGroup,
    Peer,
    alive,
    check_bucket,
    flatten_bucket,
    post,
    read_manifest,
    serialize_bucket,
    write_bucket,
)

log = logging.getLogger(__name__)


class SGLangEngine:
    def __init__(self, hf_dir: str, cfg: RolloutConfig, trainer_memory: TrainerMemory | None = None,
                 server_index: int = 0):
        """``trainer_memory``: the trainer's GPUs on this node, free and still to be allocated,
        for a server launched beside it; ``server_index``: this server's place in a fleet (see
        sglang_server.place_server)."""
        self.gpu = self._placement(cfg, trainer_memory, server_index)
        self.sync_method = resolve_sync_method(cfg, self.gpu)
        if self.sync_method == "tensor" and not torch.cuda.is_available():
            raise ValueError("rollout.sync_method 'tensor' passes CUDA-IPC handles: it needs CUDA; use 'distributed' "
                             "or 'disk'")
        self.cfg = cfg
        self.server: SGLangServer | None = None
        self._group: BroadcastGroup | None = None
        self._sync_root = Path(cfg.sync_dir) if cfg.sync_dir else None
        self._last_sync_dir: Path | None = None
        self._paused = False
        self.bytes_sent = 0  # by the sync in progress or the last one, failed or not (SyncReport.bytes_sent)
        if cfg.server_urls:
            self.urls = [u.rstrip("/") for u in cfg.server_urls]
        else:
            self.server = SGLangServer.launch(hf_dir, cfg, self.gpu)
            self.urls = [self.server.url]
        self._pool = ThreadPoolExecutor(max_workers=4 * len(self.urls) + 4, thread_name_prefix="sglang-http")
        try:
            info = [self._get(u, "/server_info") for u in self.urls]
        except BaseException:
            self.shutdown()
            raise
        self._peers = [Peer(u, int(i.get("tp_size", 1))) for u, i in zip(self.urls, info)]
        if cfg.server_urls:  # a trainer that crashed mid-sync leaves the session open: begin would refuse
            for url in self.urls:
                try:
                    post(url, "/end_weight_update", {}, 60.0)
                    log.warning("closed a weight-update session left open on %s", url)
                except RolloutError:
                    pass  # none was open (the usual answer)
        self._manifest = read_manifest(hf_dir) if cfg.check_weight_names else None
        if cfg.check_weight_names and self._manifest is None:
            log.warning("no safetensors in %s readable here: pushed weight names are not checked", hf_dir)

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        check_prompts(prompts)
        self._check_not_paused()
        flat = [list(p) for p in prompts for _ in range(params.n)]  # [prompt0 x n, prompt1 x n, ...]
        sampling = sampling_payload(params)
        outs = self._scatter(flat, lambda ids: {"input_ids": ids, "sampling_params": sampling, "return_logprob": True},
                             "generate")
        completions = [parse_completion(o) for o in outs]
        return [completions[i * params.n:(i + 1) * params.n] for i in range(len(prompts))]

    def score(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        check_prompts(prompts)
        self._check_not_paused()
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        seqs = [(list(p), list(r)) for p, r in zip(prompts, responses)]
        # logprob_start_len = len(prompt) - 1 returns entries for tokens prompt[-1], response...;
        # the first is always None (SGLang reports no log-prob for the first returned position).
        # These prompt log-probs are log_softmax(logits) whatever the request's temperature.
        outs = self._scatter(seqs, lambda chunk: {
            "input_ids": [p + r for p, r in chunk], "logprob_start_len": [len(p) - 1 for p, _ in chunk],
            "sampling_params": {"max_new_tokens": 0}, "return_logprob": True}, "score")
        return [torch.tensor([x[0] for x in o["meta_info"]["input_token_logprobs"][1:]], dtype=torch.float32)
                for o in outs]

    def _scatter(self, items: list, payload, what: str) -> list[dict]:
        """Split ``items`` into one contiguous slice per server, POST /generate concurrently,
        return the outputs in order. Raises RolloutError naming a server that fails or dies."""
        per = -(-len(items) // len(self.urls))
        jobs = [(u, items[i * per:(i + 1) * per]) for i, u in enumerate(self.urls) if items[i * per:(i + 1) * per]]
        futures = [(u, self._pool.submit(_post_generate, u, payload(chunk), self.cfg.request_timeout_s))
                   for u, chunk in jobs]
        outs = []
        for url, fut in futures:
            outs += self._wait(url, fut, what)
        return outs

    def _wait(self, url: str, fut: Future, what: str):
        """fut.result(), but a launched server that dies fails the call at once."""
        while True:
            try:
                return fut.result(timeout=0.5)
            except TimeoutError:
                if self.server is not None and not self.server.alive():
                    raise RolloutError(f"SGLang server {url} died during {what} (exit code "
                                       f"{self.server.proc.returncode}); log {self.server.log_path}:\n"
                                       f"{self.server.log_tail()}") from None
            except RolloutError as e:
                raise RolloutError(f"{what} failed: {e}" + self._log_hint()) from None

    # ------------------------------------------------------------------ weights

    def update_weights(self, buckets: Iterable[Bucket], version: str) -> SyncReport:
        method = self.sync_method
        where = f"weight sync to version {version!r} ({method}) on {self.urls}"
        t0 = time.perf_counter()
        n_tensors = n_buckets = n_bytes = 0
        began, target = [], None  # the servers whose session this sync opened (and must close)
        self.bytes_sent = 0
        try:
            # once per push, concurrently: a server dead before the push is named before any session
            # opens. A death later in the push is caught by the broadcast itself (BroadcastGroup:
            # the dead server's request fails, the group is aborted), not by a probe per bucket.
            dead = [u for u, ok in zip(self.urls, self._pool.map(alive, self.urls)) if not ok]
            if dead:
                raise RolloutError(f"{dead} do not answer /server_info: nothing sent")
            if method == "disk":
                target = self._new_sync_dir(version)
            else:
                for url in self.urls:  # one at a time: a refusal leaves only the sessions begun before it
                    self._call([url], "/begin_weight_update", {})
                    began.append(url)
            for i, bucket in enumerate(buckets):
                at = f"bucket {i}"
                if self._manifest is not None:
                    check_bucket(bucket, self._manifest, at)
                if method == "distributed":
                    self._push_distributed(bucket, at)
                elif method == "tensor":
                    payload = {"load_format": None, "flush_cache": True}
                    for p in self._peers:  # one payload per TP rank: each opens its own handles once
                        self._call([p.url], "/update_weights_from_tensor", dict(
                            payload, serialized_named_tensors=[serialize_bucket(bucket) for _ in range(p.tp_size)]))
                else:
                    write_bucket(bucket, target, i)
                n_buckets, n_tensors = n_buckets + 1, n_tensors + len(bucket)
                n_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
            if method == "disk":
                self._call_all("/update_weights_from_disk", {"model_path": str(target), "flush_cache": True})
                self._drop_old_sync_dir(target)
            if began:
                self._call_all("/end_weight_update", {})
                began = []
            self._call_all("/update_weight_version", {"new_version": version, "abort_all_requests": False})
        except (RolloutError, OSError) as e:
            for url in began:  # leave the servers usable: a session left open refuses the next begin
                try:
                    post(url, "/end_weight_update", {}, 30.0)
                except RolloutError:
                    pass
            if target is not None and target != self._last_sync_dir:
                shutil.rmtree(target, ignore_errors=True)
            raise WeightSyncError(f"{where} failed: {e}" + self._log_hint()) from None
        report = SyncReport(version, method, n_tensors, n_buckets, n_bytes, time.perf_counter() - t0, self.bytes_sent)
        log.info("weight sync %s: %d tensors in %d buckets, %.1f MB in %.3f s (%.1f MB/s)", version, n_tensors,
                 n_buckets, n_bytes / 1e6, report.seconds, report.mb_per_s)
        return report

    def _push_distributed(self, bucket: Bucket, where: str) -> None:
        if self._group is not None and self._group.broken:
            self._group.destroy(self._pool)
            self._group = None
        if self._group is None:
            self._group = BroadcastGroup(self._peers, self.cfg.sync_timeout_s, self._pool)
        flat, fields = flatten_bucket(bucket)
        if flat.device.type != ("cuda" if self._group.backend == "nccl" else "cpu"):
            flat = flat.to("cuda" if self._group.backend == "nccl" else "cpu")
        payload = dict(fields, group_name=self._group.name, flush_cache=True)
        futures = [(u, self._pool.submit(post, u, "/update_weights_from_distributed", payload, self.cfg.sync_timeout_s))
                   for u in self.urls]
        self.bytes_sent += flat.numel() * flat.element_size()  # on the wire even if the broadcast then fails
        self._group.broadcast(flat, futures, where)
        for _, fut in futures:
            fut.result()  # the servers' verdicts on loading what they received

    def _new_sync_dir(self, version: str) -> Path:
        root = self._sync_root or Path(tempfile.gettempdir()) / "megadiv-weight-sync"
        root.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"{_safe(version)}-", dir=root))

    def _drop_old_sync_dir(self, current: Path) -> None:
        # the servers now read from ``current`` (their model_path); the previous version can go
        if self._last_sync_dir is not None:
            shutil.rmtree(self._last_sync_dir, ignore_errors=True)
        self._last_sync_dir = current

    # ------------------------------------------------------------------ control

    def pause(self) -> None:
        # retract: running requests go back to the queue and are recomputed after resume()
        self._call_all("/pause_generation", {"mode": "retract"})
        self._paused = True

    def resume(self) -> None:
        self._call_all("/continue_generation", {})
        self._paused = False

    @property
    def weight_version(self) -> str:
        versions = {u: self._get(u, "/model_info")["weight_version"] for u in self.urls}
        if len(set(versions.values())) > 1:
            raise RolloutError(f"servers disagree on the weight version: {versions}")
        return next(iter(versions.values()))

    def shutdown(self) -> None:
        if self._group is not None:
            if self.server is None or self.server.alive():
                self._group.destroy(self._pool)
            self._group = None
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.server is not None:
            self.server.stop()
        if self._last_sync_dir is not None and self._sync_root is None:
            shutil.rmtree(self._last_sync_dir, ignore_errors=True)

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _placement(cfg: RolloutConfig, memory: TrainerMemory | None, index: int) -> GpuPlacement | None:
        """The GPUs of a server launched here (None: attached servers, or no CUDA). The trainer's
        ranks on this node hold GPUs [0, LOCAL_WORLD_SIZE) (torchrun)."""
        if cfg.server_urls or not torch.cuda.is_available():
            return None
        return place_server(cfg, trainer_gpus=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                            visible_gpus=torch.cuda.device_count(), memory=memory, index=index)

    def _check_not_paused(self) -> None:
        if self._paused:
            raise RolloutError("the engine is paused: call resume() before generate()/score()")

    def _call(self, urls: list[str], path: str, payload: dict) -> list[dict]:
        futures = [(u, self._pool.submit(post, u, path, payload, self.cfg.sync_timeout_s)) for u in urls]
        return [self._wait(u, f, path) for u, f in futures]

    def _call_all(self, path: str, payload: dict) -> list[dict]:
        return self._call(self.urls, path, payload)

    def _get(self, url: str, path: str) -> dict:
        try:
            r = requests.get(url + path, timeout=60)
            r.raise_for_status()
            return r.json()
        except requests.ConnectionError as e:
            raise RolloutError(f"{url}{path}: server unreachable (dead?): {e}" + self._log_hint()) from None
        except requests.RequestException as e:
            raise RolloutError(f"{url}{path}: {e}" + self._log_hint()) from None

    def _log_hint(self) -> str:
        if self.server is None:
            return ""
        state = "running" if self.server.alive() else f"exited with code {self.server.proc.returncode}"
        return f"\n(launched server {state}; log {self.server.log_path})"


def resolve_sync_method(cfg: RolloutConfig, gpu: GpuPlacement | None) -> str:
    """``auto``: CUDA-IPC handles (``tensor``) for a launched server sharing GPUs with the trainer,
    a broadcast group (``distributed``) otherwise. A broadcast group cannot span a shared GPU:
    NCCL refuses two ranks of one communicator on one device ("Duplicate GPU detected")."""
    colocated = gpu is not None and gpu.shares_trainer_gpus
    if cfg.sync_method == "auto":
        return "tensor" if colocated else "distributed"
    if cfg.sync_method == "distributed" and colocated:
        raise ValueError(f"rollout.sync_method 'distributed' with a server launched on the trainer's GPUs "
                         f"{list(range(gpu.base_gpu_id, gpu.base_gpu_id + cfg.server_tp))}: NCCL refuses two ranks "
                         f"of one group on one GPU; use sync_method 'tensor' (or 'auto'), or leave GPUs free "
                         f"for the server")
    return cfg.sync_method


def sampling_payload(params: SamplingParams) -> dict:
    """``params`` as SGLang's ``sampling_params`` (one sample per sequence: n is the caller's)."""
    return {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
            "max_new_tokens": params.max_new_tokens, "stop_token_ids": list(params.stop_token_ids)}


def parse_completion(out: dict) -> Completion:
    """One sequence of a /generate answer (requested with return_logprob)."""
    meta = out["meta_info"]
    return Completion(token_ids=list(out["output_ids"]), logprobs=[float(x[0]) for x in meta["output_token_logprobs"]],
                      finish_reason=_finish_reason(meta["finish_reason"]),
                      weight_version=meta.get("weight_version", "default"))


def _post_generate(url: str, payload: dict, timeout_s: float) -> list[dict]:
    out = post(url, "/generate", payload, timeout_s)
    return out if isinstance(out, list) else [out]


def _finish_reason(info: dict | None) -> str:
    kind = (info or {}).get("type", "abort")
    return kind if kind in ("stop", "length") else "abort"


def _safe(version: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in version)[:64]
