"""The algorithm registries: pure tensor functions, one signature per registry.

    ADVANTAGE_FNS[name](batch, cfg) -> advantages [N, T]
    POLICY_LOSS_FNS[name](logp, old_logp, advantages, mask, cfg) -> (loss [N, T], metrics)
    KL_FNS[name](logp, ref_logp) -> kl [N, T]
    agg_loss(loss, mask, mode, num_seqs, num_tokens, max_len) -> scalar

The trainer looks each name up once (`rft.trainer`); nothing else branches on algorithm names.
To add an algorithm: write the function, add it to the dict, add a `conf/algorithm/<name>.yaml`,
and a test with hand-computed values.
"""

from rft.algorithms.advantages import ADVANTAGE_FNS
from rft.algorithms.aggregation import AGG_MODES, agg_loss
from rft.algorithms.kl import KL_FNS
from rft.algorithms.losses import POLICY_LOSS_FNS

__all__ = ["ADVANTAGE_FNS", "AGG_MODES", "KL_FNS", "POLICY_LOSS_FNS", "agg_loss"]
