"""Loss aggregation: the one place that turns a per-token loss into a scalar.

The normalisers (`num_seqs`, `num_tokens`) are those of the whole mini-batch, not of the
micro-batch being computed: summing the micro-batch results then gives exactly the loss (and
gradient) of the whole mini-batch, whatever the micro-batch token counts. Dividing each
micro-batch by its own token count instead is a classic silent bug (micro-batches with few
tokens get too much weight).

Positions outside the mask may hold anything (a row's padding, a multi-turn row's environment
tokens, a log-prob of -inf or NaN there): `masked` selects rather than multiplies, since 0 x inf
and 0 x NaN are NaN, which a sum then spreads over the whole loss and its gradient.
"""

from __future__ import annotations

import torch

from rft.config import AGG_MODES


def masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x where mask is not 0, else 0: whatever x holds there (inf, NaN) reaches neither a sum nor,
    through torch.where's backward, the gradient of what x was computed from."""
    return torch.where(mask != 0, x, 0.0)


def wide(*tensors):
    """The inputs, those in half precision (bfloat16, float16) in float32, with their gradient: a
    loss is computed in float32 or wider, as the advantages are. In float16 exp() overflows past
    a log-ratio of 11.1 (inf, and 0 x inf = NaN for a zero advantage, in the gradient too), and
    bfloat16's 8-bit mantissa puts a ratio of e^0.1 = 1.105 at 1.109 and 1.28 at 1.281, beside the
    clip bounds. (The trainer's log-probs are float32 whatever the model's dtype.)"""
    return [t.float() if t is not None and t.dtype in (torch.float16, torch.bfloat16) else t for t in tensors]


def agg_loss(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    num_seqs: int,
    num_tokens: int,
    max_len: int,
) -> torch.Tensor:
    """Aggregate loss [n, T] under mask [n, T] into this micro-batch's share of the scalar.

    token-mean:              sum(l * m) / num_tokens                        (DAPO)
    seq-mean-token-sum:      sum_i sum_t l_it m_it / num_seqs
    seq-mean-token-mean:     sum_i (sum_t l_it m_it / sum_t m_it) / num_seqs  (original GRPO)
    seq-mean-token-sum-norm: sum(l * m) / (num_seqs * max_len)              (Dr. GRPO)

    A fully masked row contributes 0 in every mode; a masked position, whatever its loss, adds 0.
    """
    loss = masked(loss, mask) * mask
    if mode == "token-mean":
        return loss.sum() / max(num_tokens, 1)
    if mode == "seq-mean-token-sum":
        return loss.sum() / max(num_seqs, 1)
    if mode == "seq-mean-token-mean":
        per_seq = loss.sum(-1) / mask.sum(-1).clamp(min=1)
        return per_seq.sum() / max(num_seqs, 1)
    if mode == "seq-mean-token-sum-norm":
        return loss.sum() / (max(num_seqs, 1) * max_len)
    raise ValueError(f"unknown loss_agg_mode {mode!r}; choose one of {AGG_MODES}")
