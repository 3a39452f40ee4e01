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
"""

from __future__ import annotations

import torch


def distill_advantage(teacher_logp: torch.Tensor, student_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """-(log p_student - log p_teacher) on the tokens of `mask` (the sampled ones the loss counts),
    0 elsewhere; no gradient. All [N, T]."""
    return ((teacher_logp - student_logp) * mask).detach()


def reverse_kl(teacher_logp: torch.Tensor, student_logp: torch.Tensor, mask: torch.Tensor) -> float:
    """The per-token reverse KL estimate, averaged over the tokens of `mask` (0 without any)."""
    n = mask.sum()
    return (((student_logp - teacher_logp) * mask).sum() / n).item() if n > 0 else 0.0
