"""Keys of verl, ROLL, LightRFT/OpenRLHF and TRL typed here (rft/foreign_keys.py): one paragraph naming
whose key it is, rft's key or group choice for it and what differs, instead of the nearest of rft's
names; rft's own keys and typos of them as before."""

import re
import shutil

import pytest
import torch
from conftest import CONF
from omegaconf import OmegaConf

from rft.config import Config, key_mistake, schema_keys
from rft.errors import ConfigError
from rft.foreign_keys import FOREIGN_KEYS, FOREIGN_VALUES, ForeignKey, foreign_key
from rft.plan.overlays import check, exit_on_config_mistakes, foreign_flag, misspelt_override

GROUPS = {p.name for p in CONF.iterdir() if p.is_dir()}


@pytest.mark.parametrize("override, message", [
    # verl. Before: "Key 'adv_estimator' not in 'AlgorithmConfig'. Did you mean algorithm.distill_top_k or
    # algorithm.gamma?"
    ("algorithm.adv_estimator=grpo",
     "that is verl's key, not rft's; rft's is algorithm=<name>. The algorithm is a config group here "
     "(conf/algorithm/): verl's grpo is algorithm=grpo, gae algorithm=ppo, rloo algorithm=rloo, reinforce_plus_plus "
     "algorithm=reinforce_pp, reinforce_plus_plus_baseline algorithm=reinforce_pp_baseline."),
    # before: "Key 'actor_rollout_ref' not in 'Config'." and no hint
    ("actor_rollout_ref.rollout.n=8",
     "that is verl's key, not rft's; rft's is algorithm.repeat_times. Responses sampled per prompt."),
    ("data.train_batch_size=64",
     "that is verl's key, not rft's; rft's is buffer.batch_size. Both count prompts (tasks) per step, each sampled "
     "algorithm.repeat_times times; rft's buffer.train_batch_size is the step's experiences (batch_size x "
     "repeat_times)."),
    # the meaning differs: verl counts prompts (it multiplies by rollout.n itself), rft experiences
    ("actor_rollout_ref.actor.ppo_mini_batch_size=16",
     "that is verl's key, not rft's; rft's is trainer.mini_batch_size. Both are global (all ranks) and make one "
     "optimizer step, but verl counts prompts, rft experiences (responses): verl multiplies its value by "
     "actor_rollout_ref.rollout.n itself, so ppo_mini_batch_size=16 with rollout.n=8 is trainer.mini_batch_size=128."),
    ("algorithm.kl_ctrl.kl_coef=0.001",
     "that is verl's key, not rft's; rft's is algorithm.kl_penalty_coef. A fixed coefficient, as verl's "
     "fixed controller."),
    # no counterpart: said so
    ("algorithm.kl_ctrl.type=adaptive",
     "that is verl's key, not rft's, and rft has no counterpart: the reward's KL coefficient is fixed here "
     "(algorithm.kl_penalty_coef); there is no adaptive controller."),
    ("trainer.n_gpus_per_node=8", "that is verl's key, not rft's; rft's is cluster.gpu_per_node."),
    ("ray_init.num_cpus=4", "that is verl's key, not rft's; rft's is cluster.num_cpus. CPUs of the Ray instance rft "
                            "starts itself (not of a running cluster it joins)."),
    # a key of a section of verl's that the table does not list: whose it is, and no guess
    ("actor_rollout_ref.rollout.mode=async",
     "that is verl's key, not rft's, and has no translation here: rft's keys, each with a comment, are in "
     "rft/config.py; `python run.py --cfg job` prints the composed config."),
    # ROLL
    ("num_return_sequences_in_group=8",
     "that is ROLL's key, not rft's; rft's is algorithm.repeat_times. Responses sampled per prompt."),
    ("actor_train.training_args.gradient_accumulation_steps=32",
     "that is ROLL's key, not rft's; rft's is trainer.mini_batch_size. rft sets the experiences per optimizer step "
     "instead, ROLL's global_batch_size: per_device_train_batch_size x gradient_accumulation_steps x data-parallel "
     "ranks."),
    ("dual_clip_loss=true",
     "that is ROLL's key, not rft's; rft's is algorithm.clip_ratio_c. A number here, not a switch: the dual clip's "
     "bound (usually 3.0); null turns it off."),
    # LightRFT/OpenRLHF: the meaning differs, and the nearest of rft's names (buffer.train_batch_size) was wrong
    ("train_batch_size=256",
     "that is LightRFT's and OpenRLHF's key, not rft's; rft's is trainer.mini_batch_size. Experiences per optimizer "
     "step (DeepSpeed's global batch). rft's buffer.train_batch_size is not it: that is every experience of a step, "
     "buffer.batch_size x algorithm.repeat_times (LightRFT's rollout_batch_size x n_samples_per_prompt)."),
    ("rollout_batch_size=64",
     "that is ROLL's, LightRFT's and OpenRLHF's key, not rft's; rft's is buffer.batch_size. Both count prompts "
     "(tasks) per step; a step's experiences are that x algorithm.repeat_times (buffer.train_batch_size)."),
    # TRL
    ("num_generations=8",
     "that is TRL's key, not rft's; rft's is algorithm.repeat_times. Responses sampled per prompt."),
    ("beta=0.04",
     "that is TRL's key, not rft's; rft's are algorithm.kl_loss_coef and algorithm.dpo_beta. GRPOConfig's beta "
     "weighs a k3 KL loss term: algorithm.kl_loss_coef with algorithm.kl_loss_fn=k3 (kl_loss_fn=none is beta=0); "
     "DPOConfig's beta is algorithm.dpo_beta."),
    # before: Hydra's own "Could not override 'delta'" with no hint (near_args names none: 06da9bc)
    ("delta=4.0",
     "that is TRL's key, not rft's; rft's is algorithm.clip_ratio_c. TRL's two-sided clip (INTELLECT-2) caps a "
     "negative advantage's ratio at delta: the dual clip, the same loss and gradient for delta above 1 + "
     "epsilon_high."),
    ("max_steps=100",
     "that is ROLL's and TRL's key, not rft's; rft's is buffer.total_steps. ROLL counts pipeline steps, as rft "
     "counts steps (buffer.batch_size tasks each); TRL counts optimizer steps, of which a step here makes "
     "buffer.train_batch_size / trainer.mini_batch_size x trainer.ppo_epochs."),
    # Trinity-RFT FAQ's memory knobs. Before: "has no translation here" for both
    ("actor_rollout_ref.actor.entropy_from_logits_with_chunking=true",
     "that is verl's key, not rft's; rft's is trainer.logprob_chunk_size. Tokens per chunk, not a switch: each "
     "chunk's logits are recomputed in the backward, so the whole [tokens, vocab] logits never exist at once."),
    ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
     "that is verl's key, not rft's, and rft has no counterpart: there is no sequence parallelism; for long "
     "sequences lower trainer.max_token_len_per_gpu (with trainer.use_dynamic_bsz=true), or set "
     "trainer.logprob_chunk_size and trainer.gradient_checkpointing=true."),
    # Trinity-RFT's keys that rft lacks. Before: "Key 'trainer_config' not in 'TrainerConfig'." and no hint; a
    # verl key under it is translated as verl's
    ("trainer.trainer_config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
     "trainer.trainer_config holds verl's keys in Trinity-RFT; actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu: "
     "that is verl's key, not rft's; rft's is trainer.micro_batch_size_per_gpu. Both count experiences per GPU in "
     "one forward and backward."),
    ("trainer.trainer_config.foo=1",
     "that is Trinity-RFT's key, not rft's, and has no translation here: it hands verl's keys to verl; here each is "
     "one of rft's own keys, set by itself (name one as trainer.trainer_config.<verl's key>=<value> to be told "
     "which). rft's keys, each with a comment, are in rft/config.py; `python run.py --cfg job` prints the composed "
     "config."),
    # before: "Did you mean monitor.monitor_type or monitor.console_keys?"
    ("monitor.monitor_args.api_key=abc",
     "that is Trinity-RFT's key, not rft's, and rft has no counterpart: wandb reads WANDB_API_KEY and WANDB_BASE_URL "
     "from the environment run.py starts from; MLflow's server is monitor.mlflow_tracking_uri, its login "
     "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD."),
    ("model.chat_template_path=/t.jinja",
     "that is Trinity-RFT's key, not rft's; rft's is model.custom_chat_template. It takes the template's Jinja "
     "text, not a file's path (a YAML block, key: |, holds a long one)."),
    ("trainer.trainer_type=verl",
     "that is Trinity-RFT's key, not rft's; rft's are trainer=torch and trainer=fsdp2. There is no verl backend: "
     "the trainer is rft's own, one process (torch) or data-parallel ranks (fsdp2)."),
    ("service.data_juicer.auto_start=true",
     "that is Trinity-RFT's key, not rft's, and rft has no counterpart: there are no services (Data-Juicer) to "
     "start."),
])
def test_another_systems_key_on_the_command_line_is_translated(override, message):
    key = override.split("=")[0]
    assert misspelt_override([override], GROUPS) == f"Could not override '{key}': {message}"


def test_added_with_plus_or_in_a_stage_the_same_paragraph():
    assert misspelt_override(["+trainer.wandb_proxy=http://proxy:3128"], GROUPS) == (
        "Could not add 'trainer.wandb_proxy': that is verl's key, not rft's, and rft has no counterpart: set "
        "WANDB_HTTPS_PROXY (and WANDB_HTTP_PROXY) in the environment run.py starts from: wandb alone uses it, as verl's "
        "key, where HTTPS_PROXY would also send a judge's and a remote reward's requests through the proxy.")
    # a stage's keys are the whole config's: rft's key is named as the stage writes it
    assert misspelt_override(["stages.1.actor_rollout_ref.rollout.n=4"], GROUPS) == (
        "Could not override 'stages.1.actor_rollout_ref.rollout.n': that is verl's key, not rft's; rft's is "
        "stages.1.algorithm.repeat_times. Responses sampled per prompt.")


def test_rfts_own_keys_and_their_typos_behave_as_before():
    for fine in (["algorithm.repeat_times=8"], ["buffer.batch_size=16", "trainer.mini_batch_size=64"],
                 ["algorithm=grpo"], ["stages.0.trainer.save_interval=2"], ["algorithm.gamma=1.0"]):
        assert misspelt_override(fine, GROUPS) is None, fine
    # a typo of rft's own key: the nearest of rft's names, as before
    assert misspelt_override(["algorithm.repeat_time=4"], GROUPS) == (
        "Could not override 'algorithm.repeat_time': Key 'repeat_time' not in 'AlgorithmConfig'. Did you mean "
        "algorithm.repeat_times or algorithm.optimizer? The keys, each with a comment, are in rft/config.py; "
        "`python run.py --cfg job` prints the composed config.")
    assert misspelt_override(["trainer.lr=1e-3"], GROUPS).startswith(
        "Could not override 'trainer.lr': Key 'lr' not in 'TrainerConfig'. Did you mean algorithm.optimizer.lr")


@pytest.mark.parametrize("args, message", [
    # LightRFT's and OpenRLHF's keys are flags (Hydra: "unrecognized arguments")
    (["--n_samples_per_prompt", "8"],
     "--n_samples_per_prompt 8: rft takes key=value overrides, not flags; that is LightRFT's and OpenRLHF's key, "
     "not rft's; rft's is algorithm.repeat_times. Responses sampled per prompt."),
    (["--engine_mem_util=0.4", "seed=1"],
     "--engine_mem_util=0.4: rft takes key=value overrides, not flags; that is LightRFT's key, not rft's; rft's is "
     "explorer.rollout_model.gpu_memory_utilization."),
    # the meaning differs: rft's normalize subtracts the running mean, LightRFT's only with another flag
    (["--reward_running_norm", "--flash_attn"],
     "--reward_running_norm: rft takes key=value overrides, not flags; that is LightRFT's key, not rft's; rft's is "
     "buffer.explorer_input.taskset.reward_fn. A reward part's normalize: true ({fn: ..., normalize: true} in the "
     "reward_fn list), which subtracts the running mean before dividing by the running std: LightRFT does so only "
     "with --reward_running_norm_minus_mean."),
    (["--zero_stage", "3"],
     "--zero_stage 3: rft takes key=value overrides, not flags; that is LightRFT's and OpenRLHF's key, not rft's, "
     "and rft has no counterpart: there is no DeepSpeed here; trainer=fsdp2 shards the weights, gradients and "
     "optimizer state over its ranks."),
    # a flag named as the last part of one of rft's keys
    (["--seed", "3"], "--seed 3: rft takes key=value overrides, not flags: write seed=3."),
    # a switch: nothing after it is taken for its value
    (["--gradient_checkpointing", "seed=1"],
     "--gradient_checkpointing: rft takes key=value overrides, not flags; that is LightRFT's, OpenRLHF's and TRL's "
     "key, not rft's; rft's is trainer.gradient_checkpointing."),
])
def test_a_flag_of_another_system_is_one_paragraph(capsys, args, message):
    assert flag_refusal(capsys, args) == (message, 2, f"\nrft: configuration error: {message}\n\n")


def flag_refusal(capsys, args) -> tuple:
    """What run.py's check says of `args`: foreign_flag's paragraph, the exit code, the stderr
    (tests/test_user_study10 too)."""
    said = foreign_flag(args)
    with pytest.raises(SystemExit) as e:
        exit_on_config_mistakes(args, CONF)
    return said, e.value.code, capsys.readouterr().err


def test_hydras_own_flags_and_unknown_flags_are_left_to_hydra():
    for args in (["--cfg", "job"], ["-m", "seed=1,2"], ["--config-name=config"], ["--info"], ["--no_such_flag", "1"]):
        assert foreign_flag(args) is None, args


@pytest.mark.parametrize("text, message", [
    # a verl-shaped overlay: the first value it sets
    ("# @package _global_\ndefaults:\n  - override /algorithm: grpo\nactor_rollout_ref:\n  rollout:\n    n: 8\n",
     "conf/experiment/mine.yaml, line 6: actor_rollout_ref.rollout.n: that is verl's key, not rft's; rft's is "
     "algorithm.repeat_times. Responses sampled per prompt."),
    # a ROLL-shaped one
    ("# @package _global_\nactor_train:\n  device_mapping: list(range(0,8))\n",
     "conf/experiment/mine.yaml, line 3: actor_train.device_mapping: that is ROLL's key, not rft's; rft's is "
     "cluster.device_mapping.trainer. A YAML list of device indices ([0,1,2,3]), not ROLL's list(range(0,4))."),
    # a stage of an overlay
    ("# @package _global_\nstages:\n  - stage_name: rl\n    data:\n      train_batch_size: 32\n",
     "conf/experiment/mine.yaml, line 5: stages.0.data.train_batch_size: that is verl's key, not rft's; rft's is "
     "stages.0.buffer.batch_size. Both count prompts (tasks) per step, each sampled algorithm.repeat_times times; "
     "rft's buffer.train_batch_size is the step's experiences (batch_size x repeat_times)."),
])
def test_another_systems_key_in_an_overlay_names_its_file_and_line(tmp_path, monkeypatch, text, message):
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "experiment" / "mine.yaml").write_text(text)
    monkeypatch.chdir(tmp_path)  # files are named relative to where run.py runs
    assert check(["experiment=mine"], conf) == message


def test_every_key_of_rft_the_table_names_exists():
    """A translation to a key rft does not have would be worse than none: every rft key or group
    choice an entry names (its `ours`, and any dotted name in its sentences that is not another
    system's) is in the schema or is a file of conf/; no entry is shadowed by a key of rft's."""
    keys = set(schema_keys())
    # a sentence may shorten a key to its last parts (format.prompt_type, verl's rollout.n)
    named = {k.removesuffix(".*") for k in FOREIGN_KEYS} | keys
    known = {".".join(k.split(".")[i:]) for k in named for i in range(len(k.split(".")))}
    for name in FOREIGN_KEYS:
        entry = FOREIGN_KEYS[name]
        assert isinstance(entry, ForeignKey), name
        assert name.removesuffix(".*") not in keys, f"{name} is rft's own key: the entry is never reached"
        for ours in entry.ours or ():
            group, eq, option = ours.partition("=")
            if eq:
                assert option == "<name>" or (CONF / group / f"{option}.yaml").is_file(), (name, ours)
            else:
                assert ours in keys, (name, ours)
        for token in re.findall(r"(?<![\w/.<])([a-z_]+(?:\.[a-z_0-9]+)+)(?![\w/])", entry.note):
            if token.endswith((".py", ".yaml", ".json")) or token == "module.function":  # a file, a placeholder
                continue
            assert token in known, (name, token)
        for choice in re.findall(r"\b([a-z_]+)=([a-z_0-9]+)\b", entry.note):
            if choice[0] in GROUPS:
                assert (CONF / choice[0] / f"{choice[1]}.yaml").is_file(), (name, choice)


def test_a_study_adds_its_own_entry():
    FOREIGN_KEYS["my_system.batch"] = ForeignKey(("MySystem",), ("buffer.batch_size",), "Prompts per step.")
    try:
        assert foreign_key("my_system.batch") == ("that is MySystem's key, not rft's; rft's is buffer.batch_size. "
                                                  "Prompts per step.")
        assert key_mistake(OmegaConf.structured(Config), "my_system.batch").startswith("that is MySystem's key")
    finally:
        del FOREIGN_KEYS["my_system.batch"]


@pytest.mark.parametrize("override, message", [
    # Trinity-RFT's values of rft's own keys: before, the paragraph listed rft's values and no more
    ("synchronizer.sync_method=nccl",
     "synchronizer.sync_method=nccl: Invalid value 'nccl', expected one of [memory, checkpoint, collective]. "
     "Trinity-RFT's nccl is collective here (sync=collective). The key's type and its comment are in rft/config.py; "
     "`python run.py --cfg job` prints the composed config."),
    # Trinity-RFT's FAQ writes log.level=debug
    ("log.level=debug",
     "log.level=debug: Invalid value 'debug', expected one of [DEBUG, INFO, WARNING, ERROR, CRITICAL]. rft takes "
     "logging's level names in capitals: log.level=DEBUG. The key's type and its comment are in rft/config.py; "
     "`python run.py --cfg job` prints the composed config."),
])
def test_another_systems_value_of_a_typed_key_is_translated(override, message):
    from rft.plan.overlays import wrong_value_override

    assert wrong_value_override([override], GROUPS) == message


def test_another_systems_name_in_a_registry_is_translated():
    from rft.registry import TRAINER_BACKENDS, resolve

    with pytest.raises(ConfigError) as e:
        resolve(TRAINER_BACKENDS, "fsdp", "trainer.trainer_strategy")
    assert str(e.value) == (
        "trainer.trainer_strategy='fsdp' is not one of ['fsdp2', 'torch']; give a registered name or the dotted path "
        "of a class with the methods of rft/trainer/base.py (module.Class). Trinity-RFT's and verl's fsdp is fsdp2 "
        "here (trainer=fsdp2).")
    # a name that is no other system's: the paragraph as before
    with pytest.raises(ConfigError) as e:
        resolve(TRAINER_BACKENDS, "xyz", "trainer.trainer_strategy")
    assert str(e.value).endswith("(module.Class).")


def test_every_foreign_value_is_of_rfts_key_and_refused_there():
    from rft.plan.overlays import wrong_value_override
    from rft.registry import ENGINES, TRAINER_BACKENDS

    keys = set(schema_keys())
    for entry in FOREIGN_VALUES:
        key, value = entry.split("=", 1)
        # a value rft takes would never reach its entry
        assert key in keys and FOREIGN_VALUES[entry].note in wrong_value_override([entry], GROUPS), entry
    for registry in (ENGINES, TRAINER_BACKENDS):
        assert registry.foreign and not set(registry.foreign) & set(registry), registry.key


@pytest.mark.parametrize("key, says", [
    # Trinity-RFT's configuration guide writes advantage_fn: "ppo" (GAE) and names its clipped loss ppo
    ("algorithm.advantage_fn", "Trinity-RFT's ppo advantage (GAE with a critic) is gae here: algorithm=ppo sets it "
                               "with its critic."),
    ("algorithm.policy_loss_fn", "Trinity-RFT's ppo policy loss is ppo_clip here."),
])
def test_trinitys_algorithm_function_names_get_rfts(key, says):
    from rft.algorithms import ADVANTAGE_FNS, POLICY_LOSS_FNS
    from rft.registry import resolve

    registry = {"algorithm.advantage_fn": ADVANTAGE_FNS, "algorithm.policy_loss_fn": POLICY_LOSS_FNS}[key]
    assert not set(registry.foreign) & set(registry)  # a name rft takes would never reach its note
    with pytest.raises(ConfigError) as e:
        resolve(registry, "ppo", key)
    assert str(e.value).startswith(f"{key}='ppo' is not one of ") and str(e.value).endswith(
        "give a registered name or the dotted path of a function with the same signature (module.function). " + says)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_trls_delta_is_the_dual_clip(dtype):
    """The translation of TRL's delta above holds: TRL's loss, -min(min(r, delta) A, clip(r, 1 - eps, 1 +
    eps_high) A), written out here from its GRPOTrainer, equals rft's ppo_clip with clip_ratio_c = delta in
    value and gradient, for both signs of A and ratios below, between and above the bounds. By hand, A = -1,
    r = e^2 = 7.39, delta = 4: TRL -min(-4, -1.28) = 4; rft max(7.39, 1.28) = 7.39, capped at -A c = 4."""
    from rft.algorithms import POLICY_LOSS_FNS
    from rft.config import AlgorithmConfig

    delta, lo, hi = 4.0, 0.2, 0.28
    x = torch.tensor([[-2.0, -0.3, 0.0, 0.1, 0.3, 1.0, 1.5, 2.0, 3.0]], dtype=dtype)
    adv = torch.tensor([[1.0, -1.0, 1.0, -0.5, -1.0, 1.0, -2.0, -1.0, 0.7]], dtype=dtype)
    mask = torch.ones_like(x)
    grads = []
    for rft_form in (True, False):
        logp = x.clone().requires_grad_(True)
        if rft_form:
            cfg = AlgorithmConfig(clip_ratio_low=lo, clip_ratio_high=hi, clip_ratio_c=delta)
            batch = {"old_logp": torch.zeros_like(x), "advantages": adv, "response_mask": mask, "ref_logp": None}
            loss, _ = POLICY_LOSS_FNS["ppo_clip"](logp, batch, cfg)
        else:
            r = torch.exp(logp)
            loss = -torch.min(torch.clamp(r, max=delta) * adv, torch.clamp(r, 1 - lo, 1 + hi) * adv)
        loss.sum().backward()
        grads.append((loss.detach(), logp.grad))
    assert grads[0][0][0, 7].item() == pytest.approx(4.0)  # the hand-computed token above
    torch.testing.assert_close(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[0][1], grads[1][1])
