"""The dry run's placement against a local Ray instance's CPUs, files a run reads back bounded,
misspelt keys in free-form args, and trainer=fsdp2's critic state checked on resume."""

import pytest
from conftest import compose_cfg

import rft.runtime.main
from rft.errors import ConfigError

RM = ("buffer.explorer_input.taskset.reward_fn=[{fn: exact_match, weight: 1}, "
      "{fn: reward_model, weight: 0.5, args: {model_path: '/m/rm', num_cpus: 2}}]")


def test_the_dry_run_refuses_actors_a_local_ray_instance_cannot_place(tmp_path):
    """cluster.num_cpus=3 for trainer 1 + engine 1 + a reward model of args.num_cpus=2 = 4 CPUs: the
    dry run passed it and the run stopped once Ray had started; now the dry run says so, in the words
    the start uses (rft.plan.placement.check_resources, one check for both)."""
    with pytest.raises(ConfigError) as e:
        rft.runtime.main._main(compose_cfg(["dry_run=true", "cluster.num_cpus=3", f"checkpoint_root_dir={tmp_path}", RM]))
    assert str(e.value) == (
        "stage grpo: the actors need 4 CPU (cluster.cpus_per_actor=1, gpu_per_node=0, "
        "explorer.rollout_model.engine_num=1, colocate=False, reward model workers=1) but the Ray cluster has 3. "
        "Lower those, or start Ray with more (cluster.num_cpus for a local instance: it may exceed this machine's "
        "cores, e.g. cluster.num_cpus=4; or cluster=inline).")


def test_the_dry_runs_placement_row_lists_the_reward_model_workers(tmp_path, capsys):
    """They reserve CPUs (or a GPU) like the actors; the row named the engines and the trainer alone."""
    rft.runtime.main._main(compose_cfg(["dry_run=true", "cluster.num_cpus=4", f"checkpoint_root_dir={tmp_path}", RM]))
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("placement")]
    # the warm-up stage has no reward model; the grpo stage's 4 CPUs fit cluster.num_cpus=4
    assert "reward model" not in rows[0]
    assert rows[1].endswith("trainer torch, 1 rank; reward model buffer.explorer_input.taskset.reward_fn[1].args "
                            "on 2 CPU (args.num_cpus); weights by sync=memory")


@pytest.mark.parametrize("args, cluster, place", [
    ("num_cpus: 2", "cluster.gpu_per_node=3", "on a GPU of its own"),
    ("colocate: true", "cluster.gpu_per_node=2", "sharing bundle 0 (args.colocate)"),
    ("num_cpus: 2", "cluster.colocate=true", "sharing the one bundle"),
])
def test_the_placement_row_says_where_a_reward_model_goes(args, cluster, place):
    from rft.plan.memory import _placement

    cfg = compose_cfg(["stages=[]", RM.replace("num_cpus: 2", args), cluster])
    assert f"reward model buffer.explorer_input.taskset.reward_fn[1].args {place}" in _placement(cfg)


def test_without_num_cpus_the_plan_leaves_the_count_to_ray():
    """cluster.num_cpus null is every CPU of the machine Ray starts on, which the plan's may not be:
    counted at start (ray.cluster_resources()), not here; a cluster the run joins likewise."""
    from rft.plan.placement import check_placement, local_resources

    assert local_resources(compose_cfg(["stages=[]", RM])) is None
    assert local_resources(compose_cfg(["stages=[]", "cluster=ray", RM])) is None
    assert local_resources(compose_cfg(["stages=[]", "cluster.num_cpus=4"])) == {"CPU": 4, "GPU": 0}
    assert len(check_placement(compose_cfg(["stages=[]", RM])).bundles) == 3  # 1 + 1 + the reward model's 2 CPUs


def _huge(path, size=256 << 20):
    """A sparse file of `size` bytes (no disk taken): a damaged or planted record."""
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def _peak(fn):
    """fn()'s result and the most memory Python held meanwhile, in MiB."""
    import tracemalloc

    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1] / (1 << 20)
    finally:
        tracemalloc.stop()


def test_a_huge_report_json_is_not_a_report_and_is_not_read_whole(tmp_path):
    """A 256 MiB report.json was read whole (256 MiB of bytes, then as much text) before it failed to
    parse; read_record stops at its 64 MiB bound: not a report, so the pipeline runs again."""
    from rft.data.pipeline import _read_report

    _huge(tmp_path / "report.json")
    got, peak = _peak(lambda: _read_report(tmp_path))
    assert got is None
    assert peak < 100  # the bound's 64 MiB + 1 read, not 256 + 256


def test_a_huge_safetensors_index_is_the_paragraph_not_read_whole(tmp_path):
    from rft.sync.weights import hf_weight_files

    def read():
        with pytest.raises(ConfigError) as e:
            hf_weight_files(tmp_path)
        return e

    index = _huge(tmp_path / "model.safetensors.index.json")
    e, peak = _peak(read)
    assert peak < 100  # the bound's 64 MiB + 1 read, not 256 + 256
    assert str(e.value) == (
        f"{index} does not read as a safetensors index, {{\"weight_map\": {{<tensor>: <shard file>}}}} (OSError: "
        f"[Errno 27] larger than 67108864 bytes, which no record rft writes is: '{index}'). Save the model again "
        f"with save_pretrained, or remove the index where {tmp_path} holds one model.safetensors.")


@pytest.mark.parametrize("answer, why", [
    ('{"sizes": [[12, 3', "JSONDecodeError: Expecting ',' delimiter: line 1 column 18 (char 17)"),  # cut short
    (None, "OSError: [Errno 27] larger than 67108864 bytes, which no record rft writes is: '{path}'"),
    ('[1, 2]', "[1, 2]"),  # parses, but is no answer
])
def test_a_damaged_answer_from_the_sizes_child_is_a_run_error(monkeypatch, answer, why):
    """The child that counts a sweep's datasets (job_sizes_in_child) writes its answer last; one cut
    short (the child killed as it wrote) was json's traceback in the parent."""
    import subprocess

    from rft.errors import RunError
    from rft.runtime.main import job_sizes_in_child

    seen = {}

    def child(argv, **_):
        path = seen["path"] = argv[-1]
        if answer is None:
            _huge(path)
        else:
            open(path, "w").write(answer)
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(subprocess, "run", child)
    with pytest.raises(RunError) as e:
        job_sizes_in_child([([], [])])
    assert str(e.value) == ("checking the stages' datasets in a child process failed (exit 0); its answer did "
                            f"not read back ({why.format(path=seen['path'])}).")


def test_a_misspelt_env_arg_is_told_its_near_match():
    """workflow_args' own keys got 'Did you mean'; the environment's (env_args) only the signature."""
    from rft.rollout.workflows.multi_turn import check_args

    where = "buffer.explorer_input.taskset.workflow_args"
    with pytest.raises(ConfigError) as e:
        check_args({"env": "calculator", "env_args": {"max_tool_call": 2}}, where)
    assert str(e.value) == (
        f"{where}.env_args={{'max_tool_call': 2}} does not fit calculator(max_tool_calls: 'int' = 4) (got an unexpected "
        f"keyword argument 'max_tool_call'). Give the keyword arguments its constructor takes. Did you mean "
        f"max_tool_calls (not max_tool_call)?")


@pytest.mark.parametrize("name", ["lamda", "lambda", "gae_lambda"])
def test_gaes_lambda_given_as_an_advantage_arg_points_to_algorithm_lam(tmp_path, name):
    """verl's, TRL's and others' spellings of GAE's lambda under algorithm.advantage_args: gae takes no
    arguments (it reads algorithm.lam from cfg), so the message listed [] and, with one stage, told
    the user to move the key into 'stages.0' of a config without stages."""
    with pytest.raises(ConfigError) as e:
        rft.runtime.main._main(compose_cfg(["algorithm=ppo", "stages=[]", f"+algorithm.advantage_args.{name}=0.95",
                                            "dry_run=true", f"checkpoint_root_dir={tmp_path}"]))
    assert str(e.value) == (
        f"algorithm.advantage_args has ['{name}'], which algorithm.advantage_fn=gae does not take; its own arguments "
        f"are [] (the rest of its settings are the algorithm.* keys it reads from cfg). Did you mean algorithm.lam "
        f"(not {name})? That is a key of algorithm itself, which the function reads from cfg, not an argument: set "
        f"algorithm.lam=<value>, and drop {name} from the args.")


def test_with_stages_an_algorithm_key_given_as_an_arg_is_not_told_to_move_between_stages(tmp_path):
    """Set globally, advantage_args.lamda reaches the warm-up stage first; the merged-args hint (set it
    in the entry of the stage whose function takes it) would send the user to the grpo stage, whose
    function does not take it either."""
    with pytest.raises(ConfigError) as e:
        rft.runtime.main._main(compose_cfg(["+algorithm.advantage_args.lamda=0.95", "dry_run=true",
                                            f"checkpoint_root_dir={tmp_path}"]))
    assert str(e.value).startswith("stage sft_warmup: algorithm.advantage_args has ['lamda']")
    assert str(e.value).endswith("Did you mean algorithm.lam (not lamda)? That is a key of algorithm itself, which "
                                 "the function reads from cfg, not an argument: set algorithm.lam=<value>, and drop "
                                 "lamda from the args.")


def test_an_own_argument_misspelt_is_named_as_before():
    """A name near one of the function's own arguments is that argument, not a key of algorithm."""
    from rft.config import near_args

    assert near_args(["epsilonn"], ["epsilon"], section="algorithm") == " Did you mean epsilon (not epsilonn)?"
    assert near_args(["zzz"], ["epsilon"], section="algorithm") == ""
    assert near_args(["lamda"], ["epsilon"]) == ""  # no section: free-form args of no schema section


@pytest.mark.slow  # two fsdp2 ranks built in turn, one step
def test_an_fsdp2_critic_state_of_another_shape_is_refused_before_anything_loads(tmp_path):
    """algorithm=ppo on trainer=fsdp2: the critic's part of trainer_state.pt goes through check_state
    as trainer=torch's does (tests/test_critic_state.py); its optimizer's state is keyed by parameter
    name here, and set_optimizer_state_dict would take moments of another shape."""
    import torch
    from test_mixed_precision import one_rank
    from test_read_back2 import edited
    from test_trainer import experiences

    from rft.trainer.state import CheckpointFileError

    def critic_moment(state):  # the first moment of the critic's first parameter tripled: [3, *shape]
        m = next(iter(state["critic"]["optimizer"]["state"].values()))
        m["exp_avg"] = torch.zeros(3, *m["exp_avg"].shape)

    saved, ppo = tmp_path / "saved", ("algorithm=ppo", "algorithm.critic_warmup=0")
    saved.mkdir()
    t = one_rank(*ppo)
    try:
        t.train_step(experiences())
        t.save(str(saved))
    finally:
        t.close()
    state = torch.load(saved / "trainer_state.pt", weights_only=True)["critic"]["optimizer"]
    name = next(iter(state["state"]))
    assert isinstance(name, str)  # keyed by name, not torch's positions
    shape = list(state["state"][name]["exp_avg"].shape)
    (tmp_path / "moment").mkdir()
    ckpt = edited(saved, tmp_path / "moment", critic_moment)
    fresh = one_rank(*ppo)
    try:
        before = fresh.fingerprint()
        with pytest.raises(CheckpointFileError) as e:
            fresh.load(str(ckpt))
        assert str(e.value) == (f"{ckpt / 'trainer_state.pt'} does not load (its critic's optimizer's exp_avg of "
                                f"parameter 0 has shape {[3, *shape]}, the parameter {shape}: the trainer never saves "
                                f"one so)")
        assert fresh.fingerprint() == before and fresh.version == 0
        fresh.load(str(saved))  # as saved: loads
        assert fresh.version == 1
    finally:
        fresh.close()
