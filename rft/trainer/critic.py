"""The critic for PPO: a value head on a transformer, its optimizer, and its clipped value loss."""

from __future__ import annotations

import logging

import torch

from rft.algorithms import agg_loss

log = logging.getLogger(__name__)


class ValueModel(torch.nn.Module):
    """The base transformer of a causal LM checkpoint with a linear value head.

    values[:, t] estimates the return from target position t (after reading tokens 0..t), so it
    lines up with the actor's log-probs of token t + 1.
    """

    def __init__(self, path: str, dtype: torch.dtype, trust_remote_code: bool, weights: bool = True):
        from transformers import AutoConfig, AutoModel
        from transformers.initialization import no_init_weights

        super().__init__()
        if weights:
            self.base = AutoModel.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
        else:  # the architecture alone (config.json), its weights uninitialised: a resumed critic's
            # come from the checkpoint (Critic.load_state_dict), so the starting ones are never read
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
            with no_init_weights():
                self.base = AutoModel.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
            self.base.eval()  # as from_pretrained leaves it
        self.head = torch.nn.Linear(self.base.config.hidden_size, 1, dtype=dtype)
        # a zero head starts every value at 0: the first advantages are the whitened returns
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids, attention_mask):
        hidden = self.base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        # float32 whatever the model's dtype, and a tensor of its own, not a view of the head's output:
        # FSDP2 warns at a view that an in-place op on it would skip its pre-backward hook (wrong gradients)
        return self.head(hidden[:, :-1]).squeeze(-1).to(torch.float32, copy=True)


class Critic:
    """The value model and its optimizer. It trains on the micro-batches the trainer gives it, as
    (first row, end row, live): a data-parallel rank's share (trainer=fsdp2, the model sharded by
    `wrap` like the actor), with dead passes weighted 0 so every rank runs as many."""

    def __init__(self, cfg, path: str, device="cpu", wrap=None, dtype=None, weights: bool = True):
        """`weights` False: the value model's weights are left uninitialised, for `load_state_dict`
        (a resumed trainer) to fill."""
        from rft.models import torch_dtype

        algo = cfg.algorithm
        self.cfg = cfg
        self.model = ValueModel(path, dtype or torch_dtype(cfg.model.dtype), cfg.model.trust_remote_code,
                                weights).to(device)
        if wrap is not None:
            self.model = wrap(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=algo.critic_lr,
                                           weight_decay=algo.optimizer.weight_decay)

    def values(self, full, micro_batches, all_sum=lambda t: t) -> torch.Tensor:
        """The values of every row: each rank computes its micro-batches' rows, `all_sum` adds up
        the ranks' parts."""
        values = torch.zeros_like(full["response_mask"])
        with torch.no_grad():
            for s, e, live in micro_batches:
                L = _longest(full, s, e)
                v = self.model(full["input_ids"][s:e, :L], full["attention_mask"][s:e, :L])
                if live:
                    values[s:e, : L - 1] = v
        return all_sum(values) * full["response_mask"]

    def update(self, full, returns, old_values, micro_batches, num_tokens: int, loss_scale: int = 1,
               optimizer_step=None) -> dict:
        """One optimizer step on a mini-batch: 0.5 * max((V - R)^2, (V_clipped - R)^2), token-mean
        over the mini-batch's `num_tokens` (a rank's loss is its rows' part, times `loss_scale`,
        the number of ranks, as FSDP averages gradients). The metrics are this rank's part.

        V_clipped = V_old + clip(V - V_old, -value_clip, value_clip) (PPO's value clipping).
        """
        c = self.cfg.algorithm.value_clip
        self.optimizer.zero_grad(set_to_none=True)
        total, clipped = 0.0, 0.0
        for s, e, live in micro_batches:
            L = _longest(full, s, e)
            m = full["response_mask"][s:e, : L - 1] * live
            v = self.model(full["input_ids"][s:e, :L], full["attention_mask"][s:e, :L])
            r, v_old = returns[s:e, : L - 1], old_values[s:e, : L - 1]
            v_clipped = v_old + torch.clamp(v - v_old, -c, c)
            loss1, loss2 = (v - r) ** 2, (v_clipped - r) ** 2
            loss = agg_loss(0.5 * torch.maximum(loss1, loss2), m, "token-mean", e - s, num_tokens, 1)
            (loss * loss_scale).backward()
            total += loss.item()
            clipped += ((loss2 > loss1).float() * m).sum().item()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.trainer.grad_clip)
        if torch.isfinite(norm.full_tensor() if hasattr(norm, "full_tensor") else norm):
            (optimizer_step or (lambda o: o.step()))(self.optimizer)
        else:  # as the policy's (StepMixin._apply): a NaN would reach every weight through Adam
            self.optimizer.zero_grad(set_to_none=True)
            log.warning("critic update skipped: its gradient norm is %s", norm)
        return {"critic/value_loss": total, "critic/vf_clip_tokens": clipped}

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


def _longest(full, s: int, e: int) -> int:
    """The longest row of s..e (the micro-batch is trimmed to it: rows are right-padded)."""
    return int(full["attention_mask"][s:e].sum(-1).max())


def explained_variance(returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over response tokens: 1 is a perfect critic, <= 0 a useless one."""
    r, v = returns[mask.bool()], values[mask.bool()]
    var = r.var()
    return float(1 - (r - v).var() / var) if var > 0 else 0.0
