"""Every YAML under conf/ composes against the typed schema; the batch plan's values and errors."""

import re
from pathlib import Path

import pytest
import torch
from conftest import CONF, ROOT, compose_cfg
from omegaconf import OmegaConf

from rft.errors import ConfigError
from rft.plan.batch import format_plan, make_plan, stage_configs

GROUP_OPTIONS = sorted(
    (p.parent.name, p.stem) for p in CONF.glob("*/*.yaml") if p.parent.name != "hydra"
)


def test_every_group_has_options():
    groups = {g for g, _ in GROUP_OPTIONS}
    assert {"algorithm", "model", "task", "buffer", "explorer", "trainer", "sync", "monitor", "cluster"} <= groups


@pytest.mark.parametrize("group, option", GROUP_OPTIONS)
def test_every_yaml_composes(group, option):
    cfg = compose_cfg([f"{group}={option}"])
    stages = stage_configs(cfg)
    assert stages, "composes to at least one stage"
    for s in stages:
        # every value resolves and fits the schema
        OmegaConf.to_container(s, resolve=True, throw_on_missing=True)


def test_default_is_sft_warmup_then_grpo_on_the_tiny_model():
    cfg = compose_cfg()
    assert cfg.name == "grpo-tiny-arithmetic"
    sft, rl = stage_configs(cfg)
    assert (sft.stage_name, sft.mode, sft.algorithm.policy_loss_fn) == ("sft_warmup", "train", "sft")
    assert (rl.stage_name, rl.mode, rl.algorithm.advantage_fn) == ("grpo", "both", "grpo")
    # the stage inherits what it does not set
    assert sft.model.model_path == rl.model.model_path
    assert sft.buffer.trainer_input.experience_buffer.path == rl.buffer.explorer_input.taskset.path


def test_misspelt_key_in_a_stage_is_a_config_error():
    cfg = compose_cfg(["+stages.0.trainer.save_intervall=3"])
    with pytest.raises(ConfigError) as e:
        stage_configs(cfg)
    # OmegaConf's "Key 'save_intervall' not in 'TrainerConfig'     full_key: trainer.save_intervall" before
    assert str(e.value) == (
        "stages[0] (sft_warmup): trainer.save_intervall: Key 'save_intervall' not in 'TrainerConfig'. Did you mean "
        "trainer.save_interval or trainer.save_hf_checkpoint? The keys, each with a comment, are in rft/config.py; "
        "`python run.py --cfg job` prints the composed config.")


def plan_for(overrides, size=2000):
    return make_plan(stage_configs(compose_cfg(overrides))[-1], size)


def test_batch_plan_values():
    plan = plan_for(["buffer.batch_size=16", "algorithm.repeat_times=8", "trainer.mini_batch_size=64",
                     "trainer.micro_batch_size_per_gpu=16", "trainer.ppo_epochs=2", "buffer.total_steps=null",
                     "buffer.total_epochs=3"])
    # 16 tasks x 8 rollouts = 128 experiences; 128 / 64 = 2 mini-batches x 2 epochs = 4 updates
    assert plan.experiences_per_step == 128
    assert plan.optimizer_steps_per_step == 4
    # 64 / 16 = 4 micro-batches per update; 2000 // 16 = 125 steps per epoch x 3 epochs
    assert plan.micro_batches_per_update == 4
    assert (plan.steps_per_epoch, plan.total_steps, plan.total_optimizer_steps) == (125, 375, 1500)
    table = format_plan(plan)
    assert "optimizer steps per step" in table and "trainer.micro_batch_size_per_gpu" in table


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.mini_batch_size=48"],
         "trainer.mini_batch_size=48 must divide buffer.train_batch_size=128 (experiences per step) "
         "into whole optimizer steps. Choose a divisor of 128, e.g. 32."),
        (["trainer.micro_batch_size_per_gpu=24"],
         "trainer.micro_batch_size_per_gpu=24 x data-parallel size 1 must divide trainer.mini_batch_size=128"),
        (["buffer.train_batch_size=100"],
         "buffer.train_batch_size=100 must equal buffer.batch_size (16) x algorithm.repeat_times (8) = 128"),
        (["algorithm.repeat_times=1"], "algorithm.repeat_times=1 gives groups of one"),
        (["algorithm.optimizer.warmup_steps=500"], "algorithm.optimizer.warmup_steps=500 must be between 0 and the run's 60 optimizer steps (60 steps x 1 per step)."),
        (["algorithm.optimizer.lr=-1e-3"], "algorithm.optimizer.lr=-0.001 must be >= 0 and finite: a negative learning rate ascends "
                                           "the loss."),
        (["algorithm.optimizer.lr=inf"], "algorithm.optimizer.lr=inf must be >= 0 and finite: a negative learning rate ascends the "
                                         "loss."),
        (["algorithm.optimizer.weight_decay=-0.1"],
         "algorithm.optimizer.weight_decay=-0.1 must be >= 0 and finite: AdamW shrinks each weight by lr x weight_decay "
         "a step: a negative one grows them, an infinite one fills the model with NaN."),
        (["algorithm.advantage_fn=grpoo"],
         "algorithm.advantage_fn='grpoo' is not one of ['dr_grpo', 'gae', 'grpo', 'none', 'opmd', 'reinforce_pp', "
         "'reinforce_pp_baseline', 'rloo']; give a registered name or the dotted path of a function with the "
         "same signature (module.function). Did you mean grpo?"),
        (["algorithm.advantage_fn=my_study.nowhere.fn"],
         # run from a study's own folder (python ../rft/run.py), that folder is not on Python's path
         "algorithm.advantage_fn='my_study.nowhere.fn': cannot import it (ModuleNotFoundError: No module named 'my_study'). "
         "Python looks for my_study in the folder of run.py and the folders in PYTHONPATH, not in the folder you run "
         "from (unless that is run.py's own): run with PYTHONPATH=<the folder that holds my_study> (Ray's workers and "
         "a sweep's jobs inherit it)."),
        (["buffer.explorer_input.default_reward_fn_type=exact"],
         "buffer.explorer_input.default_reward_fn_type='exact' is not one of ['countdown', 'exact_match', "
         "'format', 'last_number', 'math', 'reasoning_gym'] (functions) or ['judge', 'remote', 'reward_model'] (served "
         "rewards); give a "
         "registered name or the dotted path of a function with the same signature (module.function)."),
        (["algorithm.rollout_is_cap=1"],
         "algorithm.rollout_is_cap=1.0 must be > 1 with algorithm.rollout_is=tis"),
        (["buffer.batch_size=4000", "buffer.total_steps=null"],
         "the dataset has 2000 rows, fewer than buffer.batch_size=4000"),
    ],
)
def test_batch_plan_errors_name_keys_values_and_fix(overrides, message):
    with pytest.raises(ConfigError) as e:
        plan_for(overrides)
    assert message in str(e.value)


CALC = ["model=tiny_tools", "task=calculator"]
TS = "buffer.explorer_input.taskset"


@pytest.mark.parametrize("overrides, message", [
    # the engine raised mid-run (transformers: "`temperature` (=-1.0) has to be a strictly positive float")
    ([f"{TS}.rollout_args.temperature=-1"], f"{TS}.rollout_args.temperature=-1.0 must be >= 0 and finite (0: greedy)."),
    (["buffer.explorer_input.eval_tasksets.0.rollout_args.top_p=0"],
     "buffer.explorer_input.eval_tasksets[0].rollout_args.top_p=0.0 must be in (0, 1] (1: no nucleus cut)."),
    ([f"{TS}.rollout_args.max_tokens=0"],
     f"{TS}.rollout_args.max_tokens=0 must be >= 1 (or null: model.max_response_tokens)."),
    (["buffer.explorer_input.eval_tasksets.0.repeat_times=-1"],
     "buffer.explorer_input.eval_tasksets[0].repeat_times=-1 must be >= 1 (or null: the default, "
     "algorithm.repeat_times for the taskset, 1 for an eval set)."),
    # the explorer sampled 16 x 4 = 64 experiences a step, the plan said 128 (exit 0)
    ([f"{TS}.repeat_times=4"],
     f"{TS}.repeat_times=4 differs from algorithm.repeat_times=8, which the batch plan counts (each step trains "
     f"on batch_size x algorithm.repeat_times experiences). Set algorithm.repeat_times=4 and leave the taskset's "
     f"repeat_times null."),
    # the merged model equalled the warm start (exit 0)
    (["model.lora.rank=4", "model.lora.alpha=0"],
     "model.lora.alpha=0.0 must be > 0 and finite: with model.lora.rank > 0 the adapters' update is scaled by "
     "alpha / rank, so 0 leaves the model as it started; 16 or 2 x rank is common."),
    (["explorer.max_failed_steps=-1"],
     "explorer.max_failed_steps=-1 must be >= 0 (0: never stop a run whose tasks all fail)."),
    (["synchronizer.sync_timeout=0"], "synchronizer.sync_timeout=0.0 must be > 0 (seconds)."),
    (["cluster.num_cpus=0"],
     "cluster.num_cpus=0 must be >= 1 (or null: every CPU of this machine): with none, no actor could ever be "
     "placed and the run would wait forever."),
    # clip_grad_norm_ with a negative max_norm reverses every update (exit 0, a worse model)
    (["trainer.grad_clip=-1"],
     "trainer.grad_clip=-1.0 must be > 0 (the largest gradient norm; inf: no clipping): 0 would zero every "
     "update and a negative value reverse it."),
    (["buffer.explorer_input.default_reward_fn_type=os.sep"],
     "buffer.explorer_input.default_reward_fn_type='os.sep' is a str, not a function or class; give the dotted "
     "path of a function (module.function) or a registered name."),
    # NaN made statistics.stdev raise in the driver, a raw traceback after the first step
    (["buffer.explorer_input.default_reward_fn_type=[{fn: exact_match, weight: nan}]"],
     "buffer.explorer_input.default_reward_fn_type[0].weight=nan is not a finite number; give a weight such "
     "as 1.0 (0 turns the part off)."),
    (["model.custom_chat_template='{% for m in messages %}{{ m.content }\n{% endfor %}'"],
     "model.custom_chat_template is not a valid Jinja template: at its line 1 ('{% for m in messages %}{{ "
     "m.content }'): unexpected '}'. Fix the template; transformers' chat templating docs show the syntax."),
    # every response was empty and the warning blamed the reward (exit 0)
    ([*CALC, f"{TS}.workflow_args.max_turns=0"], f"{TS}.workflow_args.max_turns=0 must be a whole number >= 1."),
    ([*CALC, "buffer.explorer_input.eval_tasksets.0.workflow_args.max_turns=two"],
     "buffer.explorer_input.eval_tasksets[0].workflow_args.max_turns='two' must be a whole number >= 1."),
    ([*CALC, f"{TS}.workflow_args.env=rft.rewards.verifiers.exact_match"],
     f"{TS}.workflow_args.env='rft.rewards.verifiers.exact_match' is not an environment: it needs to be a class with "
     f"reset(task) and step(text) methods (rft/rollout/environments/tools.py), and is a function."),
    ([*CALC, f"+{TS}.workflow_args.env_args.max_calls=2"],
     f"{TS}.workflow_args.env_args={{'max_calls': 2}} does not fit calculator(max_tool_calls: 'int' = 4) (got an "
     f"unexpected keyword argument 'max_calls'). Give the keyword arguments its constructor takes. Did you mean "
     f"max_tool_calls (not max_calls)?"),
    # a NaN coefficient trains a model of NaNs with exit 0
    (["algorithm.entropy_coef=nan"],
     "algorithm.entropy_coef=nan is not a number; give it a value (`python run.py --cfg job` shows the defaults)."),
    # "" is in every text: each response ended after its first token
    ([f"{TS}.rollout_args.stop=['']"],
     f"{TS}.rollout_args.stop=['']: every stop string must be a non-empty text (an empty one ends each response "
     f"after its first token)."),
    ([f"{TS}.format.prompt_key=answer"],
     f"{TS}.format.prompt_key and response_key both name the column 'answer': the model would be shown the answer "
     f"it is scored against. Point response_key at the reference answers (or null if the reward needs none)."),
    # a multi-turn conversation is scored by its environment's step: the reward_fn was never called (exit 0)
    ([*CALC, f"{TS}.reward_fn=countdown"],
     f"{TS}.reward_fn='countdown' would never be called: with workflow multi_turn the reward is the parts the "
     f"environment's step returns (calculator). Score in the environment's step (rft/rollout/environments/tools.py: ToolEnv "
     f"scores its answer by exact match), or set {TS}.reward_fn=null."),
    # every task failed at run time on "'CalculatorEnv' object is not callable"
    (["buffer.explorer_input.default_reward_fn_type=rft.rollout.environments.tools.CalculatorEnv"],
     "buffer.explorer_input.default_reward_fn_type='rft.rollout.environments.tools.CalculatorEnv' is a class whose instances "
     "cannot be called: a served reward is a class with __call__(prompt, responses, task) -> list of rewards "
     "(rft/rewards/scoring.py); a plain reward is a function fn(prompt, response, task)."),
    # the run's directory was <checkpoint_root_dir>/rft/.. : the root, whose runs continue_from_checkpoint=false
    # would move aside
    (["name=.."],
     "name='..': the run's outputs go to <checkpoint_root_dir>/<project>/<name>/, so name must be a non-empty "
     "relative name without '.', '..' or empty parts (a/b is fine). Choose another name."),
    (["project=/srv"],
     "project='/srv': the run's outputs go to <checkpoint_root_dir>/<project>/<name>/, so project must be a "
     "non-empty relative name without '.', '..' or empty parts (a/b is fine). Choose another project."),
])
def test_settings_no_run_can_use_fail_the_plan(overrides, message):
    with pytest.raises(ConfigError) as e:
        plan_for(["stages=[]", *overrides])
    assert str(e.value) == message


def test_an_overlong_penalty_factor_without_its_buffer_is_warned_about(caplog):
    # -m algorithm.overlong_penalty_factor=0.5,1.0 under grpo (overlong_buffer_frac 0): the same job
    # twice, exit 0, without a word
    plan_for(["stages=[]", "algorithm.overlong_penalty_factor=0.5"])
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "algorithm.overlong_penalty_factor=0.5 has no effect: algorithm.overlong_buffer_frac is 0, so no "
        "response is penalised for its length. Set algorithm.overlong_buffer_frac (DAPO's 0.2) to use it."]
    caplog.clear()
    plan_for(["stages=[]", "algorithm=dapo", "algorithm.overlong_penalty_factor=0.5"])  # dapo's buffer: 0.2
    assert [r for r in caplog.records if r.levelname == "WARNING"] == []


@pytest.mark.slow  # five configs composed (~1.7 s)
def test_a_kl_coefficient_without_its_kl_function_is_warned_about(caplog):
    # -m algorithm.kl_loss_coef=0.0,0.1 with grpo's kl_loss_fn=none: two jobs of the same run each, exit 0
    plan_for(["stages=[]", "algorithm.kl_loss_coef=0.1", "algorithm.kl_penalty_coef=0.0"])
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        "algorithm.kl_loss_coef=0.1 has no effect: algorithm.kl_loss_fn is none, so the stage adds no KL loss. Set "
        "algorithm.kl_loss_fn (k3 is common) to use it.",
        "algorithm.kl_penalty_coef=0.0 has no effect: algorithm.kl_penalty_fn is none, so the stage adds no KL "
        "penalty. Set algorithm.kl_penalty_fn (k3 is common) to use it."]
    caplog.clear()
    plan_for(["stages=[]", "algorithm.kl_loss_coef=0.1", "algorithm.kl_loss_fn=k3"])  # used
    plan_for(["stages=[]"])  # the defaults: none and 0.001, nothing asked for
    # model=tiny's SFT warm-up sets kl_loss_fn=none under a coefficient meant for the RL stage
    warm_up, rl = stage_configs(compose_cfg(["algorithm.kl_loss_coef=0.1", "algorithm.kl_loss_fn=k3"]))
    assert warm_up.algorithm.kl_loss_fn == "none" and warm_up.algorithm.kl_loss_coef == 0.1
    make_plan(warm_up, 2000)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_an_eval_set_that_reads_the_training_rows_is_warned_about(caplog):
    plan_for(["stages=[]", "buffer.explorer_input.eval_tasksets.0.split=train"])
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning.startswith("buffer.explorer_input.eval_tasksets[0] (arithmetic_test) reads the rows the run trains "
                              "on (path ")
    assert warning.endswith(", split train): its accuracy measures fitting the training set, not what was learned. "
                            "Give it the held-out split to measure that.")
    caplog.clear()
    plan_for(["stages=[]"])  # the default's eval set is the held-out split
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_sampling_settings_at_their_limits_plan():
    # temperature 0 is greedy decoding, top_p 1 no cut, top_k 0 or -1 no top-k: all valid (greedy with an
    # advantage that compares a group's rollouts is not: tests/test_config_audit.py)
    plan = plan_for(["stages=[]", "algorithm.advantage_fn=reinforce_pp", f"{TS}.rollout_args.temperature=0",
                     f"{TS}.rollout_args.top_p=1", f"{TS}.rollout_args.top_k=0", "model.lora.rank=4", "model.lora.alpha=8", "trainer.grad_clip=inf",
                     "explorer.max_failed_steps=0"])
    # planned as any run: the default's 16 tasks x 8 rollouts a step
    assert (plan.mode, plan.tasks_per_step, plan.rollouts_per_task) == ("both", 16, 8)


@pytest.mark.slow  # 1.3 s alone, over the fast tier's second
def test_an_actors_frozen_config_reads_as_the_resolved_config_and_cannot_change():
    """The explorer and trainer keep their config as rft.config.Frozen (plain dicts: an OmegaConf
    lookup costs ~6 us a level, ~0.5 ms a step). Every value must read as OmegaConf resolves it."""
    import pickle

    from omegaconf import OmegaConf

    from rft.config import Frozen, flat, frozen
    from rft.runtime.main import plan_stages

    stages, _, _ = plan_stages(compose_cfg(["trainer.grad_clip=0.5"]))
    cfg = stages[-1]
    f = frozen(cfg)
    assert isinstance(f.trainer, Frozen) and f.trainer.grad_clip == 0.5 == f["trainer"]["grad_clip"]
    assert flat(f) == flat(cfg)  # every leaf, interpolations resolved
    assert f.model.model_path == OmegaConf.select(cfg, "model.model_path") and "${" not in f.model.model_path
    assert f.mode == "both" and isinstance(f.buffer.explorer_input.eval_tasksets, list)
    assert f.model.get("no_such_key", 3) == 3 and getattr(f.model, "no_such_key", None) is None
    with pytest.raises(AttributeError, match="config has no key 'grad_clp'"):
        f.trainer.grad_clp
    with pytest.raises(TypeError, match="the config is read-only here \\(setting 'grad_clip'\\)"):
        f.trainer.grad_clip = 1.0
    with pytest.raises(TypeError, match="read-only"):
        f.trainer["grad_clip"] = 1.0
    again = pickle.loads(pickle.dumps(f))  # as a Ray actor receives it
    assert again == f and isinstance(again.trainer, Frozen) and frozen(f) is f


def test_an_overlays_stages_list_replaces_the_models_and_the_command_line_changes_one_key(tmp_path):
    """README "Stages": Hydra replaces a list, it does not merge one. An overlay's stage that names only
    what it changes loses the model's warm-up (its algorithm, mode and data): the stage is then the
    run's own algorithm, as the dry run's plan shows."""
    import shutil

    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "experiment" / "short_warmup.yaml").write_text(
        "# @package _global_\n# python run.py experiment=short_warmup\n"
        "stages:\n  - stage_name: sft_warmup\n    buffer: {total_steps: 150}\n  - stage_name: grpo\n")
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=short_warmup"], return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # as conftest.compose_cfg does
    with open_dict(cfg):
        del cfg["hydra"]
    warmup = stage_configs(cfg)[0]
    assert (warmup.stage_name, warmup.buffer.total_steps) == ("sft_warmup", 150)
    assert (warmup.mode, warmup.algorithm.algorithm_type) == ("both", "grpo")  # not the model's sft stage
    # one key on the command line keeps the rest of the model's stage
    warmup = stage_configs(compose_cfg(["stages.0.buffer.total_steps=150"]))[0]
    assert (warmup.buffer.total_steps, warmup.mode, warmup.algorithm.algorithm_type) == (150, "train", "sft")


def test_a_multi_turn_dry_run_names_the_environment_as_the_reward(capsys):
    """It said "reward exact_match(prompt, response, task)": the taskset's default, which a
    multi-turn conversation never calls."""
    import rft.runtime.main

    rft.runtime.main._main(compose_cfg([*CALC, "stages=[]", "dry_run=true"]))
    out = capsys.readouterr().out
    assert ("reward         the parts calculator.step(text) returns (workflow multi_turn; the reward function is "
            "not called)") in out
    assert "eval sets      calculator_test (" in out and ": calculator.step(text), every 10 steps" in out
    assert "workflow       multi_turn (environment calculator); workflow_args max_turns=3" in out


def an_agent(client, task, model, seed):
    """An agent for the dry run to name (planning checks its signature; it is never called)."""


def test_a_dry_run_names_an_agent_workflows_agent(capsys):
    import rft.runtime.main

    rft.runtime.main._main(compose_cfg(["stages=[]", "dry_run=true", "buffer.explorer_input.taskset.workflow=openai_agent",
                                        "+buffer.explorer_input.taskset.workflow_args.agent=test_config.an_agent",
                                        "buffer.explorer_input.eval_tasksets.0.workflow=openai_agent",
                                        "+buffer.explorer_input.eval_tasksets.0.workflow_args.agent=test_config.an_agent",
                                        "explorer.rollout_model.enable_openai_api=true"]))
    out = capsys.readouterr().out
    assert "workflow       openai_agent (agent test_config.an_agent)" in out
    # the agent's return value is the reward (it said "exact_match(prompt, response, task) with task.answer = ...")
    assert ("reward         what the agent test_config.an_agent returns (a float, or a dict of parts); where it "
            "returns None, exact_match(prompt, response, task) on its last answer, with task.answer = column "
            "'answer'") in out
    assert ": test_config.an_agent(client, task, ...), every 10 steps" in out  # the eval set's


def _safetensors_header_only(path, tensors: dict) -> None:
    """A safetensors file's header (what the plan reads) with no data behind it."""
    import json

    header, off = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = {"BF16": 2, "F32": 4}[dtype] * shape[0] * (shape[1] if len(shape) > 1 else 1)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    blob = json.dumps(header).encode()
    path.write_bytes(len(blob).to_bytes(8, "little") + blob)


@pytest.mark.slow  # 1.4 s alone, over the fast tier's second
def test_the_plan_says_how_much_a_weight_sync_moves_and_where(tmp_path, capsys):
    """The dry run's `weight sync` line: the bytes per sync (from the safetensors headers, or a hub
    id's name), the way they travel, and a warning where a large model goes the slow way every step."""
    import rft.runtime.main
    from rft.plan.memory import parameter_count
    from rft.plan.sync import route

    # 1000 x 500 + 500 = 500,500 parameters, whatever their stored dtypes; sent in model.dtype
    _safetensors_header_only(tmp_path / "model.safetensors", {"w": ("F32", [1000, 500]), "b": ("BF16", [500])})
    assert parameter_count(str(tmp_path)) == (500_500, "its files")
    assert parameter_count("Qwen/Qwen2.5-7B-Instruct") == (7_000_000_000, "its name")
    assert parameter_count("Qwen/Qwen2.5-0.5B") == (500_000_000, "its name")
    assert parameter_count("some/model") == (None, "")
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "model.safetensors").write_bytes(b"\xff" * 8 + b"not json")  # a header length of 2^64 - 1
    assert parameter_count(str(damaged)) == (None, "")
    (damaged / "model.safetensors").write_bytes((9).to_bytes(8, "little") + b"{not json")
    assert parameter_count(str(damaged)) == (None, "")

    local = compose_cfg(["stages=[]", f"model.model_path={tmp_path}", "model.builder=null", "model.dtype=bfloat16"])
    way, warning = route(local)
    # 500,500 x 2 bytes = 1,001,000 bytes = 1.0 MB; Ray on one node: the shared-memory segment
    assert way.startswith("memory (synchronizer.sync_method), every step: 1.0 MB per sync (0.5M parameters in "
                          "bfloat16, from its files), through a shared-memory segment the trainer writes")
    assert warning is None

    def routed(*extra):
        return route(compose_cfg(["stages=[]", "model=qwen7b", *extra]))

    # qwen7b's model.architecture counts 7,615,487,488 parameters (tests/test_memory_plan.py) x 2
    # bytes = 15.23 GB every step through a file, or through vLLM's RPC in one process
    way, warning = routed("sync=checkpoint")
    assert "15.23 GB per sync (7,615.5M parameters in bfloat16, from model.architecture)" in way
    assert warning.startswith("weight sync: 15.23 GB every step through a safetensors file on disk")
    assert "use sync=memory (explorers on the trainer's node) or sync=collective" in warning
    assert "vLLM's RPC" in routed("sync=memory", "explorer=vllm", "cluster=inline")[1]
    assert routed("sync=memory", "explorer=vllm")[1] is None  # one node: the workers read the segment
    assert routed()[1] is None  # what qwen7b brings: sync=collective
    assert routed("sync=checkpoint", "synchronizer.sync_interval=10")[1] is None  # not every step
    # without its architecture, the count in its name: 7e9 x 2 bytes = 14.00 GB
    assert "14.00 GB per sync (7,000.0M parameters in bfloat16, from its name)" in routed("model.architecture=null")[0]
    assert routed("sync=memory", "explorer=hf", "model.model_path=nowhere/model", "model.architecture=null")[0].endswith(
        "size unknown (the model is not on this machine), through a shared-memory segment the trainer writes on "
        "its node, read there by the explorers (Ray's object store if /dev/shm is too small)")

    rft.runtime.main._main(compose_cfg(["stages=[]", "model=qwen7b", "sync=checkpoint", "dry_run=true"]))
    out = capsys.readouterr().out
    assert "weight sync    checkpoint (synchronizer.sync_method), every step: 15.23 GB per sync" in out
    assert "warning        weight sync: 15.23 GB every step through a safetensors file on disk" in out


def test_the_real_shape_model_is_qwen25_05b_with_its_vocabulary_in_bfloat16(tmp_path):
    """model=qwen2.5-0.5b-shape: Qwen2.5-0.5B's architecture (its config.json: hidden 896, 24
    layers, 14 heads, 2 KV heads, MLP 4864, vocabulary 151,936, tied embeddings), built by the
    tiny model's builder with a vocabulary larger than its tokenizer's, saved in bfloat16.
    Built here narrower (2 layers of 64, vocabulary 1,000): the same code, seconds not 14."""
    import json

    from transformers import AutoModelForCausalLM

    from rft.models import BUILDERS, QWEN05_ARCH, build_tiny_model

    assert {k: QWEN05_ARCH[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                        "num_key_value_heads", "intermediate_size", "vocab_size")} == {
        "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "intermediate_size": 4864, "vocab_size": 151936}
    assert QWEN05_ARCH["tie_word_embeddings"] and "qwen2.5-0.5b-shape" in BUILDERS
    assert compose_cfg(["model=qwen2.5-0.5b-shape"]).model.builder == "qwen2.5-0.5b-shape"
    narrow = {**QWEN05_ARCH, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 1000}
    path = build_tiny_model(tmp_path / "shape", arch=narrow, dtype="bfloat16")
    config = json.loads((path / "config.json").read_text())
    assert (config["vocab_size"], config["dtype"], config["eos_token_id"]) == (1000, "bfloat16", 2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    assert model.get_input_embeddings().weight.shape == (1000, 64)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_a_stage_adds_a_key_to_a_free_form_dict_and_still_may_not_misspell_a_typed_one():
    """`+stages.1.buffer.explorer_input.taskset.workflow_args.<key>` stopped with "Key ... is not in
    struct": workflow_args is a free-form dict, and a stage may add to it; a key the schema's
    typed sections lack is still an error naming it."""
    from rft.plan.batch import stage_configs

    stages = stage_configs(compose_cfg(["experiment=calculator_tool",
                                        "+stages.1.buffer.explorer_input.taskset.workflow_args.strict=false"]))
    assert stages[1].buffer.explorer_input.taskset.workflow_args.strict is False
    assert "strict" not in stages[0].buffer.explorer_input.taskset.workflow_args
    with pytest.raises(ConfigError, match="Key 'workflow_argz' not in 'TasksetConfig'"):
        stage_configs(compose_cfg(["experiment=calculator_tool",
                                   "+stages.1.buffer.explorer_input.taskset.workflow_argz.strict=false"]))


# the keys the evaluation, data, distillation, reward-model and tool-calling work added: each is in
# the typed schema, which the studio's compose page lists (rft.studio.compose.schema), and in the README
NEW_KEYS = ["algorithm.distill_coef", "algorithm.teacher_model_path", "algorithm.distill_divergence",
            "algorithm.distill_jsd_beta", "algorithm.distill_top_k", "model.extra_tokens", "model.tool_call_parser",
            "model.stop_token_ids",
            "buffer.explorer_input.taskset.pass_k", "buffer.explorer_input.taskset.pass_threshold",
            "buffer.explorer_input.taskset.group_by", "buffer.explorer_input.reasoning_gym.datasets",
            "buffer.explorer_input.reasoning_gym.size", "buffer.explorer_input.reasoning_gym.eval_size",
            "buffer.explorer_input.reasoning_gym.seed", "buffer.explorer_input.reasoning_gym.teacher_error_rate",
            "buffer.trainer_input.experience_buffer.eval_split", "monitor.mlflow_tracking_uri",
            "data_processor.task_pipeline.operators", "data_processor.experience_pipeline.operators",
            "data_processor.online_curriculum.enable", "data_processor.online_curriculum.window",
            "data_processor.online_curriculum.eps", "algorithm.rm_pairs"]


@pytest.mark.parametrize("key", NEW_KEYS)
def test_a_new_key_is_in_the_schema_the_compose_page_and_the_readme(key):
    from rft.studio.compose import schema

    listed = {f["key"]: f for f in schema()}
    assert key in listed and listed[key]["comment"], key  # on the compose page, with its comment
    readme = (ROOT / "README.md").read_text()
    # by its whole name, or its section's name and its own as a word (`pass_k: [1, 4]`, a YAML example's `enable: true`)
    section, name = key.split(".")[-2:]
    assert key in readme or (section in readme and re.search(rf"\b{name}\b", readme)), key


def test_the_defaults_the_readme_gives_for_training_at_size_resuming_and_the_run():
    """README (from "The engine's log-probs" on): the defaults it names, as a user reads them, in the
    composed default config and the last stage it runs."""
    from rft.plan.placement import trainer_ranks

    cfg = compose_cfg()
    stage = stage_configs(cfg)[-1]
    a, t, m = stage.algorithm, stage.trainer, stage.model
    # "`tis` (the default) truncates it at `algorithm.rollout_is_cap` (2; ...)"
    assert (a.rollout_is, a.rollout_is_cap) == ("tis", 2.0)
    # "The trainer at size": packing and shared prompts on, the attention transformers' default
    # (sdpa: null passes nothing), LoRA off and, when on, synced merged
    assert (t.use_remove_padding, t.share_prompts, t.skip_zero_advantage) == (True, True, True)
    assert (t.use_dynamic_bsz, t.gradient_checkpointing, t.logprob_chunk_size) == (False, False, None)
    assert (m.attn_implementation, m.fp32_lm_head, m.lora.rank, m.lora.sync) == (None, False, 0, "merged")
    # "The trainer": torch by default; fsdp2's ranks one per GPU the explorers leave, 2 on CPU
    assert t.trainer_strategy == "torch" and stage.cluster.threads_per_actor is None
    assert trainer_ranks(compose_cfg(["trainer=fsdp2"])) == 2
    assert trainer_ranks(compose_cfg(["trainer=fsdp2", "cluster.gpu_per_node=8", "explorer=vllm", "model=qwen7b",
                                      "explorer.rollout_model.engine_num=2"])) == 6  # "2 vLLM engines, 6 FSDP2 ranks"
    # "Outputs": checkpoints all kept, hf/ at every save, re-running resumes; the stage cache
    # under the project; a run returns eval/accuracy; TensorBoard by default (what model=qwen7b
    # and qwen2.5-0.5b bring: tests/test_memory_plan.py)
    assert (t.max_ckpt_to_keep, t.save_hf_checkpoint, cfg.continue_from_checkpoint) == (None, "always", True)
    assert cfg.stage_cache_dir == f"{cfg.checkpoint_root_dir}/{cfg.project}/stage_cache"
    assert (cfg.objective, list(cfg.monitor.monitor_type)) == ("eval/accuracy", ["tensorboard"])
