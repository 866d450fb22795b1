"""From the rollout driver to the trainer ranks: each data-parallel replica's rows as packed
tensors, through a key-value store, with no collective open while the ranks wait.

The driver (driver.py; its own process with SGLang, rank 0's with the embedded engine) hosts a
TCPStore. For batch k it deals the rows to the replicas (:func:`assign_rows`: balanced by tokens,
each global mini-batch keeping its rows), writes one packed payload per replica and then the
batch's status key. Every rank waits for that key (``store.wait``, ``rollout.handoff_timeout_s``:
a rollout may take an hour while ``parallel.timeout_s`` stays minutes, for real hangs); then the
first rank of each replica reads its replica's payload and broadcasts it inside the replica over
a gloo group (TP x PP ranks). Bytes per step: the batch once from the driver, plus each payload
to the TP x PP - 1 other ranks of its replica (was: the whole pickled batch to every rank).

Other waits go the same way: the driver sets a status key when a weight push may start (its
generation is quiescent) and when an evaluation is done, so no rank sits in an NCCL collective
(busy-waiting kernels, the watchdog's timeout) while rank 0's driver works.
"""
from __future__ import annotations

import datetime
import io
import json
import math
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from megadiv.policy.batches import SequenceBatch
from megadiv.rollout import RolloutError
from megadiv.trainer.experience import Experience, training_rows

OK = b"ok"
ERROR = b"error: "
CHUNK_BYTES = 4 << 20
"""A payload is stored in pieces of at most this size: TCPStore refuses a value over 8 MiB."""


@dataclass
class ReplicaRows:
    """One replica's rows of a rollout batch, packed: R rows, each prompt + response."""

    row_index: torch.Tensor        # [R] int64, the rows' places in the batch (prompt-major)
    prompt_lens: torch.Tensor      # [R] int32
    response_lens: torch.Tensor    # [R] int32
    tokens: torch.Tensor           # [sum(prompt + response)] int32, row after row
    rollout_logprobs: torch.Tensor  # [sum(response)] float32
    advantages: torch.Tensor       # [R] float32
    in_loss: torch.Tensor          # [R] float32: 0 for a row dropped from the loss
    rewards: torch.Tensor          # [B] float32: the whole batch's (a KL in the reward recomputes advantages)
    policy_version: torch.Tensor   # [] int64: the trainer step whose weights generated the batch
    routing: torch.Tensor          # [sum(prompt + response - 1), layers, k] int16, row after row; [0] without

    @classmethod
    def from_experience(cls, exp: Experience, rows: list[int]) -> "ReplicaRows":
        host = torch.device("cpu")  # a payload is built in host memory, whatever device trains on it
        prompts, responses = [exp.prompts[i] for i in rows], [exp.responses[i] for i in rows]
        index = torch.tensor(rows, dtype=torch.long, device=host)
        return cls(index, torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=host),
                   torch.tensor([len(r) for r in responses], dtype=torch.int32, device=host),
                   torch.tensor([t for p, r in zip(prompts, responses) for t in (*p, *r)], dtype=torch.int32,
                                device=host),
                   torch.tensor([v for i in rows for v in exp.rollout_logprobs[i]], dtype=torch.float32, device=host),
                   exp.advantages[index].float(), exp.in_loss[index].float(), exp.rewards.float(),
                   torch.tensor(exp.policy_version, device=host),
                   torch.cat([exp.routing[i] for i in rows]) if exp.routing is not None
                   else torch.zeros(0, dtype=torch.int16, device=host))

    def __len__(self) -> int:
        return len(self.row_index)

    def to_batch(self, pad_id: int) -> SequenceBatch:
        """Right-padded [R, S] rows, as Experience.to_batch makes them (rows out of the loss keep
        their place with an all-zero loss mask)."""
        lengths = (self.prompt_lens + self.response_lens).tolist()
        seqs = torch.split(self.tokens.long(), lengths)
        prompts = [s[:p].tolist() for s, p in zip(seqs, self.prompt_lens.tolist())]
        responses = [s[p:].tolist() for s, p in zip(seqs, self.prompt_lens.tolist())]
        values = [v.tolist() for v in torch.split(self.rollout_logprobs, self.response_lens.tolist())]
        routing = None
        if self.routing.dim() > 1:  # the engine's, per position but each row's last
            routing = list(torch.split(self.routing, [n - 1 for n in lengths]))
        return training_rows(prompts, responses, values, self.advantages, self.in_loss, pad_id, routing)

    def encode(self) -> bytes:
        """A JSON header (each field's dtype and shape), then the fields' raw bytes: the payload is
        the tensors' own size, and decoding runs no code."""
        tensors = [getattr(self, f.name).contiguous() for f in fields(self)]
        header = json.dumps([[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]).encode()
        return b"".join([len(header).to_bytes(4, "little"), header,
                         *(t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors)])

    @classmethod
    def decode(cls, data: bytes) -> "ReplicaRows":
        size = int.from_bytes(data[:4], "little")
        offset, values = 4 + size, []
        for dtype, shape in json.loads(data[4:offset]):
            dtype = getattr(torch, dtype)
            nbytes = math.prod(shape) * dtype.itemsize
            if nbytes:
                flat = torch.frombuffer(bytearray(data[offset:offset + nbytes]), dtype=torch.uint8)
                values.append(flat.view(dtype).reshape(shape))
            else:  # torch.frombuffer refuses an empty buffer
                values.append(torch.empty(shape, dtype=dtype))
            offset += nbytes
        return cls(*values)


def assign_rows(lengths: list[int], dp_size: int, mini_batches: int) -> list[list[int]]:
    """The rows of each replica, balanced by tokens. The global mini-batches keep their rows (the
    rows each replica's j-th contiguous share of B / dp_size held before: the same optimizer
    steps, so the same training result); inside each, the rows go longest first to the replica
    with the fewest tokens that still has room (every replica gets B / (dp_size * mini_batches)
    rows of it). Replica r's list: its share of mini-batch 0, then of 1, ..., in batch order."""
    per_replica = len(lengths) // dp_size
    per_share = per_replica // mini_batches
    shares: list[list[int]] = [[] for _ in range(dp_size)]
    for j in range(mini_batches):
        rows = [r * per_replica + j * per_share + i for r in range(dp_size) for i in range(per_share)]
        tokens, taken = [0] * dp_size, [[] for _ in range(dp_size)]
        for row in sorted(rows, key=lambda i: -lengths[i]):  # stable: ties in batch order
            to = min((r for r in range(dp_size) if len(taken[r]) < per_share), key=lambda r: tokens[r])
            taken[to].append(row)
            tokens[to] += lengths[row]
        for r in range(dp_size):
            shares[r] += sorted(taken[r])
    return shares


class Handoff:
    """The store keys a run's ranks wait on, and the driver's side that writes them."""

    def __init__(self, store: dist.Store, timeout_s: float):
        self.store, self.timeout_s = store, timeout_s

    @classmethod
    def host(cls, timeout_s: float) -> tuple["Handoff", int]:
        """A store served by this process (the driver's), for the driver's writes; returns it and
        its port. Waits go through a client of their own (``connect``, rank 0's too): a wait holds
        its store's one connection, and a write from another thread would queue behind it."""
        store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        return cls(store, timeout_s), store.port

    @classmethod
    def connect(cls, host: str, port: int, timeout_s: float) -> "Handoff":
        store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        return cls(store, timeout_s)

    # -- the driver's side

    def publish_batch(self, step: int, exp: Experience, dp_size: int, mini_batches: int) -> None:
        """Batch ``step``: one payload per replica, its metrics, then the status key."""
        lengths = [len(p) + len(r) for p, r in zip(exp.prompts, exp.responses)]
        for dp, rows in enumerate(assign_rows(lengths, dp_size, mini_batches)):
            self.put(f"batch/{step}/{dp}", ReplicaRows.from_experience(exp, rows).encode())
        self.publish(f"batch/{step}", torch_bytes(exp.metrics))

    def publish(self, key: str, value: bytes = OK) -> None:
        self.store.set(f"{key}/value", value)
        self.store.set(f"{key}/status", OK)

    def fail(self, key: str, error: BaseException) -> None:
        """Wake every rank waiting for ``key`` with the error (one line)."""
        text = str(error).splitlines()[0] if str(error) else type(error).__name__
        self.store.set(f"{key}/status", ERROR + text.encode()[:2000])

    # -- the ranks' side

    def wait(self, key: str) -> bytes:
        """Block (up to rollout.handoff_timeout_s) until the driver has written ``key``; its value.
        Raises RolloutError with the driver's message when it wrote an error."""
        try:
            self.store.wait([f"{key}/status"], datetime.timedelta(seconds=self.timeout_s))
        except (RuntimeError, dist.DistStoreError) as e:
            raise RolloutError(f"no {key} from the rollout driver within rollout.handoff_timeout_s="
                               f"{self.timeout_s:g} s ({e})") from None
        status = self.store.get(f"{key}/status")
        if status.startswith(ERROR):
            raise RolloutError(f"rollout driver: {status[len(ERROR):].decode(errors='replace')}")
        return self.store.get(f"{key}/value")

    def put(self, key: str, data: bytes) -> None:
        """Store a payload of any size, in pieces of CHUNK_BYTES (the count under ``key``)."""
        pieces = range(0, len(data), CHUNK_BYTES)
        for i, start in enumerate(pieces):
            self.store.set(f"{key}/{i}", data[start:start + CHUNK_BYTES])
        self.store.set(key, str(len(pieces)))

    def take(self, key: str) -> bytes:
        """Read and delete a payload (the driver's store keeps nothing once it is taken)."""
        count = int(self.store.get(key))
        data = b"".join(self.store.get(f"{key}/{i}") for i in range(count))
        for name in [key] + [f"{key}/{i}" for i in range(count)]:
            self.store.delete_key(name)
        return data

    def receive(self, key: str, replica, source: int) -> bytes:
        """A replica's payload ``key``: its first rank ``source`` takes it from the store and
        broadcasts it over the replica's gloo group (``replica``; None: a replica of one rank)."""
        if replica is None:
            return self.take(key)
        box = [self.take(key) if dist.get_rank() == source else None]
        dist.broadcast_object_list(box, src=source, group=replica)
        return box[0]


def torch_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def from_torch_bytes(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


def replica_group(info, timeout_s: float):
    """Collective: a gloo group of this data-parallel replica's TP x PP ranks and its first rank,
    which receives the replica's rows and broadcasts them (None, rank at TP = PP = 1)."""
    if info.tp_size * info.pp_size == 1:
        return None, info.rank
    replica_of = [None] * info.world_size
    dist.all_gather_object(replica_of, info.dp_rank)
    mine = None
    for dp in range(info.dp_size):  # every rank makes every group, in the same order
        ranks = [r for r in range(info.world_size) if replica_of[r] == dp]
        group = dist.new_group(ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        if dp == info.dp_rank:
            mine = (group, ranks[0])
    return mine
