"""A new user who comes from LightRFT / OpenRLHF and verl (experiments/from_lightrft/): the LightRFT
FAQ's GRPO flags translated into rft's keys, then the flags and habits such a user brings. Each test
is a defect that study met."""

import pytest
from conftest import compose_cfg
from test_foreign_keys import flag_refusal

from rft.foreign_keys import foreign_key
from rft.reporting.monitor import WandB

_FLAG = "rft takes key=value overrides, not flags; that is OpenRLHF's key, not rft's; "


# ---------------------------------------------------------------- OpenRLHF's flags

@pytest.mark.parametrize("args, message", [
    # the README says --async_train is sync_offset=1; the flag itself was Hydra's "unrecognized arguments"
    (["--async_train", "seed=1"],
     "--async_train: " + _FLAG + "rft's is synchronizer.sync_offset. Training one step behind generation is "
     "synchronizer.sync_offset=1, which the default (null) already is where the explorer and the trainer have "
     "resources of their own; OpenRLHF's synchronous default is synchronizer.sync_offset=0. The dry run's explorer "
     "line says which a run gets."),
    # clip-higher: two values, two keys
    (["--eps_clip_low_high", "0.2", "0.28"],
     "--eps_clip_low_high 0.2: " + _FLAG + "rft's are algorithm.clip_ratio_low and algorithm.clip_ratio_high. Its "
     "two values are the two keys': --eps_clip_low_high 0.2 0.28 (clip-higher) is algorithm.clip_ratio_low=0.2 "
     "algorithm.clip_ratio_high=0.28, which algorithm=dapo sets."),
    # a remote reward model: rft's remote part speaks to its own server
    (["--remote_rm_url", "http://rm:5000/get_reward"],
     "--remote_rm_url http://rm:5000/get_reward: " + _FLAG + "rft's is buffer.explorer_input.taskset.reward_fn. "
     "A reward part {fn: remote, args: {url: ...}} in the reward_fn list, which speaks to rft's own reward server "
     "(rft/serving/reward_server.py, POST /score), not to OpenRLHF's; README, \"Rewards served by a model "
     "or a server\"."),
    # the data flags: the first one is told
    (["--prompt_data", "data/train.jsonl", "--input_key", "question"],
     "--prompt_data data/train.jsonl: " + _FLAG + "rft's is buffer.explorer_input.taskset.path. A JSONL, Parquet "
     "or CSV file, a folder of them or a Hugging Face dataset id."),
    # an eval default that differs: greedy here, 0.6 there
    (["--eval_temperature", "0.6"],
     "--eval_temperature 0.6: " + _FLAG + "rft's is buffer.explorer_input.eval_tasksets. Each eval taskset's "
     "rollout_args.temperature: 0 (greedy) by default here, OpenRLHF's 0.6; its repeat_times is OpenRLHF's "
     "--eval_n_samples_per_prompt (1 here, 4 there)."),
    # GSPO: the same loss, the paper's clip here, OpenRLHF's --eps_clip there (its loss.py PolicyLoss)
    (["--policy_loss_type", "gspo"],
     "--policy_loss_type gspo: " + _FLAG + "rft's is algorithm=gspo. The loss comes with its algorithm's file here: "
     "algorithm=gspo also sets loss_agg_mode=seq-mean-token-mean and the paper's clip bounds on the sequence's ratio, "
     "3e-4 and 4e-4, where OpenRLHF clips it at --eps_clip (0.2): algorithm.clip_ratio_low=0.2 "
     "algorithm.clip_ratio_high=0.2 for OpenRLHF's. ppo is the other files' ppo_clip."),
    (["--vllm_num_engines", "4"],
     "--vllm_num_engines 4: " + _FLAG + "rft's is explorer.rollout_model.engine_num. With explorer=vllm on GPUs."),
])
def test_openrlhfs_flags_name_rfts_keys(capsys, args, message):
    # before, foreign_flag left them to Hydra: "run.py: error: unrecognized arguments: --async_train"
    assert flag_refusal(capsys, args) == (message, 2, f"\nrft: configuration error: {message}\n\n")


def test_the_eval_defaults_the_flag_names_are_rfts():
    # the message's "0 (greedy) by default here" and "1 here": the arithmetic task's eval set as composed
    (eval_set,) = compose_cfg([]).buffer.explorer_input.eval_tasksets
    assert eval_set.rollout_args.temperature == 0
    assert eval_set.repeat_times in (None, 1)  # null: 1 for an eval set (rft/config.py)


# ---------------------------------------------------------------- a PPO clip is not gspo's or gmpo's

@pytest.mark.parametrize("key", ["eps_clip", "actor_rollout_ref.actor.clip_ratio", "pg_clip"])
def test_the_clip_translation_says_gspo_and_gmpo_bound_another_quantity(key):
    # LightRFT's --eps_clip 0.2 as clip_ratio_low/high=0.2 under algorithm=gspo widens its clip
    # 0.2 / 3e-4 = 667 times, silently: the message now says so, with the files' own values
    said = foreign_key(key)
    assert "algorithm=gspo, whose bounds are the sequence's ratio's (3e-4 and 4e-4 there)" in said
    assert "algorithm=gmpo, whose are the log-ratio's (0.4 there)" in said
    gspo = compose_cfg(["algorithm=gspo"]).algorithm
    gmpo = compose_cfg(["algorithm=gmpo"]).algorithm
    assert (gspo.clip_ratio_low, gspo.clip_ratio_high) == (3e-4, 4e-4)
    assert (gmpo.clip_ratio_low, gmpo.clip_ratio_high) == (0.4, 0.4)


# ---------------------------------------------------------------- wandb behind a proxy

def test_a_proxy_for_wandb_alone_is_wandbs_own_variable():
    # verl's +trainer.wandb_proxy exists so that other HTTP requests do not go through the proxy; rft
    # said "set a proxy in the environment", i.e. HTTPS_PROXY, which the remote reward's and the
    # judge's httpx clients read too. wandb reads WANDB_HTTPS_PROXY into its own https_proxy setting.
    wandb = pytest.importorskip("wandb")
    said = foreign_key("trainer.wandb_proxy")
    assert said.endswith("rft has no counterpart: set WANDB_HTTPS_PROXY (and WANDB_HTTP_PROXY) in the environment "
                         "run.py starts from: wandb alone uses it, as verl's key, where HTTPS_PROXY would also send "
                         "a judge's and a remote reward's requests through the proxy.")
    assert "WANDB_HTTPS_PROXY sets a proxy for wandb alone" in WandB.fix
    settings = wandb.Settings()
    settings.update_from_env_vars({"WANDB_HTTPS_PROXY": "http://proxy:3128"})
    assert settings.https_proxy == "http://proxy:3128"


# ---------------------------------------------------------------- vLLM's knobs under the hf engine

def engine_warnings(caplog, overrides: list[str]) -> list[str]:
    """What planning the one stage of `overrides` over 64 tasks warned of vLLM's keys."""
    from rft.plan.batch import make_plan, stage_configs

    caplog.clear()
    with caplog.at_level("WARNING", logger="rft.plan.ranges"):
        make_plan(stage_configs(compose_cfg(["stages=[]", *overrides]))[0], 64)
    return [r.getMessage() for r in caplog.records if "vLLM engine" in r.getMessage()]


def test_vllms_knobs_under_the_hf_engine_are_said_to_do_nothing(caplog):
    # LightRFT's --engine_mem_util 0.4 is gpu_memory_utilization=0.4 (rft/foreign_keys.py); under the
    # CPU default's hf engine it was accepted and read by nothing, exit 0
    assert engine_warnings(caplog, ["explorer.rollout_model.gpu_memory_utilization=0.4"]) == [
        "explorer.rollout_model.gpu_memory_utilization=0.4: it has no effect, as only the vLLM engine reads it and "
        "this stage's engine is explorer.rollout_model.engine_type=hf (transformers' generate). Use explorer=vllm, or "
        "leave it out."]
    assert engine_warnings(caplog, ["explorer.rollout_model.enforce_eager=false",
                                    "explorer.rollout_model.enable_prefix_caching=true"]) == [
        "explorer.rollout_model.enable_prefix_caching=True, enforce_eager=False: they have no effect, as only the vLLM "
        "engine reads them and this stage's engine is explorer.rollout_model.engine_type=hf (transformers' generate). "
        "Use explorer=vllm, or leave them out."]
    # the defaults, an hf key, and vLLM reading its own: nothing said
    assert engine_warnings(caplog, []) == []
    assert engine_warnings(caplog, ["explorer.rollout_model.generate_batch_size=8"]) == []
    assert engine_warnings(caplog, ["explorer=vllm", "explorer.rollout_model.gpu_memory_utilization=0.4"]) == []
