"""trainer=fsdp2: two gloo ranks of FSDP2 train exactly as one trainer=torch process does, their
checkpoints are trainer=torch's, and a run with them learns (weights reach the explorers by a
collective broadcast from rank 0)."""

import pytest
import ray
import torch
from conftest import compose_cfg, run_cli
from safetensors.torch import load_file
from test_runtime import base, env_for, evals
from test_trainer import experiences

from rft.errors import ConfigError
from rft.models import build_tiny_model, ensure_model
from rft.plan.batch import make_plan, stage_configs
from rft.plan.placement import check_placement, trainer_ranks
from rft.reporting.monitor import read_metrics
from rft.runtime.actors import ActorGroup, RayActor, start_trainer
from rft.sync.weights import same_weights
from rft.trainer.trainer import Trainer


def configs(*extra):
    """One process and two fsdp2 ranks; the trainer.*_offload keys in `extra` for the ranks only."""
    common = ["stages=[]", "trainer.micro_batch_size_per_gpu=4", "algorithm.optimizer.lr=1e-3", *extra]
    one = stage_configs(compose_cfg([*[o for o in common if "_offload=" not in o], "cluster=inline"]))[0]
    two = stage_configs(compose_cfg([*common, "trainer=fsdp2", "trainer.ranks=2"]))[0]
    ensure_model(one.model)
    return (one, make_plan(one, 2000)), (two, make_plan(two, 2000))


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def fsdp_group(cfg, plan, tmp_path, init_path=None, num_cpus=1, name="trainer", resume=None) -> ActorGroup:
    common = dict(log_dir=str(tmp_path / "log"), level="INFO")
    group = start_trainer(RayActor, cfg, plan, init_path, name, common, [dict(num_cpus=num_cpus)] * 2, resume=resume)
    assert isinstance(group, ActorGroup) and [a.name for a in group.actors] == [f"{name}_0", f"{name}_1"]
    return group


def assert_same_model(weights: dict, model, rtol=1e-4, atol=1e-5):
    """Equal up to summation order. Adam divides each gradient by its own magnitude, so an element
    whose gradient is near 0 moves by an amount summation order can change: a few such elements
    differ by ~3e-6 after an lr 1e-3 step (atol 1e-5: 1% of a step)."""
    own = model.state_dict()
    assert set(weights) == set(own)
    for k, v in own.items():
        torch.testing.assert_close(weights[k], v, rtol=rtol, atol=atol, msg=k)


@pytest.mark.slow  # a real engine, Ray or training run
@pytest.mark.parametrize("extra", [["trainer.param_offload=true", "trainer.optimizer_offload=true",
                                    "trainer.use_dynamic_bsz=true", "trainer.max_token_len_per_gpu=60"],
                                   ["algorithm=ppo", "algorithm.critic_warmup=0"]],
                         ids=["offload+token_budget", "ppo"])
def test_two_ranks_update_the_model_as_one_process_does(local_ray, tmp_path, extra):
    # (the plain config: test_checkpoints_are_trainer_torch_checkpoints_both_ways, from the same two steps)
    m_two, _, _ = two_ranks_as_one_process(tmp_path, extra)
    assert m_two["train/experiences"] == 9  # the last step's rows, split 5 + 4 over the ranks


@pytest.mark.slow  # a teacher built, a Ray run
def test_two_ranks_distil_with_the_jsd_as_one_process_does(local_ray, tmp_path):
    # each rank computes the teacher's top tokens of its own rows; summed over the ranks, every
    # rank holds the whole step's table (rft.trainer.step StepMixin._old_and_ref_logp)
    teacher = build_tiny_model(tmp_path / "teacher", seed=1)
    m_two, _, _ = two_ranks_as_one_process(tmp_path, ["algorithm=opd", "algorithm.repeat_times=8",
                                                      f"algorithm.teacher_model_path={teacher}",
                                                      "algorithm.distill_divergence=jsd", "algorithm.distill_top_k=5"],
                                           extra_keys=("distill/jsd", "distill/reverse_kl"))
    assert m_two["distill/jsd"] > 1e-4


def two_ranks_as_one_process(tmp_path, extra, extra_keys=()):
    """Two steps (128 rows, then 9) on one process and on two fsdp2 ranks: the same metrics
    (`extra_keys` too) and the same weights. Returns the ranks' last metrics, the process's
    Trainer and the ranks' group."""
    (one_cfg, one_plan), (two_cfg, two_plan) = configs(*extra)
    # 128 experiences, micro-batches of 4: each rank 64 rows in 16 passes (or, with a budget of
    # 60 tokens, about 3 rows of 16-21 tokens a pass, the ranks' shares balanced by tokens)
    assert (one_plan.micro_batches_per_update, two_plan.micro_batches_per_update, two_plan.dp_size) == (32, 16, 2)
    one = Trainer(one_cfg, one_plan)
    two = fsdp_group(two_cfg, two_plan, tmp_path)
    # the shards' sums add up to the whole model's fingerprint
    assert same_weights(two.call("fingerprint"), one.fingerprint())
    batch = experiences()
    # 128 rows, then 9: ceil(9 / 2) = 5 rows per rank; rank 0 takes 4 + 1, rank 1 takes 4 and
    # runs one dead pass so that both run 2 (otherwise the ranks' collectives would not pair up)
    for rows in (batch, batch[:9]):
        m_one, m_two = one.train_step(rows), two.call("train_step", rows)
        critic = [k for k in ("critic/value_loss", "critic/values_mean", "critic/explained_variance") if k in m_one]
        assert len(critic) == (3 if "algorithm=ppo" in extra else 0)
        keys = ["loss/policy", "actor/grad_norm", *critic, *extra_keys]
        # the second step's rows are one step stale: one process corrects them in the update and
        # still sets aside the zero-advantage rows, the ranks forward every row for the old
        # log-probs (rft.trainer.step StepMixin._old_is_current); the same gradient, but the metrics over the
        # tokens computed (entropy, clip fraction, approx KL) then cover other rows
        if m_one["train/zero_advantage_rows_skipped"] == m_two["train/zero_advantage_rows_skipped"]:
            keys += ["actor/entropy", "actor/clip_frac", "actor/approx_kl"]
        else:
            assert rows is not batch and m_two["train/zero_advantage_rows_skipped"] == 0
        for key in keys:
            assert m_two[key] == pytest.approx(m_one[key], rel=1e-4, abs=1e-6), key
        assert m_two["train/experiences"] == len(rows)
        assert_same_model(two.call("weights"), one.model)
    assert m_one["actor/grad_norm"] > 0.01  # the steps did move the weights
    return m_two, one, two


@pytest.mark.slow  # a real engine, Ray or training run
def test_a_dead_rank_is_reported_as_a_dead_actor(local_ray, tmp_path):
    # not as rank 0's failed collective (gloo: "connection reset by peer"; nccl would wait out the
    # timeout): RayActorError is what makes the runner say "the trainer actor died ... resume"
    _, (cfg, plan) = configs("synchronizer.sync_timeout=60")
    group = fsdp_group(cfg, plan, tmp_path)
    group.call("get_version")
    ray.kill(group.actors[1].actor)
    with pytest.raises(ray.exceptions.RayActorError) as e:
        group.call("train_step", experiences())
    group.kill()
    # the run's last message names the rank that died and its log
    from rft.runtime.faults import TrainerCalls

    message = str(TrainerCalls(group, tmp_path).died(e.value))
    assert message.startswith(f"the trainer actor died ({type(e.value).__name__}: trainer_1, its log "
                              f"{tmp_path / 'log' / 'trainer_1.log'}). Its newest checkpoint: none yet"), message


@pytest.mark.slow  # a real engine, Ray or training run
def test_checkpoints_are_trainer_torch_checkpoints_both_ways(local_ray, tmp_path):
    # from two steps of the plain config, where the ranks train as one process does
    m_two, one, two = two_ranks_as_one_process(tmp_path, [])
    assert m_two["train/experiences"] == 9  # the last step's rows, split 5 + 4 over the ranks
    (one_cfg, one_plan), (two_cfg, two_plan) = configs()
    batch = experiences()
    (tmp_path / "from_fsdp").mkdir()
    two.call("save", str(tmp_path / "from_fsdp"))
    # 2 fresh ranks resume it: the whole model and Adam state, each rank keeping its shard; built
    # for it as a resumed stage builds them, they read its weights as they build, and the load not again
    again = fsdp_group(two_cfg, two_plan, tmp_path / "again", num_cpus=0, name="again",  # beside `two` on 2 CPUs
                       resume=str(tmp_path / "from_fsdp"))
    again.call("load", str(tmp_path / "from_fsdp"))
    assert again.call("get_version") == 2 and same_weights(again.call("fingerprint"), two.call("fingerprint"))
    w_again, w_two = again.call("weights"), two.call("weights")
    assert all(torch.equal(w_again[k], w_two[k]) for k in w_two)  # to the bit
    m_two, m_again = two.call("train_step", batch[:64]), again.call("train_step", batch[:64])
    assert m_again["loss/policy"] == pytest.approx(m_two["loss/policy"], rel=1e-5, abs=1e-7)
    w_again, w_two = again.call("weights"), two.call("weights")
    for k in w_two:
        torch.testing.assert_close(w_again[k], w_two[k], rtol=1e-5, atol=1e-6, msg=k)
    again.kill()
    # trainer=torch resumes the FSDP checkpoint (one rank): same weights, same Adam moments
    resumed = Trainer(one_cfg, one_plan)
    resumed.load(str(tmp_path / "from_fsdp"))
    assert resumed.version == 2
    assert_same_model(resumed.model.state_dict(), one.model)
    for (a, b) in zip(resumed.optimizer.state.values(), one.optimizer.state.values()):
        torch.testing.assert_close(a["exp_avg_sq"], b["exp_avg_sq"], rtol=1e-3, atol=1e-12)
    # and the ranks resume trainer=torch's checkpoint: the next step matches one's
    (tmp_path / "from_torch").mkdir()
    one.save(str(tmp_path / "from_torch"))
    two.call("load", str(tmp_path / "from_torch"))
    assert two.call("get_version") == 2
    assert_same_model(two.call("weights"), one.model, rtol=0, atol=0)
    m_one, m_two = one.train_step(batch[:64]), two.call("train_step", batch[:64])
    assert m_two["loss/policy"] == pytest.approx(m_one["loss/policy"], rel=1e-4, abs=1e-6)
    assert_same_model(two.call("weights"), one.model)
    # checkpoint sync: rank 0 writes the whole model; the fingerprint is the whole model's
    fp = two.call("save_weights", str(tmp_path / "sync.safetensors"))
    assert fp == two.call("fingerprint")
    saved, whole = load_file(tmp_path / "sync.safetensors"), two.call("weights")
    assert all(torch.equal(saved[k], whole[k]) for k in saved) and "model.norm.weight" in saved


@pytest.mark.slow  # three ranks built in turn, one step each
def test_a_rank_built_for_its_checkpoint_resumes_masters_reference_and_critic_bit_for_bit(tmp_path):
    """An fsdp2 rank built as a resumed stage builds it (Trainer's `resume`): float32 masters read
    from hf/, the reference from the starting model, the critic without weights until its own come
    from trainer_state.pt. Its next step is the saved rank's, to the bit: the policy's, the
    reference's KL and the critic's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from test_mixed_precision import MASTERS, one_rank

    args = ("algorithm=ppo", "algorithm.critic_warmup=0", "algorithm.critic_lr=1e-3", "algorithm.kl_loss_fn=k3",
            "algorithm.kl_loss_coef=0.1", *MASTERS)
    whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
    after = []
    for resume in (None, tmp_path):
        t = one_rank(*args, lr=1e-4, resume=resume and str(resume))
        try:
            if resume is None:
                t.train_step(experiences())
                t.save(str(tmp_path))
            else:
                t.load(str(tmp_path))
            torch.set_rng_state(torch.load(tmp_path / "trainer_state.pt", weights_only=True)["rng"])
            m = t.train_step(experiences(seed=1))
            after.append((m, t.fingerprint(), t._full_state(), get_model_state_dict(t.critic.model, options=whole)))
        finally:
            t.close()
    (m_saved, fp_saved, policy_saved, critic_saved), (m, fp, policy, critic) = after
    assert m["actor/kl"] > 0 and m["critic/value_loss"] > 0
    assert all(m[k] == m_saved[k] for k in ("loss/policy", "actor/kl", "critic/value_loss", "actor/grad_norm"))
    assert fp == fp_saved and all(torch.equal(v, policy_saved[k]) for k, v in policy.items())
    assert all(torch.equal(v, critic_saved[k]) for k, v in critic.items())


@pytest.mark.slow
def test_fsdp2_ranks_and_their_errors():
    # CPU-only: two ranks by default, each a Ray actor with its CPUs
    cfg = compose_cfg(["stages=[]", "trainer=fsdp2"])
    assert trainer_ranks(cfg) == 2
    assert len(check_placement(cfg).bundles) == 3  # two ranks + one explorer
    # on GPUs: one rank per GPU the explorers leave (2 nodes x 4 GPUs - 2 engines x TP 2 = 4)
    gpu = ["cluster.node_num=2", "cluster.gpu_per_node=4", "explorer.rollout_model.engine_num=2",
           "explorer.rollout_model.tensor_parallel_size=2"]
    cfg = compose_cfg(["stages=[]", "trainer=fsdp2", *gpu])
    assert trainer_ranks(cfg) == 4 and check_placement(cfg).trainer_gpus == 4

    def error(*overrides):
        with pytest.raises(ConfigError) as e:
            make_plan(compose_cfg(["stages=[]", "trainer=fsdp2", *overrides]), 2000)
        return str(e.value)

    assert error("cluster=inline") == (
        "trainer.ranks=2 (trainer_strategy=fsdp2) needs a process per rank, but cluster.backend=inline "
        "runs everything in this one process. Use cluster=local (or cluster=ray), or trainer.ranks=1.")
    assert error(*gpu, "trainer.ranks=5") == (
        "trainer.ranks=5 needs a GPU each, but the explorers (engine_num 2 x tensor_parallel_size 2 = 4) "
        "leave 4 of cluster.node_num x gpu_per_node = 8. Lower trainer.ranks (null takes what is left) or "
        "engine_num.")
    assert error("trainer=torch", "trainer.param_offload=true") == (
        "trainer.param_offload=true needs trainer=fsdp2 (FSDP2 moves the shards between CPU and device; "
        "trainer=torch keeps everything on its device). Use trainer=fsdp2 (trainer.ranks=1 for one process) "
        "or set trainer.param_offload=false.")
    assert error("trainer.ranks=0") == "trainer.ranks=0 must be >= 1 (or null for the default)."


@pytest.mark.slow
def test_a_grpo_run_with_two_fsdp2_ranks_learns(warm_start, tmp_path):
    r = run_cli(*base(warm_start, "fsdp2", "trainer=fsdp2", "sync=collective", "cluster.num_cpus=3",
                      "buffer.total_steps=6", "explorer.eval_interval=6", "trainer.save_interval=6"),
                env=env_for(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "rft" / "fsdp2"
    metrics = read_metrics(run / "metrics.jsonl")
    assert [m["sync/version"] for m in metrics[1:]] == [1, 2, 3, 4, 5, 6]
    first, last = evals(metrics)[0], evals(metrics)[-1]
    assert last >= first + 0.1, (first, last)
    for rank in (0, 1):
        assert "started in process" in (run / "log" / f"grpo_trainer_{rank}.log").read_text()
    # the checkpoint is an ordinary Hugging Face model
    assert (run / "checkpoints" / "step_6" / "hf" / "model.safetensors").exists()


# a PPO run on two ranks, its critic sharded and gathered into the checkpoint: the Ray case of
# tests/test_resume_matrix.py (fsdp2-two-ranks-ppo-lora-collective), which also resumes it bit for bit
