"""The online curriculum (rft/data/curriculum.py) learns of every task it drew, also of one that
left no experience in the step's batch: a task whose reward always raises (the workflow returns
None for it), or whose group DAPO's dynamic sampling dropped as flat. Through the real path from a
draw to `observe`: Schedule._submit_explores draws, ExplorerPool.submit/collect, Explorer.explore
(its workflow and reward, retries and all, on canned responses: no model), Schedule._collect."""

from collections import Counter
from types import SimpleNamespace

import pytest
from conftest import compose_cfg

from rft.data.experience import Experience

TASKS = 4


def canned(tasks, engine, ctx):
    """A workflow without a model: responses "0" .. "n-1" per task, scored by the taskset's reward
    through ctx.score (its retries; a task whose reward keeps raising comes back None)."""
    rewards = ctx.score([("q", [str(i) for i in range(ctx.n)], t) for t in tasks])
    return [None if rs is None else
            [Experience([0, 1], 1, [0.0], reward=r, task_id=t.task_id, group_id=f"{ctx.step}/{ctx.seed}/{t.task_id}",
                        info={"response": str(i)}) for i, r in enumerate(rs)]
            for t, rs in zip(tasks, rewards)]


def row_0_raises(prompt, response, task):
    """Task 0's reward always raises; the others always pass."""
    if task.task_id.endswith("/0"):
        raise ValueError("no answer column")
    return 1.0


def flat_or_mixed(prompt, response, task):
    """Task 0 always fails and task 3 always passes (flat groups: all rewards equal); tasks 1 and 2
    pass on response "0" only (a group of 1, 0: a learning signal)."""
    row = int(task.task_id.rpartition("/")[2])
    return {0: 0.0, 3: 1.0}.get(row, float(response == "0"))


class Inline:
    """An explorer actor whose calls run when submitted (as cluster=inline runs them)."""

    def __init__(self, explorer):
        self.explorer = explorer

    def submit(self, method, *args):
        return getattr(self.explorer, method)(*args)

    def get(self, future):
        return future


def driver(reward: str, *overrides: str):
    """The driver's Schedule over one explorer of TASKS canned tasks, the curriculum on (batch_size
    2, 2 rollouts per task, window 4, eps 0.05)."""
    from rft.data.curriculum import make_curriculum
    from rft.data.pipeline import ExperiencePipeline, experience_operators
    from rft.rewards.scoring import build, spec_of
    from rft.rollout.explorer import Explorer
    from rft.runtime.explorers import ExplorerPool
    from rft.runtime.schedule import Schedule, reward_norm

    cfg = compose_cfg(["cluster=inline", "synchronizer.sync_offset=0", "buffer.batch_size=2", "algorithm.repeat_times=2",
                       "data_processor.online_curriculum.enable=true", "data_processor.online_curriculum.window=4",
                       "data_processor.online_curriculum.eps=0.05", "explorer.max_retry_times=1",
                       "buffer.explorer_input.taskset.workflow=test_curriculum_observe.canned",
                       f"buffer.explorer_input.default_reward_fn_type=test_curriculum_observe.{reward}", *overrides])
    ts = cfg.buffer.explorer_input.taskset
    ex = object.__new__(Explorer)
    ex.cfg, ex.tokenizer, ex.version, ex.shard, ex.num_shards = cfg, None, 0, 0, 1
    ex.engine, ex.partial, ex.sync_s, ex._openai, ex.auxiliary = SimpleNamespace(busy_s=0.0), None, {}, None, {}
    ex.taskset = [SimpleNamespace(task_id=f"{ts.name}/{i}", messages=[], answer="1", row={}) for i in range(TASKS)]
    ex.scorer = build(spec_of(ts.reward_fn, cfg.buffer.explorer_input.default_reward_fn_type), "reward")
    run = object.__new__(Schedule)
    run.cfg, run.plan, run.next_explore, run.explore_metrics = cfg, SimpleNamespace(total_steps=1000), 0, {}
    run.pool = ExplorerPool(cfg, [Inline(ex)], None, None, synced=0, monitor=None, stage_dir=None, title="t", owner=None)
    run.curriculum = make_curriculum(cfg, TASKS)
    run.reward_norm = reward_norm(cfg, {})
    run.experience_pipeline = ExperiencePipeline(experience_operators(cfg))
    run.signal, run.buffer = SimpleNamespace(check=lambda step, m, last: None), SimpleNamespace(put=lambda exps: None)
    return run


def step(run, s: int) -> list[int]:
    """Explore step s as the driver makes it: drawn, explored, collected; the rows drawn."""
    run._submit_explores(s + 1)  # sync_offset=0: training step s + 1 submits explore step s
    rows = run.pool.pending[-1].rows
    run._collect()
    return rows


def test_a_task_whose_reward_always_raises_counts_as_failed_not_unseen():
    run = driver("row_0_raises")
    cur = run.curriculum
    # step 0 draws with every task unseen (weight 0.3 each); the tasks it did not draw stay unseen
    rows = step(run, 0)
    assert sorted(cur.outcomes) == sorted(rows)
    for r in rows:  # 2 rollouts each: task 0's reward raised (each rollout a fail), the others passed
        assert cur.outcomes[r] == ([0, 0] if r == 0 else [1, 1])
    assert all(cur.weights()[r] == pytest.approx(0.3) for r in range(TASKS) if r not in rows)
    draws = Counter(rows)
    for s in range(1, 200):
        rows = step(run, s)
        draws.update(rows)
        # the failure is still counted as one: task 0's group failed, none of its rollouts kept
        assert run.explore_metrics[s]["rollout/failed_tasks"] == (0 in rows)
    # task 0 has failed every time (p = 0), tasks 1-3 passed (p = 1): each weighs 0 + eps = 0.05, the
    # draws uniform, each task 1/4 of them. Unseen, task 0 kept p = 0.5 (0.3 against 3 x 0.05) and
    # was in 1 - (1/3)(1/4) = 11/12 of the steps: 11/24 = 0.458 of the draws. 400 draws: the share's
    # standard error sqrt(0.25 * 0.75 / 400) = 0.022; 0.07 is 3 of them
    assert cur.pass_rate(0) == 0.0 and cur.outcomes[0] == [0, 0, 0, 0]
    assert cur.weights() == pytest.approx([0.05] * TASKS)
    assert draws[0] / 400 == pytest.approx(0.25, abs=0.07)


def test_groups_dynamic_sampling_dropped_as_flat_count_with_their_rewards():
    """DAPO's dynamic sampling (max tries 3) drops the flat groups of tasks 0 (always 0) and 3
    (always 1) when it finds groups with a signal; the curriculum still learns that task 0 fails and
    task 3 passes, from the rewards they got (a pass is a pass, dropped or not)."""
    run = driver("flat_or_mixed", "algorithm.dynamic_sampling_max_tries=3")
    cur = run.curriculum
    for s in range(30):
        step(run, s)
    assert cur.outcomes[0] == [0, 0, 0, 0] and cur.outcomes[3] == [1, 1, 1, 1]
    # tasks 1 and 2: one pass and one fail per group of 2
    assert cur.outcomes[1] == cur.outcomes[2] == [1, 0, 1, 0]
    assert cur.weights() == pytest.approx([0.05, 0.3, 0.3, 0.05])


HANG = __import__("threading").Event()


def row_0_slow(prompt, response, task):
    """Task 0's reward waits (for HANG, at most 30 s): explorer.over_rollout drops it every step, as
    the slowest; the others pass at once."""
    if task.task_id.endswith("/0"):
        HANG.wait(30)
    return 1.0


def test_a_task_over_rollout_drops_for_being_slow_is_no_observation():
    """explorer.over_rollout.ratio=0.25 of the 4 tasks a step (batch_size 4: each step draws them
    all) waits for ceil(0.75 x 4) = 3, then wait_after_min=0 s more: task 0, whose reward is slow,
    is dropped every step, tasks 1-3 always kept. Its rollouts never finished, so they say nothing
    of its pass rate: it stays unseen (p = 0.5, weight 0.25 + 0.05 = 0.3). It was recorded as failed
    ([0, 0, 0, 0], weight 0.05): a slow task's draws rose or fell by its timing."""
    run = driver("row_0_slow", "buffer.batch_size=4", "explorer.over_rollout.ratio=0.25",
                 "explorer.over_rollout.wait_after_min=0", "explorer.runner_per_model=4")
    cur = run.curriculum
    try:
        for s in range(3):
            assert sorted(step(run, s)) == [0, 1, 2, 3]
            assert run.explore_metrics[s]["rollout/over_rollout_dropped"] == 1
            assert run.explore_metrics[s]["rollout/failed_tasks"] == 0
    finally:
        HANG.set()  # the dropped calls' threads end
    assert 0 not in cur.outcomes
    assert cur.outcomes == {1: [1, 1, 1, 1], 2: [1, 1, 1, 1], 3: [1, 1, 1, 1]}  # window 4: 2 rollouts x 3 steps, the last 4
    assert cur.weights() == pytest.approx([0.3, 0.05, 0.05, 0.05])
