"""How the trainer cuts a mini-batch's rows into micro-batches (one forward/backward each), and
into data-parallel ranks' shares. Pure functions of the rows' token counts.

Rows stay in order and each micro-batch is a contiguous range `(s, e)`, so every per-row tensor
of a step is sliced, never gathered. `unit` rows always travel together (2 for DPO's preference
pairs). Which micro-batches a step uses changes no gradient: each micro-batch's loss is
normalised by the whole mini-batch's counts (rft.algorithms.aggregation), and the gradients add up.

- fixed (`trainer.micro_batch_size_per_gpu`): `micro` rows per micro-batch.
- token budget (`trainer.use_dynamic_bsz`, `trainer.max_token_len_per_gpu`): as many rows as fit
  the budget: the sum of the rows' lengths when they are packed (`trainer.use_remove_padding`),
  rows x the longest row when they are padded. A unit
  longer than the budget alone is a micro-batch of its own (never dropped; the plan warns
  when max_model_len exceeds the budget).
"""

from __future__ import annotations

import math


def cost(lengths: list[int], packed: bool) -> int:
    """The tokens a forward over these rows computes."""
    if not lengths:
        return 0
    return sum(lengths) if packed else len(lengths) * max(lengths)


def first_fit(lengths: list[int], capacity: int) -> tuple[list[tuple[int, int]], list[int]]:
    """Sequences into bins of `capacity` tokens, longest first, each into the first bin it fits:
    (bin, offset) of each sequence, and each bin's tokens used."""
    bins, where = [], [(0, 0)] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        b = next((b for b, used in enumerate(bins) if used + lengths[i] <= capacity), len(bins))
        if b == len(bins):
            bins.append(0)
        where[i] = (b, bins[b])
        bins[b] += lengths[i]
    return where, bins


def packed_shape(lengths: list[int], one_row: bool) -> tuple[int, int]:
    """(rows, width) of packed sequences (rft.trainer.logprobs.pack): one row, or rows as wide as the longest."""
    if one_row:
        return 1, sum(lengths)
    _, bins = first_fit(lengths, max(lengths))
    return len(bins), max(bins)


def fixed(start: int, end: int, micro: int) -> list[tuple[int, int]]:
    return [(s, min(s + micro, end)) for s in range(start, end, micro)]


def token_budget(lengths: list[int], start: int, end: int, budget: int, packed: bool,
                 unit: int = 1) -> list[tuple[int, int]]:
    """Rows start..end (of `lengths`, the whole batch's) in contiguous micro-batches of at most
    `budget` tokens each, filled greedily."""
    out, s = [], start
    for u in range(start, end, unit):
        nxt = min(u + unit, end)
        if u > s and cost(lengths[s:nxt], packed) > budget:
            out.append((s, u))
            s = u
    if s < end:
        out.append((s, end))
    return out


def balanced_blocks(lengths: list[int], start: int, end: int, parts: int, unit: int = 1) -> list[tuple[int, int]]:
    """Rows start..end as `parts` contiguous blocks of about equal token counts (whole units;
    a block may be empty: (a, a))."""
    units = list(range(start, end, unit))
    sizes = [sum(lengths[u:min(u + unit, end)]) for u in units]
    total = sum(sizes)
    bounds, acc, k = [start], 0, 1
    for u, size in zip(units, sizes):
        # cut before this unit when it takes the running sum past the k-th share by more than it
        # stays short without it (never before a block's first unit: no empty block ahead of rows)
        while k < parts and u > bounds[-1] and acc + size / 2 > total * k / parts:
            bounds.append(u)
            k += 1
        acc += size
    bounds += [end] * (parts + 1 - len(bounds))
    return [(bounds[i], bounds[i + 1]) for i in range(parts)]


def fixed_share(start: int, end: int, rank: int, world: int, unit: int = 1) -> tuple[int, int]:
    """Rank `rank`'s contiguous block when rows are shared by count: ceil(rows / ranks), whole
    units; the last ranks may get fewer or none."""
    share = math.ceil((end - start) / (world * unit)) * unit
    a = min(start + rank * share, end)
    return a, min(a + share, end)
