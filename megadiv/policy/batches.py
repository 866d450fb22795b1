"""The rows a policy trains on (:class:`SequenceBatch`), and micro-batches without compute on
padding: token-budget grouping and the model's input layout.

A batch's rows are right-padded to its longest row S. With a token budget (verl's dynamic batch
size), the rows are sorted longest first and cut into runs whose padded size, rows x the run's
longest row (rounded up to the model's sequence multiple), stays within the budget; each
micro-batch is then fed to the model at its own width w <= S instead of S:

    lengths  [9, 2, 8, 3, 2, 1]   budget 18   ->   rows [[0, 2], [3, 1, 4, 5]]   widths [9, 3]
    padded tokens: 6 x 9 = 54 at one fixed width, 2 x 9 + 4 x 3 = 30 here

With Transformer Engine, packing goes further: a micro-batch's rows are concatenated into one
row of T = sum(lengths) tokens (THD layout), and attention is kept within each row by
``packed_seq_params`` (cumulative sequence lengths), so nothing is padded at all.

Whatever the layout, the logits are computed at the positions that predict a response token
only (the prompt's positions, most of a row when prompts are long, never reach the output layer),
and the per-token results come back as [b, S] rows (:meth:`ModelInput.to_rows`, zeros elsewhere),
so the loss functions see the tensors of the padded path and every loss aggregation is unchanged
(megatron.py sums numerators and denominators over micro-batches).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def row_lengths(loss_mask: torch.Tensor) -> torch.Tensor:
    """Tokens of each row before right-padding, [B, S] -> [B] int64, read off the loss mask: the
    last position that predicts a response token is length - 2 (see megatron.py). A row without
    response tokens counts as 1 token (nothing reads its values; it keeps a place in its batch)."""
    positions = torch.arange(loss_mask.shape[1], device=loss_mask.device)
    last = torch.where(loss_mask > 0, positions, -1).amax(-1)  # -1: no response token
    return (last + 2).clamp(min=1)


def token_budget_groups(lengths: list[int], max_tokens: int, max_rows: int, multiple: int = 1) -> list[list[int]]:
    """Row indices of each micro-batch: rows longest first (ties in batch order), each micro-batch
    the longest run of them with rows x round_up(longest, multiple) <= ``max_tokens`` and at most
    ``max_rows`` rows. Greedy on the sorted rows gives the fewest micro-batches of any cut into
    runs; the longest rows come first, so a budget too large for the device fails at once. A row
    longer than the budget alone forms a micro-batch."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups:
            group = groups[-1]
            width = round_up(lengths[group[0]], multiple)  # the run's longest row comes first
            if len(group) < max_rows and (len(group) + 1) * width <= max_tokens:
                group.append(i)
                continue
        groups.append([i])
    return groups


@dataclass
class ModelInput:
    """What the model reads for one micro-batch of b rows of width S, and where its logits are
    wanted: at the n positions that predict a response token (``loss_mask`` 1), the only ones a
    loss reads. The output layer runs there alone (megadiv.models.output.logits_at).

    Padded: ``tokens`` [b, w], the rows cut (or padded) to width w, a multiple of the sequence
    multiple; positions 0..w-1 in every row. Packed (THD): ``tokens`` [1, T], the rows' real
    tokens one after another (T rounded up to the multiple by extending the last row: causal
    attention keeps its real positions as they were); positions restart at 0 in every row.

    The n positions, row by row: ``row_of``, ``col_of`` [n] in the [b, S] rows, ``targets`` [n]
    the tokens they predict, and ``index`` [n] the same positions in the model's hidden states
    flattened from megatron's [s, b, h] layout (padded: t * b + row; packed: the row's offset + t).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    rows: int                                 # b
    width: int                                # S: the rows' width in the batch
    index: torch.Tensor
    row_of: torch.Tensor
    col_of: torch.Tensor
    targets: torch.Tensor
    packed_seq_params: object | None = None   # megatron PackedSeqParams (THD) or None

    @classmethod
    def padded(cls, mb: "SequenceBatch", width: int) -> "ModelInput":
        """``mb``'s [b, S] rows fed at width ``width`` (< S drops padding columns, > S adds zeros:
        token 0 at positions no loss reads)."""
        tokens = mb.tokens
        cut = tokens[:, :width]
        cut = torch.nn.functional.pad(cut, (0, width - cut.shape[1])) if cut.shape[1] < width else cut
        positions = torch.arange(width, device=tokens.device).unsqueeze(0).expand_as(cut)
        row_of, col_of = (mb.loss_mask > 0).nonzero(as_tuple=True)
        return cls(tokens=cut, positions=positions, rows=tokens.shape[0], width=tokens.shape[1],
                   index=col_of * tokens.shape[0] + row_of, row_of=row_of, col_of=col_of,
                   targets=tokens[row_of, col_of + 1])

    @classmethod
    def packed(cls, mb: "SequenceBatch", multiple: int = 1) -> "ModelInput":
        """``mb``'s [b, S] rows, each of its real tokens (row_lengths), packed into [1, T] for
        Transformer Engine's THD attention (megatron's PackedSeqParams with cumulative lengths)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        tokens, lengths = mb.tokens, row_lengths(mb.loss_mask)
        real = int(lengths.sum())
        total = round_up(real, multiple)
        keep = torch.arange(tokens.shape[1], device=tokens.device) < lengths[:, None]  # [b, S]
        row_of, col_of = keep.nonzero(as_tuple=True)  # row-major: row 0's tokens, then row 1's, ...
        flat = torch.zeros(total, dtype=tokens.dtype, device=tokens.device)
        flat[:real] = tokens[row_of, col_of]
        positions = torch.zeros(total, dtype=torch.long, device=tokens.device)
        positions[:real] = col_of
        seq_lens = lengths.clone()
        seq_lens[-1] += total - real  # the rounding pads the last row
        positions[real:] = torch.arange(int(lengths[-1]), int(seq_lens[-1]), device=tokens.device)
        cu_seqlens = torch.nn.functional.pad(seq_lens.cumsum(0), (1, 0))  # [b + 1]
        max_len = int(seq_lens.max())
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens.to(torch.int32),
                                 cu_seqlens_kv=cu_seqlens.to(torch.int32), max_seqlen_q=max_len, max_seqlen_kv=max_len)
        row_of, col_of = (mb.loss_mask > 0).nonzero(as_tuple=True)
        return cls(tokens=flat[None], positions=positions[None], rows=tokens.shape[0], width=tokens.shape[1],
                   index=cu_seqlens[row_of] + col_of, row_of=row_of, col_of=col_of,
                   targets=tokens[row_of, col_of + 1], packed_seq_params=params)

    def to_rows(self, values: torch.Tensor) -> torch.Tensor:
        """Values at the n positions ([n], or [1, n] as the logits come) -> [b, S] rows, zeros at
        every other position; differentiable."""
        rows = values.new_zeros(self.rows, self.width)
        return rows.index_put((self.row_of, self.col_of), values.reshape(-1))


def padding_experts(rows: int, width: int, layers: int, k: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[rows, width, layers, k] experts 0..k-1 (a view): the routing of positions no row holds, k
    distinct experts as megatron's dispatcher needs; no loss reads them."""
    return torch.arange(k, dtype=dtype, device=device).expand(rows, width, layers, k)


@dataclass
class SequenceBatch:
    """Rows for one forward pass or optimizer step; every tensor is [B, S] unless noted."""

    tokens: torch.Tensor                    # int64, prompt + response, right-padded
    loss_mask: torch.Tensor                 # float, 1 where position t predicts a response token
    advantages: torch.Tensor | None = None  # [B]
    logp_old: torch.Tensor | None = None
    logp_ref: torch.Tensor | None = None
    logp_rollout: torch.Tensor | None = None
    routing: torch.Tensor | None = None     # [B, S, MoE layers, k] int16: recorded experts (routing_replay.py)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def rows(self, index) -> "SequenceBatch":
        return SequenceBatch(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[index]
                                for f in fields(self)})

    def split(self, parts: int) -> list["SequenceBatch"]:
        """``parts`` equal consecutive slices; an uneven split is an error, never a dropped row."""
        if len(self) % parts:
            raise ValueError(f"{len(self)} rows do not split into {parts} equal parts")
        size = len(self) // parts
        return [self.rows(slice(i, i + size)) for i in range(0, len(self), size)]

    def micro_batches(self, size: int) -> list["SequenceBatch"]:
        if len(self) % size:
            raise ValueError(f"{len(self)} rows do not split into micro-batches of {size}")
        return self.split(len(self) // size)

    def by_token_budget(self, max_tokens: int, max_rows: int, multiple: int = 1
                        ) -> tuple[list["SequenceBatch"], torch.Tensor]:
        """Micro-batches of at most ``max_tokens`` padded tokens (rows x longest row rounded up to
        ``multiple``) and ``max_rows`` rows, rows longest first (token_budget_groups), each still
        [b, S]: the policy feeds it at its own width. Also the row order: the micro-batches
        concatenated are ``self.rows(order)``."""
        groups = token_budget_groups(row_lengths(self.loss_mask).tolist(), max_tokens, max_rows, multiple)
        host = torch.device("cpu")  # row indices: they index host and device fields alike
        return ([self.rows(torch.tensor(g, device=host)) for g in groups],
                torch.tensor([i for g in groups for i in g], device=host))

    def to(self, device: torch.device) -> "SequenceBatch":
        return SequenceBatch(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                                for f in fields(self)})

    @classmethod
    def pack(cls, prompts: list[list[int]], responses: list[list[int]], pad_id: int,
             response_values: list[list[float]] | None = None, routing: list[torch.Tensor] | None = None,
             **fields) -> "SequenceBatch":
        """Right-padded rows prompt + response; ``loss_mask`` (and ``logp_rollout`` from
        ``response_values``) sit on the positions that predict response tokens (prompts are never
        empty). ``routing``: per row the experts of its first positions [n, layers, k] (an engine's:
        Completion.routing), the rest of the row experts 0..k-1 as routing_replay.py pads. Built in
        host memory, in one pass: a boolean mask assignment fills a mask's positions in row-major
        order, which is the order of the concatenated rows; the policy moves each micro-batch to
        the model's device."""
        host = torch.device("cpu")
        prompt_len = torch.tensor([len(p) for p in prompts], device=host)
        response_len = torch.tensor([len(r) for r in responses], device=host)
        seq_len = int((prompt_len + response_len).max())
        columns = torch.arange(seq_len, device=host)[None]
        tokens = torch.full((len(prompts), seq_len), pad_id, dtype=torch.long, device=host)
        tokens[columns < (prompt_len + response_len)[:, None]] = torch.tensor(
            [t for p, r in zip(prompts, responses) for t in (*p, *r)], dtype=torch.long, device=host)
        start = (prompt_len - 1)[:, None]  # the last prompt position predicts the first response token
        predicts = (columns >= start) & (columns < start + response_len[:, None])
        mask = predicts.float()
        values = None
        if response_values is not None:
            values = torch.zeros(len(prompts), seq_len, device=host)
            values[predicts] = torch.tensor([v for row in response_values for v in row], dtype=torch.float32,
                                            device=host)
        if routing is not None:
            layers, k = routing[0].shape[1:]
            fields["routing"] = padding_experts(len(prompts), seq_len, layers, k, torch.int16, host).clone()
            for row, chosen in zip(fields["routing"], routing):
                row[:len(chosen)] = chosen
        return cls(tokens=tokens, loss_mask=mask, logp_rollout=values, **fields)
