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
the top k have the same teacher / student ratio). Each side's bucket is a logsumexp over its other
tokens (rft.trainer.logprobs), not 1 - the top's mass: that difference is rounding below ~1e-7 in
float32, the usual remainder of a confident model, and a student collapsed on the top tokens then
lost the forward KL's pull back towards the rest (half its value and 1e-5 of its gradient there).
beta = 0 and beta = 1 are the limits of JSD_beta / beta and JSD_beta / (1 - beta): the forward
KL(P || Q) and the reverse KL(Q || P). Both distributions are the temperature-scaled ones, before
any top-k / top-p cut. A token of probability 0 on one side (a log-prob of -inf) adds 0 log 0 = 0.
"""

from __future__ import annotations

import math

import torch

from rft.algorithms.aggregation import masked


def distill_advantage(teacher_logp: torch.Tensor, student_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """-(log p_student - log p_teacher) on the tokens of `mask` (the sampled ones the loss counts),
    0 elsewhere (whatever they hold there); no gradient. All [N, T]."""
    return masked(teacher_logp - student_logp, mask).detach()


def reverse_kl(teacher_logp: torch.Tensor, student_logp: torch.Tensor, mask: torch.Tensor) -> float:
    """The per-token reverse KL estimate, averaged over the tokens of `mask` (0 without any)."""
    n = mask.sum()
    return (masked(student_logp - teacher_logp, mask).sum() / n).item() if n > 0 else 0.0


def _rest(logp: torch.Tensor) -> torch.Tensor:
    """log(1 - sum exp(logp)) over the last dim: the log of the mass outside the given tokens, for a
    caller that has only theirs (token_logprobs gives the exact one). Kept at >= 1e-7 of the mass
    (float32 cannot tell a smaller remainder from rounding); the gradient then stops."""
    inside = torch.logsumexp(logp, dim=-1, keepdim=True).clamp(max=-1e-7)
    return torch.log(-torch.expm1(inside))


def _kl_terms(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum e^a (a - b) over the last dim, with 0 log 0 = 0: a bucket of probability 0 under `a` (a
    log-prob of -inf) adds 0, where e^a (a - b) is 0 x -inf = NaN (in the gradient too)."""
    live = a != float("-inf")  # (a NaN stays live: it must show in the loss, not vanish)
    a_safe = torch.where(live, a, torch.zeros_like(a))
    return torch.where(live, a_safe.exp() * (a_safe - b), torch.zeros_like(a)).sum(-1)


def generalized_jsd(teacher_top: torch.Tensor, student_at: torch.Tensor, beta: float,
                    rest: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Per-position JSD_beta between the teacher and the student on the teacher's top tokens plus
    a bucket for the rest (module doc): `teacher_top` [..., k] the teacher's log-probs of its k
    most likely tokens, `student_at` [..., k] the student's log-probs of the same tokens (with
    gradient), `rest` ([..., 1] each) the log of the mass outside them for the teacher and the
    student (token_logprobs' top_rest and at_rest; None: from the k log-probs, to 1e-7 of the
    mass). Returns [...], no mask applied."""
    dtype = torch.promote_types(torch.promote_types(teacher_top.dtype, student_at.dtype), torch.float32)
    teacher_top, student_at = teacher_top.to(dtype), student_at.to(dtype)
    p_rest, q_rest = (_rest(teacher_top), _rest(student_at)) if rest is None else (r.to(dtype) for r in rest)
    p = torch.cat([teacher_top, p_rest], dim=-1)
    q = torch.cat([student_at, q_rest], dim=-1)
    if beta == 0.0:  # forward KL(P || Q)
        return _kl_terms(p, q)
    if beta == 1.0:  # reverse KL(Q || P)
        return _kl_terms(q, p)
    # log M = log(beta e^p + (1 - beta) e^q), without leaving log space. Where both are -inf, M is
    # 0 too and neither term reads it: a 0 there keeps logaddexp's gradient of (-inf, -inf), NaN, out
    neither = (p == float("-inf")) & (q == float("-inf"))
    p_m, q_m = (torch.where(neither, torch.zeros_like(x), x) for x in (p, q))
    m = torch.logaddexp(p_m + math.log(beta), q_m + math.log(1.0 - beta))
    return beta * _kl_terms(p, m) + (1.0 - beta) * _kl_terms(q, m)
