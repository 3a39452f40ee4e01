"""A new user who comes from Trinity-RFT (experiments/from_trinity/): the manual's GRPO example
translated into rft's keys, then the keys, modes and habits such a user brings. Each test is a
defect that study met."""

import pytest
from conftest import CONF, compose_cfg

from rft.errors import ConfigError
from rft.plan.overlays import misspelt_override
from rft.runtime.main import split_stages

GROUPS = {p.name for p in CONF.iterdir() if p.is_dir()}
_WORKFLOWS = ("Trinity-RFT's math_workflow and simple_workflow are single_turn here (the default; the reward is "
              "named apart, reward_fn), a conversation with an environment multi_turn, an agent through the "
              "OpenAI API openai_agent, a study's own its dotted path (module.function).")


# ---------------------------------------------------------------- algorithm_type: mix, dapo

@pytest.mark.parametrize("label, said, missing", [
    # mix.yaml keeps grpo's functions and turns on the SFT term (sft_loss_weight 0.1)
    ("mix", "with sft_loss_weight=0.0", "not mix's sft_loss_weight=0.1"),
    # dapo.yaml keeps them too: dynamic sampling (4 tries) and the overlong penalty (last 0.2)
    ("dapo", "with dynamic_sampling_max_tries=0, overlong_buffer_frac=0.0",
     "not dapo's dynamic_sampling_max_tries=4, overlong_buffer_frac=0.2"),
])
def test_trinity_algorithm_type_with_grpos_functions_stops(label, said, missing):
    """Trinity-RFT's `algorithm_type: mix` picks its mix algorithm; here it was a label only, and as
    mix keeps grpo's functions the plan passed it: exit 0, GRPO without the SFT term under the name mix."""
    with pytest.raises(ConfigError) as e:
        split_stages(compose_cfg([f"algorithm.algorithm_type={label}", "stages=[]"]))
    assert str(e.value) == (
        f"algorithm.algorithm_type={label} is only a name for logs and outputs here (in Trinity-RFT it picks the "
        f"algorithm): this stage would run advantage_fn=grpo, policy_loss_fn=ppo_clip {said}, {missing}. "
        f"Choose the algorithm with algorithm={label} (conf/algorithm/{label}.yaml; in a stage's entry, its "
        f"algorithm keys as that file sets them), or give a name that is no algorithm's.")


@pytest.mark.parametrize("overrides, label", [
    # the group chosen: its own label
    (["algorithm=mix"], "mix"),
    # one of the file's switches on: the user set up the SFT term, the label names what runs
    (["algorithm.algorithm_type=mix", "algorithm.sft_loss_weight=0.5"], "mix"),
    (["algorithm.algorithm_type=dapo", "algorithm.dynamic_sampling_max_tries=3"], "dapo"),
])
def test_a_label_whose_switch_is_on_passes(overrides, label):
    stages, _ = split_stages(compose_cfg([*overrides, "stages=[]"]))
    assert [s.algorithm.algorithm_type for s in stages] == [label]


# ---------------------------------------------------------------- Trinity-RFT's renamed keys

@pytest.mark.parametrize("override, message", [
    # before: "Did you mean buffer.trainer_input.experience_buffer.storage_type or ...": another key, of the
    # trainer's buffer, which the README's line on the guide's keys does not promise
    ("buffer.explorer_input.taskset.storage_type=file",
     "that is Trinity-RFT's key, not rft's, and rft has no counterpart: a taskset is read from its path: a JSONL, "
     "Parquet or CSV file, a folder of them or a Hugging Face dataset id (Trinity-RFT's file); there are no sql or "
     "queue tasksets. Remove the key."),
    # before: "Did you mean buffer.explorer_input.default_reward_fn_type or buffer.explorer_input.generator?"
    ("buffer.explorer_input.default_workflow_type=math_workflow",
     "that is Trinity-RFT's key, not rft's; rft's is buffer.explorer_input.taskset.workflow. Each taskset names its "
     "own (an eval set's too, buffer.explorer_input.eval_tasksets.<i>.workflow). " + _WORKFLOWS),
    ("buffer.explorer_input.eval_tasksets.0.default_workflow_type=math_workflow",
     "that is Trinity-RFT's key, not rft's; rft's is buffer.explorer_input.eval_tasksets. The set's own workflow "
     "key (buffer.explorer_input.eval_tasksets.<i>.workflow). " + _WORKFLOWS),
    # before: "Did you mean algorithm.policy_loss_fn or algorithm.kl_loss_fn?"
    ("algorithm.kl_loss_fn_args.kl_coef=0.01",
     "that is Trinity-RFT's key, not rft's; rft's is algorithm.kl_loss_coef. Trinity-RFT's kl_coef is "
     "algorithm.kl_loss_coef (0.001 by default, as there)."),
    ("algorithm.policy_loss_fn_args.mu=0.1",
     "that is Trinity-RFT's key, not rft's; rft's is algorithm.args. The built-in losses read the algorithm "
     "section's own keys (clip_ratio_low, clip_ratio_high, clip_ratio_c, loss_agg_mode); the mix algorithm's mu, "
     "the SFT term's weight, is nearest algorithm.sft_loss_weight (algorithm=mix adds sft_loss_weight x the SFT "
     "loss to the RL loss); a study's own loss takes its keywords from algorithm.args."),
])
def test_trinitys_renamed_keys_name_rfts(override, message):
    key = override.split("=")[0]
    assert misspelt_override([override], GROUPS) == f"Could not override '{key}': {message}"


def test_a_trinity_key_in_a_stage_names_the_stages_key():
    assert misspelt_override(["stages.1.buffer.explorer_input.taskset.default_reward_fn_type=countdown"], GROUPS) == (
        "Could not override 'stages.1.buffer.explorer_input.taskset.default_reward_fn_type': that is Trinity-RFT's "
        "key, not rft's; rft's is stages.1.buffer.explorer_input.taskset.reward_fn. "
        "buffer.explorer_input.default_reward_fn_type is the run's default, as in Trinity-RFT.")


# ---------------------------------------------------------------- mode=train from an explore job's buffer

TRAIN = ["stages=[]", "mode=train", "buffer=sql", "buffer.batch_size=4", "algorithm.repeat_times=4",
         "buffer.trainer_input.experience_buffer.path=/runs/gen/buffer.db"]


def planned(caplog, overrides: list[str], tasks: int):
    """The plan of the first stage of `overrides` over `tasks` tasks, and what rft.plan.batch warned
    while it was made."""
    from rft.plan.batch import make_plan, stage_configs

    caplog.clear()
    with caplog.at_level("WARNING", logger="rft.plan.batch"):
        plan = make_plan(stage_configs(compose_cfg(overrides))[0], tasks)
    return plan, [r.getMessage() for r in caplog.records if r.name == "rft.plan.batch"]


def test_train_mode_for_more_steps_than_stored_says_so_at_the_start(caplog):
    """The README's split (mode=explore, then mode=train from its buffer) with model=tiny, whose file
    sets buffer.total_steps=60: 3 stored steps trained, then each step waited 30 min unannounced."""
    plan, warned = planned(caplog, TRAIN, 48)
    assert (plan.input_kind, plan.total_steps, plan.experiences_per_step) == ("experiences", 60, 16)
    # 48 stored experiences / 16 a step = 3 steps; the 4th waits
    assert warned == [
        "mode=train: buffer.total_steps=60, but /runs/gen/buffer.db holds 48 experiences, 3 steps of "
        "buffer.train_batch_size=16: from step 4 on each step waits up to "
        "buffer.trainer_input.experience_buffer.max_read_timeout=1800.0s for an explore job still writing there, "
        "then stops. If no explore job writes there any more, set buffer.total_steps=null (the steps stored) or "
        "at most 3."]
    for steps in ("3", "null"):
        plan, warned = planned(caplog, [*TRAIN, f"buffer.total_steps={steps}"], 48)
        assert (plan.total_steps, warned) == (3, [])


def test_a_read_past_max_read_timeout_is_one_paragraph():
    """It ended in a TimeoutError's traceback through schedule.py and buffer.py (exit 1)."""
    from types import SimpleNamespace

    from rft.errors import RunError
    from rft.plan.batch import make_plan, stage_configs
    from rft.runtime.schedule import Schedule

    cfg = stage_configs(compose_cfg(TRAIN))[0]

    class Empty:
        def get(self, n, timeout):
            raise TimeoutError(f"buffer 'experience_buffer': no experiences arrived within {timeout}s (wanted {n}).")

    stage = SimpleNamespace(cfg=cfg, plan=make_plan(cfg, 48), buffer=Empty(), fixed_policy=False)
    with pytest.raises(RunError) as e:
        Schedule._read_batch(stage, 4, None)
    assert str(e.value) == (
        "step 4 of 60: buffer 'experience_buffer': no experiences arrived within 1800.0s (wanted 16). In mode=train "
        "the stage has buffer.total_steps=60 steps: if no explore job writes to /runs/gen/buffer.db any more, it "
        "holds no more; set buffer.total_steps=null (the steps stored) and resume_with_changes=true (the same "
        "command with both goes on from the newest checkpoint).")


# ---------------------------------------------------------------- metrics by verl's (Trinity's trainer's) names

@pytest.mark.parametrize("override, message", [
    # before: accepted; the progress line never showed it, and a sweep's objective was None at the end
    ("monitor.console_keys=[reward/mean,actor/pg_loss]",
     "monitor.console_keys names actor/pg_loss, verl's (and Trinity-RFT's trainer's) name of a metric that rft logs "
     "as loss/policy; actor/pg_loss is never logged here. Write loss/policy (the metrics of a run are the keys of "
     "its <stage>/metrics.jsonl)."),
    ("objective=critic/rewards/mean",
     "objective names critic/rewards/mean, verl's (and Trinity-RFT's trainer's) name of a metric that rft logs as "
     "reward/mean (verl's is after its KL penalty, rft's before it: with algorithm.kl_penalty_fn set, subtract "
     "algorithm.kl_penalty_coef x reward/kl_penalty); critic/rewards/mean is never logged here. Write reward/mean "
     "(the metrics of a run are the keys of its <stage>/metrics.jsonl)."),
])
def test_a_verl_metric_name_is_told_rfts(override, message):
    from rft.plan.batch import check_config, stage_configs

    with pytest.raises(ConfigError) as e:
        check_config(stage_configs(compose_cfg(["stages=[]", override]))[0])
    assert str(e.value) == message


def test_every_metric_translated_to_is_one_rft_logs():
    """The table names rft's metrics as the code writes them (a name of its own would be as silent)."""
    import re

    from conftest import ROOT

    from rft.foreign_keys import FOREIGN_METRICS

    logged = set(re.findall(r'"((?:actor|loss|reward|advantage|critic|timing)/[a-z_]+)"',
                            "\n".join(p.read_text() for p in (ROOT / "rft").rglob("*.py")
                                      if p.name != "foreign_keys.py")))
    assert {ours for ours, _ in FOREIGN_METRICS.values()} <= logged
    assert not set(FOREIGN_METRICS) & logged  # a verl name rft logs itself would be refused wrongly


# ---------------------------------------------------------------- total_epochs under a model's total_steps

@pytest.mark.slow  # 1.2 s alone, over the fast tier's second
def test_total_epochs_under_a_set_total_steps_is_said(caplog):
    """The guide: total_steps, if set, makes total_epochs ineffective. model=tiny's file sets
    total_steps=60, so a user's buffer.total_epochs=2 ran 60 steps, not 2 x 69, unsaid."""
    plan, warned = planned(caplog, ["task=countdown", "stages=[]", "buffer.total_epochs=2"], 1113)
    # 1113 countdown tasks // batch_size 16 = 69 steps an epoch; the model's 60 steps run
    assert (plan.steps_per_epoch, plan.total_steps) == (69, 60)
    assert warned == [
        "buffer.total_epochs=2 has no effect: buffer.total_steps=60 is set and wins (a model or experiment file may "
        "set it: model=tiny's sets 60, its warm-up stage 400). For 2 epochs of 69 steps, set buffer.total_steps=null "
        "(a stage's own, stages.<i>.buffer.total_steps=null)."]
    plan, warned = planned(caplog, ["task=countdown", "stages=[]", "buffer.total_epochs=2", "buffer.total_steps=null"],
                           1113)
    assert (plan.total_steps, warned) == (138, [])  # 2 x 69


# ---------------------------------------------------------------- sync_offset=0 with sync_interval > 1

@pytest.mark.parametrize("interval, said", [
    (1, "on-policy: generates, then waits while the trainer learns (synchronizer.sync_offset=0)"),
    # the guide's sync_offset 0 with an interval of 2: the study's run logged staleness/max 1 at every even step
    (2, "generates, then waits while the trainer learns (synchronizer.sync_offset=0); the weights come every 2 "
        "steps (synchronizer.sync_interval), so experiences are up to 1 step stale (off_policy_correction=behavior)"),
    (10, "generates, then waits while the trainer learns (synchronizer.sync_offset=0); the weights come every 10 "
         "steps (synchronizer.sync_interval), so experiences are up to 9 steps stale (off_policy_correction=behavior)"),
])
def test_the_dry_run_says_on_policy_only_when_it_is(interval, said):
    """It said 'on-policy' for any sync_interval (the guide's example: sync_offset 0, sync_interval 10)."""
    from rft.plan.batch import _sync_rows, stage_configs

    cfg = stage_configs(compose_cfg(["stages=[]", "synchronizer.sync_offset=0",
                                     f"synchronizer.sync_interval={interval}"]))[0]
    assert dict(_sync_rows(cfg))["explorer"] == said


# ---------------------------------------------------------------- mode=bench with other eval settings than the run's

def test_a_bench_with_other_eval_settings_than_the_run_says_which(tmp_path):
    """mode=bench of experiments/from_trinity with the eval temperature left at the default (0.0, the
    run's 0.1) evaluated every checkpoint greedily: grpo's last one 0.625 where the run logged 0.605,
    with nothing said (a Trinity-RFT user's bench reads the run's own file)."""
    from rft.plan.batch import stage_configs
    from rft.runtime.bench import eval_differences
    from rft.runtime.rundir import write_config

    run = ["stages=[]", "task=countdown", "buffer.explorer_input.eval_tasksets.0.rollout_args.temperature=0.1"]
    write_config(stage_configs(compose_cfg(run))[0], tmp_path)
    assert eval_differences(stage_configs(compose_cfg(run))[0], "grpo", tmp_path) == []
    # an eval set's repeat_times null is its 1 sample
    assert eval_differences(stage_configs(compose_cfg(
        [*run, "buffer.explorer_input.eval_tasksets.0.repeat_times=1"]))[0], "grpo", tmp_path) == []
    assert eval_differences(stage_configs(compose_cfg(run[:2]))[0], "grpo", tmp_path) == [
        "[bench] warning: stage grpo was evaluated in its run with other settings than this command's, which the "
        "bench uses for its checkpoints: buffer.explorer_input.eval_tasksets.0.rollout_args.temperature: 0.1 -> 0.0. "
        "Give the run's overrides (its task=, experiment=, eval set keys) to evaluate as it did."]
    # task=countdown left off too: another eval set and reward
    (said,) = eval_differences(stage_configs(compose_cfg(["stages=[]"]))[0], "grpo", tmp_path)
    assert ("buffer.explorer_input.default_reward_fn_type: 'countdown' -> 'exact_match'; "
            "buffer.explorer_input.eval_tasksets.0.name: 'countdown_test' -> 'arithmetic_test'") in said


# ---------------------------------------------------------------- a home-relative path on the command line

def test_a_tilde_path_is_told_to_be_quoted_and_the_quoted_form_parses():
    """Trinity-RFT's guide writes paths as the shell does; `path=~/data` did not parse, and the paragraph's
    list of characters to quote left ~ out."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from rft.plan.overlays import unparsable_override

    said = unparsable_override(["buffer.explorer_input.taskset.path=~/data"])
    assert said == (
        "the override 'buffer.explorer_input.taskset.path=~/data' does not parse (LexerNoViableAltException: "
        "buffer.explorer_input.taskset.path=~/data). A value holding any of ( ) [ ] { } , : = ~ ' \" is quoted: "
        "'buffer.explorer_input.taskset.path=\"~/data\"'; a list is [a,b] and a dict {k: v} (Hydra's override grammar).")
    (override,) = OverridesParser.create().parse_overrides(['buffer.explorer_input.taskset.path="~/data"'])
    assert override.value() == "~/data"


# ---------------------------------------------------------------- the study's overlay, run short

STUDY = ["hydra.searchpath=[file://experiments/from_trinity/conf]", "experiment=from_trinity"]


@pytest.mark.slow
def test_train_mode_past_an_explore_jobs_rows_stops_in_one_paragraph(tmp_path, capsys):
    """The README's split on the study's overlay: mode=explore writes 1 step (4 tasks x 8) into a sql
    buffer, mode=train reads it with buffer.total_steps=2: step 1 trains on the 32 stored experiences,
    step 2 finds none. It waited max_read_timeout, then a TimeoutError's traceback; now a warning when
    planning and one paragraph (RunError: exit 1) naming buffer.total_steps=null."""
    import rft.runtime.main
    from rft.errors import RunError
    from rft.reporting.monitor import read_metrics

    common = [*STUDY, "stages=[]", "cluster=inline", "monitor=console", "buffer=sql", "buffer.batch_size=4",
              "buffer.train_batch_size=32", f"checkpoint_root_dir={tmp_path}"]
    cfg = compose_cfg([*common, "mode=explore", "name=gen", "buffer.total_steps=1"])
    inp = cfg.buffer.explorer_input  # the guide's values, as the overlay gives them
    assert (cfg.synchronizer.sync_offset, cfg.synchronizer.sync_interval, cfg.algorithm.kl_loss_fn,
            cfg.algorithm.kl_loss_coef, inp.taskset.rollout_args.temperature,
            inp.eval_tasksets[0].rollout_args.temperature) == (0, 2, "k2", 0.001, 1.0, 0.1)
    rft.runtime.main.main(cfg)
    # it evaluates nothing: the default objective's warning says why (it said only "never logged")
    assert (f"rft: warning: objective=eval/accuracy was never logged in {tmp_path / 'rft' / 'gen' / 'metrics.jsonl'} "
            f"(mode=explore runs no evals: the mode=train job that reads its buffer does), so the run returns None"
            ) in capsys.readouterr().err
    db = tmp_path / "rft" / "gen" / "buffer.db"
    with pytest.raises(RunError) as e:
        rft.runtime.main._main(compose_cfg([*common, "mode=train", "name=learn", "buffer.total_steps=2",
                                            f"buffer.trainer_input.experience_buffer.path={db}",
                                            "buffer.trainer_input.experience_buffer.max_read_timeout=1"]))
    assert str(e.value) == (
        f"step 2 of 2: buffer 'experience_buffer': no experiences arrived within 1.0s (wanted 32). The writer "
        f"(explorer) may have stopped or be slow; raise buffer.trainer_input.experience_buffer.max_read_timeout to "
        f"wait longer. In mode=train the stage has buffer.total_steps=2 steps: if no explore job writes to {db} any "
        f"more, it holds no more; set buffer.total_steps=null (the steps stored) and resume_with_changes=true (the "
        f"same command with both goes on from the newest checkpoint).")
    (step1,) = [m for m in read_metrics(tmp_path / "rft" / "learn" / "metrics.jsonl") if m["step"] == 1]
    assert (step1["train/experiences"], step1["staleness/count_0"]) == (32, 32)


# ---------------------------------------------------------------- a queue buffer's path

def test_a_queue_buffers_path_is_said_not_to_be_written(caplog):
    """Trinity-RFT's guide: a queue's path, if set, is an SQLite or JSON file backing it up. Here a queue
    never reads its path: the user's backup was never written, unsaid."""
    path = "buffer.trainer_input.experience_buffer.path=/runs/b.db"
    assert planned(caplog, ["stages=[]", path], 2000)[1] == [
        "buffer.trainer_input.experience_buffer.path=/runs/b.db is not written: a queue buffer keeps its experiences "
        "in memory only (Trinity-RFT backs a queue up to its path). For a copy on disk use buffer=sql (a SQLite file "
        "at that path, read by `python -m rft.data.buffer`), or remove the path."]
    assert planned(caplog, ["stages=[]", "buffer=sql", path], 2000)[1] == []


# ---------------------------------------------------------------- a misspelt section

@pytest.mark.parametrize("override, hint", [
    # British spellings of a section: the whole key was compared with the section names, no suggestion
    ("synchroniser.sync_interval=2", " Did you mean synchronizer.sync_interval?"),
    ("algorithm.optimiser.lr=1e-6", " Did you mean algorithm.optimizer.lr?"),
    # a leaf's typo as before
    ("buffer.batchsize=8", " Did you mean buffer.batch_size or buffer.train_batch_size?"),
    # the rest of the key no key under the near section: the section alone, as before
    ("synchroniser.foo=1", " Did you mean synchronizer?"),
])
def test_a_misspelt_section_gets_a_did_you_mean(override, hint):
    key = override.split("=")[0]
    section = key.split(".")[0] if key.startswith("synchro") else key.split(".")[1] if "optimiser" in key else "batchsize"
    where = {"synchroniser": "Config", "optimiser": "AlgorithmConfig", "batchsize": "BufferConfig"}[section]
    assert misspelt_override([override], GROUPS) == (
        f"Could not override '{key}': Key '{section}' not in '{where}'.{hint} The keys, each with a comment, are in "
        f"rft/config.py; `python run.py --cfg job` prints the composed config.")


# ---------------------------------------------------------------- the dry run shows how an eval set samples

def test_the_dry_run_shows_each_eval_sets_sampling():
    """The translation's eval temperature (0.1, the guide's) and samples could not be checked in the dry
    run: its rollouts line shows the taskset's temperature, its eval sets line none."""
    from pathlib import Path

    from rft.plan.batch import describe, stage_configs

    said = describe(stage_configs(compose_cfg([*STUDY, "stages=[]"]))[0], Path("/runs/x"))
    assert "\neval sampling  countdown_test: temperature 0.1, top_p 1, 1 sample a task\n" in said
    said = describe(stage_configs(compose_cfg([*STUDY, "stages=[]", "buffer.explorer_input.eval_tasksets.0.repeat_times=4",
                                               "buffer.explorer_input.eval_tasksets.0.rollout_args.temperature=1.0"]))[0],
                    Path("/runs/x"))
    assert "\neval sampling  countdown_test: temperature 1, top_p 1, 4 samples a task\n" in said


# ---------------------------------------------------------------- a stage past the list

@pytest.mark.slow  # 1.8 s alone, over the fast tier's second
def test_a_stage_key_past_the_runs_stage_list_names_the_stages_there_are(capsys):
    """`stages.2.buffer.total_steps=5` on model=tiny's two stages (counting from 1, as a user of a
    list of stages may) was Hydra's "Error merging override ... list index out of range" (exit 1),
    naming no stage; run.py's check now names them."""
    from conftest import CONF

    from rft.plan.overlays import exit_on_config_mistakes

    def said(args):
        with pytest.raises(SystemExit) as e:
            exit_on_config_mistakes(args, CONF)
        assert e.value.code == 2
        return capsys.readouterr().err.strip().removeprefix("rft: configuration error: ")

    assert said(["stages.2.buffer.total_steps=5"]) == (
        "stages.2.buffer.total_steps=5: this command's run has 2 stages, numbered from 0: stages.0 (sft_warmup), "
        "stages.1 (grpo). Name one of them (the list comes from the model or experiment file chosen; "
        "`python run.py --cfg job -p stages` prints it).")
    # the stage list the command composes: an experiment's (its RL stage is rloo), or none at all
    assert said(["-m", "experiment=word_sort", "stages.0.buffer.total_steps=3,4", "stages.3.seed=1"]).startswith(
        "stages.3.seed=1: this command's run has 2 stages, numbered from 0: stages.0 (sft_warmup), stages.1 (rloo).")
    assert said(["stages=[]", "stages.0.buffer.total_steps=3"]) == (
        "stages.0.buffer.total_steps=3: this command's run has no stages list (stages=[], or none in the files "
        "chosen): it is one stage, set by the keys themselves (buffer.total_steps=..., not "
        "stages.0.buffer.total_steps=...).")
    # a stage there is passes (nothing said); a command that does not compose is left to Hydra
    exit_on_config_mistakes(["stages.1.algorithm.optimizer.lr=1e-3"], CONF)
    exit_on_config_mistakes(["seed=1,2", "stages.5.seed=1"], CONF)
    assert capsys.readouterr().err == ""
