"""Which tasks an explore step runs when DAPO's dynamic sampling draws more (algorithm.
dynamic_sampling_max_tries): the extra tasks follow the run's own draw (the online curriculum's
weights, the task pipeline's curriculum_order), never repeat a task of the step, and two explorers
never run the same one. Through Explorer.explore on a workflow that records the tasks it is given
(no model)."""

from collections import Counter
from types import SimpleNamespace

import pytest
from conftest import compose_cfg

from rft.data.experience import Experience

CALLS: list[list[int]] = []  # the task rows of each workflow call, in order


def recorded(tasks, engine, ctx):
    """Every rollout's reward 0: every group flat, so dynamic sampling uses all its tries."""
    CALLS.append([int(t.task_id.rpartition("/")[2]) for t in tasks])
    return [[Experience([0, 1], 1, [0.0], reward=0.0, task_id=t.task_id, group_id=f"{ctx.seed}/{t.task_id}", info={})
             for _ in range(ctx.n)] for t in tasks]


def config(*overrides: str):
    return compose_cfg(["cluster=inline", "algorithm.repeat_times=2", "buffer.explorer_input.taskset.workflow=test_draws.recorded",
                        *overrides])


def explorer(cfg, n_tasks: int, shard: int = 0, shards: int = 1):
    """An Explorer over `n_tasks` canned tasks, without an engine (the workflow needs none)."""
    from rft.rewards.scoring import build, spec_of
    from rft.rollout.explorer import Explorer

    ts = cfg.buffer.explorer_input.taskset
    ex = object.__new__(Explorer)
    ex.cfg, ex.tokenizer, ex.version, ex.shard, ex.num_shards = cfg, None, 0, shard, shards
    ex.engine, ex.partial, ex.sync_s, ex._openai, ex.auxiliary = SimpleNamespace(busy_s=0.0), None, {}, None, {}
    ex.taskset = [SimpleNamespace(task_id=f"{ts.name}/{i}", messages=[], answer="1", row={}) for i in range(n_tasks)]
    ex.scorer = build(spec_of(ts.reward_fn, cfg.buffer.explorer_input.default_reward_fn_type), "reward")
    return ex


def explored(ex, step: int, rows=None) -> tuple[list[list[int]], dict]:
    """The rows of each try of `ex`'s explore step `step`, and its counters (with the experiences
    it returned under "exps")."""
    CALLS.clear()
    exps, counters = ex.explore(step, *([] if rows is None else [rows]))
    return list(CALLS), {**counters, "exps": exps}


def test_two_explorers_extra_draws_cover_the_taskset_once_a_step():
    """12 tasks, batch_size 4, 3 tries, 2 explorers, every group flat: the step's 4 tasks and its 2
    tries of 4 extras are 12 draws of 12 tasks, so each task runs exactly once a step, on one explorer
    (a uniform draw of 4 from all 12 per try and explorer, as before, repeated one in most steps)."""
    from rft.rollout.explorer import task_rows_of

    cfg = config("buffer.batch_size=4", "algorithm.dynamic_sampling_max_tries=3")
    for step in range(20):
        shards = [explored(explorer(cfg, 12, shard, 2), step) for shard in range(2)]
        for tries, counters in shards:
            assert [len(t) for t in tries] == [2, 2, 2] and counters["max_sampling_tries"] == 3
        # the step's own tasks are those a run without dynamic sampling draws, explorer i taking i, i + 2
        own = task_rows_of(12, 4, step, cfg.seed, False)
        assert [shards[0][0][0], shards[1][0][0]] == [own[0::2], own[1::2]]
        runs = Counter(r for tries, _ in shards for t in tries for r in t)
        assert runs == Counter(range(12)), f"step {step}: {runs}"


def test_tries_stop_when_the_taskset_has_no_task_left_for_the_step():
    """6 tasks, batch_size 4, 5 tries: the step's 4 and the 2 tasks left, then nothing to draw (the
    batch is topped up with flat groups: 4 groups), not a task the step ran already."""
    cfg = config("buffer.batch_size=4", "algorithm.dynamic_sampling_max_tries=5")
    tries, counters = explored(explorer(cfg, 6), 0)
    assert [len(t) for t in tries] == [4, 2] and counters["max_sampling_tries"] == 2
    assert sorted(tries[0] + tries[1]) == list(range(6))
    assert counters["generated"] == 6 * 2  # 6 tasks x repeat_times 2
    assert len(counters["exps"]) == 4 * 2  # the batch: 4 groups of 2


def test_curriculum_order_extras_are_the_rows_after_the_steps(monkeypatch):
    """curriculum_order (the explorers read the rows in order): 10 tasks, batch_size 3, 3 tries. Step 1
    runs rows 3-5 (position 1 % (10 // 3) = 1), and its extras are the rows that follow, 6-8 then 9, 0, 1
    (from the start again), not rows from anywhere in the order."""
    import rft.rollout.explorer as explorer_module

    monkeypatch.setattr(explorer_module, "keeps_order", lambda cfg: True)
    cfg = config("buffer.batch_size=3", "algorithm.dynamic_sampling_max_tries=3")
    assert explored(explorer(cfg, 10), 1)[0] == [[3, 4, 5], [6, 7, 8], [9, 0, 1]]
    assert explored(explorer(cfg, 10), 3)[0] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]  # position 3 % 3 = 0


def curriculum_of(cfg, n_tasks: int, outcomes: dict):
    from rft.data.curriculum import make_curriculum

    cur = make_curriculum(cfg, n_tasks)
    cur.load({"outcomes": outcomes})
    return cur


@pytest.mark.slow  # 1.4 s alone, over the fast tier's second
def test_curriculum_draws_the_extras_and_the_explorers_run_them():
    """With the online curriculum the driver's draw holds the extras (batch_size 2, 3 tries: 6 rows);
    the explorers run its first 2, then 2 and 2 more, in its order, each explorer its share."""
    cfg = config("buffer.batch_size=2", "algorithm.dynamic_sampling_max_tries=3", "data_processor.online_curriculum.enable=true")
    cur = curriculum_of(cfg, 8, {})
    for step in range(10):
        rows = cur.draw(step, 2)
        assert len(rows) == len(set(rows)) == 6
        assert rows[:2] == curriculum_of(config("buffer.batch_size=2", "data_processor.online_curriculum.enable=true"),
                                         8, {}).draw(step, 2)  # the step's own: as without dynamic sampling
        assert explored(explorer(cfg, 8), step, rows)[0] == [rows[0:2], rows[2:4], rows[4:6]]
        assert explored(explorer(cfg, 8, 1, 2), step, rows)[0] == [rows[1:2], rows[3:4], rows[5:6]]
        assert cur.draw(step, 2) == rows  # a function of (seed, step) and the pass rates: a resumed run's


@pytest.mark.slow  # 2.0 s alone, over the fast tier's second
def test_curriculum_extras_follow_its_weights():
    """4 tasks: task 0 unseen (p = 0.5: weight 0.25 + 0.05 = 0.3), tasks 1-3 always solved (weight
    0.05); batch_size 1, 2 tries. The step's task is 0 with probability 0.3 / 0.45 = 2/3; when it is
    not (1/3), the extra is 0 with probability 0.3 / (0.3 + 2 x 0.05) = 3/4: task 0 runs in
    2/3 + 1/3 x 3/4 = 11/12 of the steps (a uniform extra from the 3 others, 7/9; from all 4, 3/4).
    1200 steps: the share's standard error sqrt(11/12 x 1/12 / 1200) = 0.008; 0.03 is ~4 of them."""
    cfg = config("buffer.batch_size=1", "algorithm.dynamic_sampling_max_tries=2", "data_processor.online_curriculum.enable=true")
    cur = curriculum_of(cfg, 4, {"1": "1111", "2": "1111", "3": "1111"})
    ex = explorer(cfg, 4)
    with_0 = sum(0 in sum(explored(ex, step, cur.draw(step, 1))[0], []) for step in range(1200))
    assert with_0 / 1200 == pytest.approx(11 / 12, abs=0.03)


def test_sampling_tries_is_the_most_an_explorer_took_not_their_sum():
    """2 explorers, 3 tries each (every group flat): rollout/sampling_tries is 3, at most max_tries
    (summed over the explorers as the other counters are, it read 6); rollout/generated is their sum,
    12 tasks x 2 rollouts = 24."""
    from test_curriculum_observe import Inline  # an explorer actor whose calls run when submitted

    from rft.rollout.explorer import step_metrics
    from rft.runtime.explorers import ExplorerPool

    cfg = config("buffer.batch_size=4", "algorithm.dynamic_sampling_max_tries=3")
    pool = ExplorerPool(cfg, [Inline(explorer(cfg, 12, shard, 2)) for shard in range(2)], None, None, synced=0,
                        monitor=None, stage_dir=None, title="t", owner=None)
    pool.submit(0)
    p, exps, counters, _ = pool.collect()
    m = step_metrics(exps, counters, len(p.futures))
    assert m["rollout/sampling_tries"] == 3 and m["rollout/generated"] == 24 and m["rollout/experiences"] == 4 * 2
