"""On-policy distillation: a teacher's log-probs on the student's own samples as a per-token signal.

The student samples a response; the teacher reads exactly those token ids (the trainer's batch,
never a re-tokenisation of the text) and gives log p_teacher(y_t | y_<t) for each. The per-token
reverse KL estimate of KL(student || teacher) on the sampled token is

    k_t = log p_student(y_t | y_<t) - log p_teacher(y_t | y_<t)

and its negative is the token's advantage (Agarwal et al., arXiv 2306.13649, with the reverse KL;
the recipe of Thinking Machines' "On-Policy Distillation", 2025): a token the teacher finds more
likely than the student does is pushed up, one it finds less likely is pushed down. Minimising the
expected k_t over the student's own samples minimises the reverse KL, which is mode-seeking: the
student is taught where it actually goes, the teacher's dense per-token grade replacing one sparse
reward per response.

The student's log-probs are the trainer's of the current weights before the update ("old"), so the
signal is on-policy whatever the engine's kernels; both sides are taken under the distribution each
row was sampled from (its temperature and truncation: rft.trainer.logprobs).

`algorithm.distill_divergence=jsd` is GKD's generalised Jensen-Shannon divergence instead (Agarwal
et al., section 3), a loss term on whole next-token distributions rather than an advantage on the
sampled token: with the teacher P, the student Q and M = beta P + (1 - beta) Q,

    JSD_beta(P, Q) = beta KL(P || M) + (1 - beta) KL(Q || M)

at each response position of the student's own samples, differentiated through Q. The vocabulary
is too large to keep the teacher's whole distribution per position, so both are taken on the
teacher's `distill_top_k` most likely tokens plus one bucket holding the rest of the mass (a
coarser partition, so the value is at most the full JSD, and equal to it when the tokens outside
the top k have the same teacher / student ratio). beta = 0 and beta = 1 are the limits of
JSD_beta / beta and JSD_beta / (1 - beta): the forward KL(P || Q) and the reverse KL(Q || P). Both
distributions are the temperature-scaled ones, before any top-k / top-p cut.
"""

from __future__ import annotations

import math

import torch


def distill_advantage(teacher_logp: torch.Tensor, student_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """-(log p_student - log p_teacher) on the tokens of `mask` (the sampled ones the loss counts),
    0 elsewhere; no gradient. All [N, T]."""
    return ((teacher_logp - student_logp) * mask).detach()


def reverse_kl(teacher_logp: torch.Tensor, student_logp: torch.Tensor, mask: torch.Tensor) -> float:
    """The per-token reverse KL estimate, averaged over the tokens of `mask` (0 without any)."""
    n = mask.sum()
    return (((student_logp - teacher_logp) * mask).sum() / n).item() if n > 0 else 0.0


def _rest(logp: torch.Tensor) -> torch.Tensor:
    """log(1 - sum exp(logp)) over the last dim: the log of the mass outside the given tokens.
    Kept at >= 1e-7 of the mass (float32 cannot tell a smaller remainder from rounding); the
    gradient then stops, as the bucket adds nothing that size."""
    inside = torch.logsumexp(logp, dim=-1, keepdim=True).clamp(max=-1e-7)
    return torch.log(-torch.expm1(inside))


def generalized_jsd(teacher_top: torch.Tensor, student_at: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-position JSD_beta between the teacher and the student on the teacher's top tokens plus
    a bucket for the rest (module doc): `teacher_top` [..., k] the teacher's log-probs of its k
    most likely tokens, `student_at` [..., k] the student's log-probs of the same tokens (with
    gradient). Returns [...], no mask applied."""
    dtype = torch.promote_types(torch.promote_types(teacher_top.dtype, student_at.dtype), torch.float32)
    teacher_top, student_at = teacher_top.to(dtype), student_at.to(dtype)
    p = torch.cat([teacher_top, _rest(teacher_top)], dim=-1)
    q = torch.cat([student_at, _rest(student_at)], dim=-1)
    if beta == 0.0:  # forward KL(P || Q)
        return (p.exp() * (p - q)).sum(-1)
    if beta == 1.0:  # reverse KL(Q || P)
        return (q.exp() * (q - p)).sum(-1)
    # log M = log(beta e^p + (1 - beta) e^q), without leaving log space
    m = torch.logaddexp(p + math.log(beta), q + math.log(1.0 - beta))
    return beta * (p.exp() * (p - m)).sum(-1) + (1.0 - beta) * (q.exp() * (q - m)).sum(-1)
