"""The algorithm registries: pure tensor functions, one signature per registry, and their needs.

    ADVANTAGE_FNS[name](batch, cfg) -> advantages [N, T]
    POLICY_LOSS_FNS[name](logp, batch, cfg) -> (loss [N, T], metrics)
    KL_FNS[name](logp, ref_logp) -> kl [N, T]
    agg_loss(loss, mask, mode, num_seqs, num_tokens, max_len) -> scalar

Each entry says what the function needs besides the batch (`Needs`: a frozen reference model, a
critic, whole groups of rollouts, preference pairs from a dataset). The plan checks a config
against them and the trainer builds what they ask for; nothing else branches on algorithm names.

This module imports no torch: the tables below name where each function lives, and a function is
imported when it is first looked up, so planning a run (and `dry_run`) stays light.

To add an algorithm: write the function, add a line to the table, add a
`conf/algorithm/<name>.yaml`, and a test with hand-computed values. To try one without touching
the package, give a dotted path instead of a name (`algorithm.policy_loss_fn=my_study.losses.fn`)
and declare its needs on it with the `needs` decorator:

    from rft.algorithms import needs

    @needs(reference=True)
    def my_loss(logp, batch, cfg): ...   # batch["ref_logp"] is filled

A function's own settings are keyword parameters after the fixed ones, given in algorithm.args
(the policy loss) or algorithm.advantage_args (the advantage function), checked when planning:

    def my_loss(logp, batch, cfg, beta: float = 0.5): ...   # +algorithm.args.beta=0.1
"""

from __future__ import annotations

from dataclasses import dataclass

from rft.config import AGG_MODES, near_args
from rft.errors import ConfigError
from rft.registry import Registry


@dataclass(frozen=True)
class Needs:
    # batch["ref_logp"]: log-probs of the frozen starting model (DPO, a KL term)
    reference: bool = False
    # batch["values"]: a value model trained beside the policy (PPO's GAE)
    critic: bool = False
    # compares the rollouts of one task: algorithm.repeat_times >= 2 and whole groups per step
    grouped: bool = False
    # rows 2k, 2k+1 are a preference pair (chosen, rejected) read from a dataset
    paired: bool = False
    # (a loss's declaration, not a need) each token's loss is its advantage times a finite term:
    # a row whose advantages are all 0 adds nothing to the loss or the gradient, whatever its
    # ratio, so an update may skip it (its ratio metrics are then over the other rows)
    # (trainer.skip_zero_advantage)
    zero_at_zero_advantage: bool = False
    # (a loss's declaration) it imitates given tokens (SFT's responses, DPO's pairs) rather than
    # weighting sampled ones by an advantage: algorithm.rollout_is never weights it
    imitation: bool = False
    # batch["teacher_logp"]: log-probs of algorithm.teacher_model_path's model on the batch's own
    # token ids (on-policy distillation: algorithm.distill_coef, rft/algorithms/distill.py)
    teacher: bool = False
    # the trained model is a reward model: the causal LM's body with a one-output head
    # (AutoModelForSequenceClassification, num_labels=1), and the loss's `logp` holds each row's
    # score at its last response token, 0 elsewhere (algorithm=rm: rft/algorithms/losses.py bradley_terry_loss)
    reward_head: bool = False


def needs(**kwargs):
    """Declare what a function given as a dotted path needs (see Needs)."""
    spec = Needs(**kwargs)

    def mark(fn):
        fn.needs = spec
        return fn

    return mark


_ADV = "rft.algorithms.advantages."
ADVANTAGE_FNS = Registry("algorithm.advantage_fn", info="needs", default=Needs(), foreign={
    "ppo": "Trinity-RFT's ppo advantage (GAE with a critic) is gae here: algorithm=ppo sets it with its critic.",
}, table={
    "grpo": (_ADV + "grpo_advantage", Needs(grouped=True)),
    "dr_grpo": (_ADV + "dr_grpo_advantage", Needs(grouped=True)),
    "rloo": (_ADV + "rloo_advantage", Needs(grouped=True)),
    "opmd": (_ADV + "opmd_advantage", Needs(grouped=True)),
    "reinforce_pp": (_ADV + "reinforce_pp_advantage", Needs()),
    "reinforce_pp_baseline": (_ADV + "reinforce_pp_baseline_advantage", Needs(grouped=True)),
    "gae": (_ADV + "gae_advantage", Needs(critic=True)),
    "none": (_ADV + "no_advantage", Needs()),
})

_LOSS = "rft.algorithms.losses."
POLICY_LOSS_FNS = Registry("algorithm.policy_loss_fn", info="needs", default=Needs(), foreign={
    "ppo": "Trinity-RFT's ppo policy loss is ppo_clip here.",
}, table={
    "ppo_clip": (_LOSS + "ppo_clip_loss", Needs(zero_at_zero_advantage=True)),
    "gspo": (_LOSS + "gspo_loss", Needs(zero_at_zero_advantage=True)),
    "gmpo": (_LOSS + "gmpo_loss", Needs(zero_at_zero_advantage=True)),
    "cpgd": (_LOSS + "cpgd_loss", Needs(zero_at_zero_advantage=True)),
    "opmd": (_LOSS + "opmd_loss", Needs(zero_at_zero_advantage=True)),
    "sft": (_LOSS + "sft_loss", Needs(imitation=True)),
    "dpo": (_LOSS + "dpo_loss", Needs(reference=True, paired=True, imitation=True)),
    "bradley_terry": (_LOSS + "bradley_terry_loss", Needs(paired=True, imitation=True, reward_head=True)),
})

_KL = "rft.algorithms.kl."
# every KL function needs the reference model: the config's "none" turns the term off
KL_FNS = Registry("algorithm.kl_loss_fn", info="needs", default=Needs(), table={
    name: (_KL + fn, Needs(reference=True))
    for name, fn in [("k1", "k1"), ("kl", "k1"), ("k2", "k2"), ("mse", "k2"), ("k3", "k3"),
                     ("low_var_kl", "k3"), ("abs", "abs_kl")]
})



def __getattr__(name: str):
    # agg_loss is a torch function: imported when asked for, not with the registries
    if name == "agg_loss":
        from rft.algorithms.aggregation import agg_loss

        return agg_loss
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# the positional parameters each registry's functions are called with; their own settings follow
# as keywords (algorithm.args, algorithm.advantage_args)
CALLED_WITH = {"algorithm.advantage_fn": ("batch", "cfg"), "algorithm.policy_loss_fn": ("logp", "batch", "cfg")}


def with_args(registry: Registry, name: str, args, args_key: str):
    """The function `name` of `registry` with its own settings bound: `args` (the config's
    `args_key`) as keywords; check_args has said they fit."""
    import functools

    args = dict(args or {})
    fn = check_args(registry, name, args, args_key) or registry[name]
    return functools.partial(fn, **args) if args else fn


def check_args(registry: Registry, name: str, args, args_key: str):
    """`args` (the config's `args_key`) fit the function `name` of `registry`: a key it does not
    take, or a setting without a default left out, is a ConfigError naming `args_key` (checked when
    planning, so a run never starts with it). Returns the function, imported to read its signature;
    None for a registered function given no args (nothing to check, and nothing imported: planning
    stays free of torch)."""
    import inspect

    from rft.registry import resolve

    args = dict(args or {})
    if name in registry and not args:
        return None
    fn = resolve(registry, name, registry.key)
    fixed = CALLED_WITH[registry.key]
    try:  # the fixed parameters first: fn(batch) given a setting was told it "does not take" the setting
        inspect.signature(fn).bind_partial(*fixed)
    except TypeError as e:
        raise ConfigError(f"{registry.key}={name} cannot be called as fn({', '.join(fixed)}, **{args_key}): {e}. "
                          f"Give it the signature of the registry's functions (rft/algorithms/__init__.py).") from None
    own = list(inspect.signature(fn).parameters.values())[len(fixed):]
    known = [p.name for p in own if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = sorted(set(args) - set(known))
    if unknown and not any(p.kind is p.VAR_KEYWORD for p in own):
        raise ConfigError(f"{args_key} has {unknown}, which {registry.key}={name} does not take; its own arguments "
                          f"are {known} (the rest of its settings are the algorithm.* keys it reads from cfg)."
                          f"{near_args(unknown, known, section=args_key.rpartition('.')[0])}")
    missing = [p.name for p in own if p.name in known and p.default is p.empty and p.name not in args]
    if missing:
        raise ConfigError(f"{registry.key}={name} needs {missing} in {args_key}, which has no default: set "
                          f"+{args_key}.{missing[0]}=<value>.")
    try:
        inspect.signature(fn).bind(*fixed, **args)
    except TypeError as e:
        raise ConfigError(f"{registry.key}={name} cannot be called as fn({', '.join(fixed)}, **{args_key}): {e}. "
                          f"Give it the signature of the registry's functions (rft/algorithms/__init__.py).") from None
    return fn


def algorithm_needs(algo) -> Needs:
    """What an algorithm config needs, over all its functions (advantage, loss, KL terms)."""
    parts = [ADVANTAGE_FNS.info(algo.advantage_fn), POLICY_LOSS_FNS.info(algo.policy_loss_fn)]
    parts += [KL_FNS.info(name) for name in (algo.kl_loss_fn, algo.kl_penalty_fn) if name != "none"]
    # the distillation term is a config switch, not a function of the tables
    parts += [Needs(teacher=True)] if getattr(algo, "distill_coef", 0) else []
    return Needs(**{f: any(getattr(p, f) for p in parts) for f in Needs.__dataclass_fields__})


__all__ = ["ADVANTAGE_FNS", "AGG_MODES", "KL_FNS", "POLICY_LOSS_FNS", "Needs", "agg_loss", "algorithm_needs", "needs",
           "check_args", "with_args"]
