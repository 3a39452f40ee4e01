"""A careless user's configuration, key by key: each value below was accepted by the plan and then
trained another run than the one asked for (exit 0), or stopped mid-run with a traceback. Each now
ends the plan with one paragraph naming the key, its value and the fix; a value no stage reads is
left alone."""

import json
import logging

import pytest
from conftest import compose_cfg
from hydra.errors import ConfigCompositionException

from rft.errors import ConfigError
from rft.plan.batch import make_plan, stage_configs

TS = "buffer.explorer_input.taskset"


def plan_for(overrides, size=2000):
    """The RL stage's plan (stages=[]: the default's warm-up left out)."""
    return make_plan(stage_configs(compose_cfg(["stages=[]", *overrides]))[-1], size)


def error_of(overrides) -> str:
    with pytest.raises(ConfigError) as e:
        plan_for(overrides)
    return str(e.value)


@pytest.mark.parametrize("overrides, message", [
    # the clip range [1 - low, 1 + high] would not hold the unchanged policy's ratio 1
    (["algorithm.clip_ratio_low=-0.1"],
     "algorithm.clip_ratio_low=-0.1 must be >= 0: the ratio is clipped to [1 - clip_ratio_low, 1 + clip_ratio_high]: "
     "a negative value puts the unchanged policy outside that range; inf: no lower clip."),
    (["algorithm.optimizer.weight_decay=inf"],
     "algorithm.optimizer.weight_decay=inf must be >= 0 and finite: AdamW shrinks each weight by lr x weight_decay a "
     "step: a negative one grows them, an infinite one fills the model with NaN."),
    (["algorithm.optimizer.betas=[0.9]"],
     "algorithm.optimizer.betas=[0.9] must be two numbers in [0, 1) (Adam's decay rates of the gradient's mean and "
     "of its square; [0.9, 0.999] is the default)."),
    (["algorithm.optimizer.betas=[0.9,1.0]"],
     "algorithm.optimizer.betas=[0.9, 1.0] must be two numbers in [0, 1) (Adam's decay rates of the gradient's mean "
     "and of its square; [0.9, 0.999] is the default)."),
    (["algorithm.optimizer.warmup_style=cosine", "algorithm.optimizer.min_lr_ratio=-0.5"],
     "algorithm.optimizer.min_lr_ratio=-0.5 must be in [0, 1]: the cosine schedule ends at lr x min_lr_ratio: below "
     "0 the learning rate turns negative (the loss is ascended), above 1 it grows."),
    (["algorithm=reinforce_pp", "algorithm.gamma=1.5"],
     "algorithm.gamma=1.5 must be in [0, 1]: a discount: 1 sums the rewards, below 1 discounts later ones."),
    (["algorithm=ppo", "algorithm.lam=2"],
     "algorithm.lam=2.0 must be in [0, 1]: GAE's lambda: 1 is the Monte Carlo return, 0 one step."),
    (["algorithm=ppo", "algorithm.critic_lr=-1e-5"],
     "algorithm.critic_lr=-1e-05 must be >= 0 and finite: a negative learning rate ascends the critic's loss."),
    (["algorithm=opmd", "algorithm.tau=0"],
     "algorithm.tau=0.0 must be > 0 and finite: OPMD's temperature (the loss is divided by 1 + tau, the logavgexp "
     "baseline divides by it)."),
    (["algorithm.kl_loss_fn=k3", "algorithm.kl_loss_coef=-0.01"],
     "algorithm.kl_loss_coef=-0.01 must be >= 0 and finite: a negative coefficient would reward moving away from the "
     "reference."),
    (["algorithm.entropy_coef=-inf"],
     "algorithm.entropy_coef=-inf must be finite: an infinite coefficient makes the loss infinite."),
    (["algorithm=mix", "algorithm.sft_loss_weight=-0.1"],
     "algorithm.sft_loss_weight=-0.1 must be >= 0 and finite: 0 turns the auxiliary SFT term off; a negative weight "
     "would unlearn the expert data."),
    (["algorithm=mix", "algorithm.sft_batch_size=0"],
     "algorithm.sft_batch_size=0 must be >= 1 (expert rows a step for the SFT term)."),
    (["algorithm=dapo", "algorithm.overlong_buffer_frac=1.0"],
     "algorithm.overlong_buffer_frac=1.0 must be in [0, 1): the share of the response budget at whose end responses "
     "are penalised (0: off; DAPO's 0.2)."),
    (["algorithm=dapo", "algorithm.overlong_penalty_factor=-1"],
     "algorithm.overlong_penalty_factor=-1.0 must be >= 0 and finite: the penalty at the length limit: a negative "
     "one rewards overlong responses."),
    (["algorithm.off_policy_correction=decoupled", "algorithm.behavior_weight_cap=0"],
     "algorithm.behavior_weight_cap=0.0 must be > 0: each stale token's policy loss is weighted by pi_prox / pi_behav "
     "capped here: at or below 0 the weights are 0 or negative; inf: no cap."),
    (["explorer.rollout_model.tensor_parallel_size=0"],
     "explorer.rollout_model.tensor_parallel_size=0 must be >= 1 (devices each engine is split over)."),
    (["explorer.rollout_model.generate_batch_size=0"],
     "explorer.rollout_model.generate_batch_size=0 must be >= 1 (sequences per generate() call)."),
    (["explorer=vllm", "explorer.rollout_model.gpu_memory_utilization=1.5"],
     "explorer.rollout_model.gpu_memory_utilization=1.5 must be in (0, 1]: the share of each GPU's memory vLLM may "
     "take (0.9 is common)."),
    (["data_processor.online_curriculum.enable=true", "data_processor.online_curriculum.eps=0"],
     "data_processor.online_curriculum.eps=0.0 must be > 0 and finite: the floor of every task's weight (0.05 is the "
     "default): at 0 a task always or never solved is never drawn again, and an infinite one draws uniformly."),
    # 0 was read as null (`x or default`): a default the user did not ask for
    (["buffer.train_batch_size=0"],
     "buffer.train_batch_size=0 must be >= 1 (or null for the default: batch_size x algorithm.repeat_times in "
     "mode=both)."),
    (["trainer.mini_batch_size=0"],
     "trainer.mini_batch_size=0 must be >= 1 (or null for the default: buffer.train_batch_size)."),
    (["trainer.logprob_chunk_size=-1"],
     "trainer.logprob_chunk_size=-1 must be >= 1 (or null for the default: all tokens at once)."),
    # accepted, and read as 0 (the explorer drops a step's last tasks once (1 - ratio) are done): a sign typo
    (["explorer.over_rollout.ratio=0.25", "explorer.over_rollout.wait_after_min=-5"],
     "explorer.over_rollout.wait_after_min=-5.0 must be >= 0 (seconds): how long a step waits for its last tasks "
     "once (1 - ratio) of them are done; inf: for all of them."),
    # +inf: every sample incorrect (pass@k 0 whatever the model), -inf: every one correct (pass@k 1)
    (["buffer.explorer_input.eval_tasksets.0.pass_threshold=inf"],
     "buffer.explorer_input.eval_tasksets[0].pass_threshold=inf must be finite: the reward at or above which a "
     "sample is correct (pass@k, maj@n, the curriculum's pass rates)."),
    ([f"{TS}.pass_threshold=-inf"],
     f"{TS}.pass_threshold=-inf must be finite: the reward at or above which a sample is correct (pass@k, maj@n, "
     f"the curriculum's pass rates)."),
    (["trainer.ppo_epochs=0"], "trainer.ppo_epochs=0 must be >= 1 (passes over each step's experiences)."),
    # said "trainer.micro_batch_size_per_gpu=0 x data-parallel size 1 must divide ... Choose a divisor of 128, e.g. 1"
    (["trainer.micro_batch_size_per_gpu=0"],
     "trainer.micro_batch_size_per_gpu=0 must be >= 1 (experiences per forward/backward on each rank)."),
    # planned; Ray's -1 restarts for ever, but a restarted explorer then redid its step without the
    # weight snapshot it needs (snapshots are kept for max_actor_restarts > 0 only)
    (["cluster=local", "cluster.max_actor_restarts=-1"],
     "cluster.max_actor_restarts=-1 must be >= 0 (times Ray restarts a dead explorer actor; 0: never)."),
    (["explorer.rollout_model.engine_num=1000000000000"],  # a MemoryError, building that many Ray bundles
     "explorer.rollout_model.engine_num=1000000000000 engine(s) and 1 trainer rank(s) (trainer.ranks) are "
     "1000000000001 processes, more than the CPUs of cluster.node_num=1 node(s) (at most 4096 each, more than any "
     "machine has), so they could never all be placed. Lower engine_num or trainer.ranks (to the cluster's CPUs "
     "over cluster.cpus_per_actor=1 each)."),
    (["trainer=fsdp2", "cluster=local", "cluster.colocate=true", "trainer.ranks=1000000000000"],
     "explorer.rollout_model.engine_num=1 engine(s) and 1000000000000 trainer rank(s) (trainer.ranks) are "
     "1000000000001 processes, more than the CPUs of cluster.node_num=1 node(s) (at most 4096 each, more than any "
     "machine has), so they could never all be placed. Lower engine_num or trainer.ranks (to the cluster's CPUs "
     "over cluster.cpus_per_actor=1 each)."),
    (["mode=explore", "buffer=sql", "cluster.gpu_per_node=8", "explorer.rollout_model.engine_num=1000000000000"],
     "the explorers need engine_num (1000000000000) x tensor_parallel_size (1) = 1000000000000 GPUs but "
     "cluster.node_num x gpu_per_node = 8. Lower explorer.rollout_model.engine_num, or add nodes."),
])
def test_a_value_outside_its_range_is_one_paragraph(overrides, message):
    assert error_of(overrides) == message


@pytest.mark.parametrize("overrides", [
    ["algorithm.lam=2"],  # grpo has no critic: GAE's lambda is read by no one
    ["algorithm.behavior_weight_cap=0"],  # off_policy_correction=behavior never weights
    ["algorithm.optimizer.min_lr_ratio=-0.5"],  # warmup_style=constant
    ["algorithm.dpo_beta=0"],  # grpo's loss is not DPO's
    ["explorer.rollout_model.gpu_memory_utilization=1.5"],  # explorer=hf
    ["algorithm.clip_ratio_low=inf", "algorithm.clip_ratio_high=0", "algorithm.entropy_coef=-0.01"],  # meaningful
])
def test_a_value_no_stage_reads_or_that_means_something_plans(overrides):
    # the RL stage of the default: 16 tasks x 8 rollouts = 128 experiences a step
    assert plan_for(overrides).experiences_per_step == 128


def test_every_range_names_a_key_of_the_schema_and_holds_its_default():
    # a misspelt key in the table would check nothing (OmegaConf.select gives None, which passes)
    from omegaconf import OmegaConf

    from rft.plan.ranges import RANGES

    cfg = stage_configs(compose_cfg(["stages=[]"]))[-1]
    for r in RANGES:
        keys = r.keys(cfg)
        assert keys, r.key  # the default has an eval set: [*] stands for one key at least
        for key in keys:
            assert OmegaConf.select(cfg, key, default="missing") != "missing", key
            v = OmegaConf.select(cfg, key)
            assert v is None or r.holds(v), (key, v)


def test_an_eval_sets_range_is_checked_where_the_stage_only_trains():
    # mode=train runs one explorer to evaluate (rft.plan.placement.explorer_count): it reads the eval
    # sets' sampling settings, and not the training taskset's
    from rft.plan.batch import check_config
    from rft.plan.ranges import check_ranges

    with pytest.raises(ConfigError) as e:
        check_config(compose_cfg(["stages=[]", "mode=train", "buffer.explorer_input.eval_tasksets.0.rollout_args.top_p=0"]))
    assert str(e.value) == ("buffer.explorer_input.eval_tasksets[0].rollout_args.top_p=0.0 must be in (0, 1] (1: no "
                            "nucleus cut).")
    assert check_ranges(compose_cfg(["stages=[]", "mode=train", f"{TS}.rollout_args.top_p=0"])) is None


def test_the_first_error_is_the_range_of_the_runs_shape():
    # a batch of 0 tasks and an absurd eval interval: the run's shape is named first, as it was
    assert error_of(["buffer.batch_size=0", "explorer.eval_interval=0", "trainer.grad_clip=0"]) == (
        "buffer.batch_size=0 must be >= 1 (tasks per step).")
    # a range before what compares keys: sync_offset=-1 is named, not the dynamic schedule's need of >= 1
    assert error_of(["synchronizer.sync_offset=-1", "synchronizer.sync_style=dynamic_by_explorer",
                     "cluster=local"]) == "synchronizer.sync_offset=-1 must be >= 0 (steps the explorer runs ahead)."


def test_greedy_rollouts_under_an_advantage_that_compares_them_stop_the_plan():
    # every rollout of a task is the same response: equal rewards, every GRPO advantage 0, nothing learned
    assert error_of([f"{TS}.rollout_args.temperature=0"]) == (
        f"{TS}.rollout_args.temperature=0 is greedy decoding, so the 8 rollouts of a task (algorithm.repeat_times) "
        f"are one response repeated, and algorithm.advantage_fn=grpo compares them: every advantage is 0 and nothing "
        f"is learned. Sample (temperature 1.0 is common; the eval sets' temperature can stay 0).")
    # one rollout a task, or an advantage that does not compare a group's rollouts: greedy is fine
    assert plan_for([f"{TS}.rollout_args.temperature=0", "algorithm.advantage_fn=reinforce_pp"]).rollouts_per_task == 8


def test_greedy_rollouts_of_a_multi_turn_workflow_are_warned_about(caplog):
    # an environment may make a group's rollouts differ: a warning, not an error
    with caplog.at_level(logging.WARNING):
        plan_for(["task=calculator", "model=tiny_tools", f"{TS}.rollout_args.temperature=0"])
    assert any("unless workflow" in r.getMessage() and "every advantage is 0" in r.getMessage() for r in caplog.records)


def test_nan_inside_a_list_item_is_one_paragraph():
    # flat() reads a list as one value, so NaN in an eval set went through
    assert error_of(["buffer.explorer_input.eval_tasksets.0.pass_threshold=nan"]) == (
        "buffer.explorer_input.eval_tasksets[0].pass_threshold=nan is not a number; give it a value (`python run.py "
        "--cfg job` shows the defaults).")


def test_a_misspelt_sft_buffer_no_longer_falls_back_to_the_taskset():
    assert error_of(["algorithm=mix", "algorithm.sft_buffer=sft_datset"]) == (
        "algorithm.sft_buffer='sft_datset' names no buffer of buffer.trainer_input.auxiliary_buffers (it has []), so "
        "algorithm.sft_loss_weight=0.1 would learn from no expert data of yours. Set algorithm.sft_buffer to one of "
        "those names, or add +buffer.trainer_input.auxiliary_buffers.sft_datset.path=<dataset of prompt/response "
        "rows> (with neither, algorithm.sft_buffer=sft_dataset learns from the taskset's reference answers).")
    # the default name without such a buffer: the taskset's answers, as documented
    assert plan_for(["algorithm=mix"]).sft_data[1] == TS


def test_token_budgets_past_the_models_positions_stop_the_plan(tmp_path):
    # the tiny model has 256 positions (conf/model/tiny.yaml's architecture, rft/models.py TINY_ARCH); an empty
    # cache_dir: not yet built, so the plan reads model.architecture (built, its config.json says the same)
    assert error_of(["model.max_response_tokens=300", f"cache_dir={tmp_path / 'cache'}"]) == (
        "model.max_prompt_tokens + model.max_response_tokens = 24 + 300 = 324 tokens is more than the model's 256 "
        "positions (max_position_embeddings=256, in model.architecture): the model never learned positions past "
        "them. Lower the token budgets to 256 tokens in all.")
    assert plan_for(["model.max_response_tokens=232"]).experiences_per_step == 128  # 24 + 232 = 256: fits
    # a model's own config.json wins, with its rope_scaling factor: 64 x 4 = 256 positions
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 64, "rope_scaling": {"factor": 4.0}}))
    over = [f"model.model_path={model}", "model.builder=null"]
    assert plan_for([*over, "model.max_model_len=256"]).experiences_per_step == 128
    assert error_of([*over, "model.max_model_len=257"]) == (
        f"model.max_model_len=257 tokens is more than the model's 256 positions (max_position_embeddings=64 x "
        f"rope_scaling factor 4.0, in {model / 'config.json'}): the model never learned positions past them. Lower "
        f"the token budgets to 256 tokens in all.")


@pytest.mark.parametrize("value, shown", [("0", "0"), ("null", "null"), ("'('", "'('"), ("[]", "[]")])
def test_lora_target_modules_that_name_no_module_are_one_paragraph(value, shown):
    # an int or null raised a TypeError in the memory estimate (a traceback); [] adapted nothing
    assert error_of(["model.lora.rank=8", f"model.lora.target_modules={value}"]) == (
        f"model.lora.target_modules={shown} names no module to adapt: give all-linear (every linear layer but the "
        f"output layer), a list of module names ([q_proj, v_proj]), or a regular expression that PEFT matches "
        f"against the modules' full names.")


def test_a_lora_regex_counts_the_modules_it_matches():
    from rft.plan.memory import lora_parameters, shape_of

    stage = stage_configs(compose_cfg(["stages=[]", "model.lora.rank=8", "model.lora.target_modules=.*q_proj"]))[-1]
    shape, _ = shape_of(stage.model)
    # q_proj alone: hidden 128 in + 4 heads x 32 = 128 out = 256; rank 8 x 2 layers x 256 = 4096
    # (the string was read as its characters: no module matched, 0 parameters)
    assert lora_parameters(shape, stage.model.lora) == 4096


def test_a_log_level_that_logging_does_not_know_fails_when_composed():
    # logging.setLevel('verbose') raised in every actor at its start, after the plan
    with pytest.raises(ConfigCompositionException) as e:
        compose_cfg(["log.level=verbose"])
    assert "Invalid value 'verbose', expected one of [DEBUG, INFO, WARNING, ERROR, CRITICAL]" in str(e.value.__cause__)
    level = compose_cfg(["log.level=DEBUG"]).log.level
    logging.getLogger("rft.test_config_audit").setLevel(level)  # what rft.runtime.actors does with it
    assert logging.getLogger("rft.test_config_audit").level == logging.DEBUG


@pytest.mark.parametrize("overrides, key, what", [
    (["algorithm.critic_lr=1e-3"], "algorithm.critic_lr=0.001", "PPO's critic (algorithm.advantage_fn=gae: algorithm=ppo)"),
    (["algorithm.tau=0.5"], "algorithm.tau=0.5", "OPMD (algorithm=opmd)"),
    (["algorithm.dpo_beta=0.5"], "algorithm.dpo_beta=0.5", "DPO's loss (algorithm=dpo)"),
])
@pytest.mark.slow  # 1.8 s alone, over the fast tier's second
def test_a_key_of_another_algorithm_is_warned_about(caplog, overrides, key, what):
    # a sweep over it ran the same job each time, without a word
    with caplog.at_level(logging.WARNING):
        plan_for(overrides)
    assert f"{key} has no effect: only {what} reads it, and this stage runs algorithm.advantage_fn=grpo, " \
           f"policy_loss_fn=ppo_clip." in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        plan_for(["algorithm=ppo", "algorithm.critic_lr=1e-3"])  # read: no warning
    assert "has no effect" not in caplog.text


def test_a_critic_warmup_as_long_as_the_stage_never_trains_the_policy():
    # conf/model/tiny.yaml: 60 steps; steps 0..59 with critic_warmup=60 all train the critic alone
    assert error_of(["algorithm=ppo", "algorithm.critic_warmup=60"]) == (
        "algorithm.critic_warmup=60 steps train only the critic, but the stage has 60 steps: the policy would never "
        "be trained. Lower critic_warmup below 60 (0: none), or train for more steps.")
    assert plan_for(["algorithm=ppo", "algorithm.critic_warmup=59"]).total_steps == 60


def test_a_queue_smaller_than_a_step_and_a_trainer_that_never_waits_are_one_paragraph():
    eb = "buffer.trainer_input.experience_buffer"
    # 16 tasks x 8 rollouts = 128 experiences a step
    assert error_of([f"{eb}.capacity=127"]) == (
        f"{eb}.capacity=127 holds fewer experiences than one step trains on (buffer.train_batch_size=128), so the "
        f"trainer would wait for a batch that never fits. Raise capacity to at least 128.")
    assert plan_for([f"{eb}.capacity=128"]).experiences_per_step == 128
    assert error_of([f"{eb}.max_read_timeout=0"]) == (
        f"{eb}.max_read_timeout=0.0 must be > 0: seconds the trainer waits for a full batch (and a writer for room in "
        f"a full queue); at 0 it never waits, so a step trains on what happened to be there; inf: wait for ever.")


def test_an_explorer_lead_of_the_whole_stage_is_warned_about(caplog):
    with caplog.at_level(logging.WARNING):
        plan_for(["synchronizer.sync_offset=60"])
    assert ("synchronizer.sync_offset=60 is not below the stage's 60 steps: the explorers generate every step before "
            "they take trained weights") in caplog.text


@pytest.mark.parametrize("address, ok", [("zzzz", False), ("head", False), ("auto", True), ("10.0.0.1:6379", True),
                                         ("ray://head:10001", True)])
def test_a_ray_address_that_is_none_is_one_paragraph(address, ok):
    # ray.init(address='zzzz') raised its own traceback when the run started
    if ok:
        assert plan_for([f"cluster.ray_address={address}"]).experiences_per_step == 128
        return
    assert error_of([f"cluster.ray_address={address}"]) == (
        f"cluster.ray_address='{address}' is not a Ray address: give auto (the cluster `ray start` made on this "
        f"node), host:port (its GCS, e.g. 10.0.0.1:6379), ray://host:port (Ray Client), or null to start a Ray "
        f"instance of the run's own.")


def test_a_chat_template_that_never_reads_the_messages_is_one_paragraph():
    # a file's path given for the text parsed as a template of plain text: every prompt rendered as that path
    assert error_of(["model.custom_chat_template=/srv/templates/chat.jinja"]) == (
        "model.custom_chat_template='/srv/templates/chat.jinja' never reads `messages`, so every prompt would render "
        "as the same text, whatever the task. Give the template's Jinja text (it loops over messages: {% for m in "
        "messages %}...), not a file's path; a YAML block (key: |) holds a long one.")
    good = "model.custom_chat_template='{% for m in messages %}{{ m.content }}{% endfor %}'"
    assert plan_for([good]).experiences_per_step == 128


def test_an_eval_set_sampled_several_times_greedily_is_one_paragraph():
    # 4 greedy samples of a task are one response: pass@4 would equal pass@1, a measurement in name only
    ev = "buffer.explorer_input.eval_tasksets.0"
    assert error_of([f"{ev}.repeat_times=4", f"{ev}.pass_k=[1,4]"]) == (
        "buffer.explorer_input.eval_tasksets[0].repeat_times=4 samples each task 4 times, but its "
        "rollout_args.temperature=0 is greedy decoding: the 4 samples are one response repeated, so pass@k equals "
        "pass@1 for every k (and mean@n, maj@n, best@n say nothing more). Set "
        "buffer.explorer_input.eval_tasksets[0].rollout_args.temperature (1.0 is common) for samples that differ, or "
        "repeat_times=1.")
    assert plan_for([f"{ev}.repeat_times=4", f"{ev}.pass_k=[1,4]", f"{ev}.rollout_args.temperature=1.0"]
                    ).experiences_per_step == 128


def test_a_mini_batch_that_the_ranks_cannot_share_names_the_ranks():
    # 64 experiences over 3 ranks: no micro-batch size divides it, where the message said "a divisor of 21, e.g. 21"
    assert error_of(["trainer=fsdp2", "trainer.ranks=3", "trainer.mini_batch_size=64"]) == (
        "trainer.mini_batch_size=64 cannot be split evenly over the trainer's data-parallel size 3 (trainer.ranks, or "
        "one per device the explorers leave): each rank takes an equal share. Choose trainer.ranks that divides 64, "
        "e.g. 2, or a mini_batch_size that is a multiple of 3.")
    # 64 / 4 ranks = 16 a rank: micro_batch_size_per_gpu=128 (conf/model/tiny.yaml) is capped at the rank's 16
    assert plan_for(["trainer=fsdp2", "trainer.ranks=4", "trainer.mini_batch_size=64"]).micro_batch_size == 16


@pytest.mark.parametrize("value, shown", [("zzzz", "'zzzz'"), ("null", "null")])
def test_a_replay_priority_argument_that_is_no_number_is_one_paragraph(value, shown):
    # linear_decay's decay: version - decay x times_used raised a TypeError at the trainer's first read
    rb = "buffer.trainer_input.experience_buffer.replay_buffer"
    assert error_of([f"{rb}.enable=true", f"{rb}.priority_fn_args.decay={value}"]) == (
        f"{rb}.priority_fn_args.decay={shown} must be a number: priority_fn=linear_decay takes decay as float (its "
        f"default is 2.0).")
    assert plan_for([f"{rb}.enable=true", f"{rb}.priority_fn_args.decay=0.5"]).experiences_per_step == 128


@pytest.mark.slow  # 1.2 s alone, over the fast tier's second
def test_a_reward_that_reads_the_answer_on_a_taskset_without_one_stops_the_plan():
    """format.response_key=null makes every task's answer None: exact_match (the default task's reward),
    last_number and math then score every response 0, and the run was warned of it only after 3 steps
    of zeros. A reward that needs no answer (countdown reads the row's numbers) plans."""
    assert error_of([f"{TS}.format.response_key=null"]) == (
        f"{TS}.format.response_key is null, and its reward 'exact_match' compares each response with the task's "
        f"reference answer (task.answer): every answer would be None and every reward 0. Set {TS}.format.response_key "
        f"to the column that holds the answer, or use a reward that needs none ({TS}.reward_fn=<your module>.<function>).")
    # a reward of parts: the part that reads the answer is named
    assert "its reward 'math' compares" in error_of([f"{TS}.format.response_key=null",
                                                      f"+{TS}.reward_fn=[{{fn: format, weight: 0.1}},{{fn: math, weight: 1.0}}]"])
    assert plan_for(["task=countdown", f"{TS}.format.response_key=null"]) is not None
