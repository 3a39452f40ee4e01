"""Runtime pieces without a run: workflow runners, the fingerprint check on every sync path, and
the config errors of modes, schedules and placement."""

import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import compose_cfg

import rft

from rft.errors import ConfigError
from rft.plan.batch import make_plan
from rft.plan.placement import check_placement
from rft.rollout.explorer import Explorer, run_jobs

# ---------------------------------------------------------------- runners


def test_run_jobs_retries_then_records_failures_in_order():
    calls = {}
    lock = threading.Lock()

    def fn(x):
        with lock:
            calls[x] = calls.get(x, 0) + 1
        if x == 3:
            raise ValueError("always")
        if x == 5 and calls[x] == 1:
            raise ValueError("only the first time")
        return x * 10

    results, c = run_jobs(fn, list(range(8)), runners=3, timeout=5.0, retries=2)
    # job 3 fails 3 times (1 + 2 retries) -> None; job 5 succeeds on its retry
    assert results == [0, 10, 20, None, 40, 50, 60, 70]
    assert calls[3] == 3 and calls[5] == 2 and calls[0] == 1
    # the last error's text comes with the counts (for the message when every task fails)
    # (and the line that raised it: the raise two lines into fn, after the lock's two lines)
    assert c == {"errors": 4, "timeouts": 0, "retries": 3, "failed": 1, "over_rollout_dropped": 0,
                 "last_error": f"ValueError: always ({__file__}, line {fn.__code__.co_firstlineno + 4})"}


def test_a_failing_call_names_the_line_that_raised_and_is_logged_once_per_error(caplog):
    # a reward function that raised on every response logged "job 0 attempt 1 raised
    # ZeroDivisionError: division by zero" once per call (600 lines for one eval of 200 tasks, 3
    # tries), and neither they nor the run's last message said where it raised
    def fn(x):
        if x % 2:
            return x / 0
        return x

    line = fn.__code__.co_firstlineno + 2
    with caplog.at_level("WARNING", logger="rft.rollout.explorer"):
        results, c = run_jobs(fn, list(range(6)), runners=1, timeout=5.0, retries=1)
    # jobs 1, 3 and 5 fail twice each (1 + 1 retry): 6 errors, one of them logged, then a count
    assert results == [0, None, 2, None, 4, None] and (c["errors"], c["failed"]) == (6, 3)
    error = f"ZeroDivisionError: division by zero ({__file__}, line {line})"
    assert c["last_error"] == error
    assert [r.getMessage() for r in caplog.records] == [
        f"job 1 attempt 1 raised {error}",
        "5 more calls raised an error logged above (each error is logged once a step; rollout/errors counts them)"]
    # an error of rft's own (a reward's value checked by the scorer) names no line of it
    def bad(x):
        raise ValueError("reward 'f' returned NoneType None, not a number")

    bad.__code__ = bad.__code__.replace(co_filename=str(Path(rft.__file__).parent / "rewards" / "scoring.py"))
    assert run_jobs(bad, [0], runners=1, timeout=5.0, retries=0)[1]["last_error"] == (
        "ValueError: reward 'f' returned NoneType None, not a number")


def test_a_reward_that_calls_sys_exit_or_raises_keyboardinterrupt_is_an_error_not_a_timeout():
    import sys

    def fn(x):
        if x == 1:
            sys.exit(3)
        if x == 2:
            raise KeyboardInterrupt
        return x

    t0 = time.monotonic()
    results, c = run_jobs(fn, [0, 1, 2], runners=2, timeout=30.0, retries=1)
    assert time.monotonic() - t0 < 25  # answered, not waited for until the timeout
    assert results == [0, None, None]
    assert (c["errors"], c["timeouts"], c["failed"]) == (4, 0, 2)
    line = fn.__code__.co_firstlineno
    assert c["last_error"] in (f"SystemExit: 3 ({__file__}, line {line + 2})",
                               f"KeyboardInterrupt:  ({__file__}, line {line + 4})")


def test_run_jobs_runs_at_most_runners_calls_at_once():
    lock, now, most = threading.Lock(), [0], [0]

    def fn(x):
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        time.sleep(0.02)
        with lock:
            now[0] -= 1
        return -x

    results, c = run_jobs(fn, list(range(12)), runners=3, timeout=5.0, retries=0)
    assert results == [-x for x in range(12)] and most[0] == 3 and c["failed"] == 0
    assert run_jobs(fn, [], runners=3, timeout=5.0, retries=0) == ([], {"errors": 0, "timeouts": 0, "retries": 0,
                                                                         "failed": 0, "over_rollout_dropped": 0})


def test_run_jobs_abandons_a_hung_call_without_waiting_for_it():
    release = threading.Event()

    def fn(x):
        if x == 0:
            release.wait(30)  # hangs until the test lets it go
        return x

    t0 = time.monotonic()
    results, c = run_jobs(fn, [0, 1, 2], runners=2, timeout=0.2, retries=1)
    elapsed = time.monotonic() - t0
    release.set()
    assert results == [None, 1, 2]
    assert c["timeouts"] == 2 and c["failed"] == 1 and c["retries"] == 1
    assert elapsed < 10  # two timeouts of 0.2 s, not the 30 s hang


def test_run_jobs_keeps_its_threads_and_replaces_a_hung_one():
    def job_threads():
        return {t for t in threading.enumerate() if t.name == "rft-job"}

    # the first call's 4 jobs wait for each other: 4 threads run them at once (fast jobs could
    # run on fewer, and a later call then start one more: a race, not the threads' reuse)
    together = threading.Barrier(4)
    run_jobs(lambda x: together.wait(10), list(range(4)), runners=4, timeout=5.0, retries=0)
    kept = job_threads()
    assert len(kept) >= 4  # the threads outlive the call
    for _ in range(20):  # 20 more steps of 4 jobs: no thread started (one per job would be 80)
        results, _ = run_jobs(lambda x: x + 1, list(range(4)), runners=4, timeout=5.0, retries=0)
        assert results == [1, 2, 3, 4]
    assert job_threads() == kept
    release = threading.Event()
    results, c = run_jobs(lambda x: release.wait(30) if x == 0 else x, [0, 1], runners=2, timeout=0.2, retries=0)
    assert results == [None, 1] and c["timeouts"] == 1
    # the hung call still holds its thread: the next call runs on the others (or a new one)
    results, _ = run_jobs(lambda x: x * 2, list(range(len(kept) + 2)), runners=len(kept) + 2, timeout=5.0, retries=0)
    assert results == [x * 2 for x in range(len(kept) + 2)]
    release.set()


def test_run_jobs_over_rollout_drops_the_slowest():
    release = threading.Event()

    def fn(x):
        if x >= 6:
            release.wait(30)
        return x

    # ratio 0.25 of 8 tasks: wait for ceil(0.75 * 8) = 6, then 0.1 s more, then drop the rest
    results, c = run_jobs(fn, list(range(8)), runners=8, timeout=60, retries=0, min_done=6, wait_after_min=0.1)
    release.set()
    assert results == [0, 1, 2, 3, 4, 5, None, None]
    assert c["over_rollout_dropped"] == 2 and c["failed"] == 0


# ---------------------------------------------------------------- the fingerprint check


def test_an_older_float_fingerprint_is_taken_with_a_warning(caplog):
    from rft.sync.weights import fingerprint, same_weights

    got = fingerprint([torch.ones(3)])
    # a checkpoint written before the fingerprint became exact holds three float sums
    assert same_weights(got, "3.0e+00/3.0e+00/3.0e+00")
    assert "written by an older version of rft" in caplog.text
    assert not same_weights(got, fingerprint([torch.zeros(3)]))


@pytest.fixture(scope="module")
def explorer():
    from rft.data.tasks import ensure_task_data
    from rft.models import ensure_model

    cfg = compose_cfg(["cluster=inline"])
    ensure_model(cfg.model)
    ensure_task_data(cfg.buffer.explorer_input)
    return Explorer(cfg)


def _trainer_side(explorer):
    from rft.sync.weights import fingerprint

    sd = {k: v.clone() + 0.01 for k, v in explorer.engine.model.state_dict().items()}
    # the trainer fingerprints its parameters: a tied output layer counts once
    return sd, fingerprint([sd[n] for n, _ in explorer.engine.model.named_parameters()])


def test_a_corrupted_memory_sync_is_caught(explorer):
    sd, expected = _trainer_side(explorer)
    corrupted = dict(sd)
    name = sorted(sd)[0]
    corrupted[name] = sd[name].clone()
    corrupted[name].view(-1)[0] += 1.0  # one garbled number in transit
    with pytest.raises(RuntimeError, match=r"weight sync to version 7 failed: the explorer now serves weights with fingerprint"):
        explorer.update_weights(corrupted, 7, expected)
    assert explorer.update_weights(sd, 7, expected) == expected and explorer.version == 7


def test_memory_sync_in_one_process_checks_the_loaded_weights_bit_for_bit(explorer, monkeypatch):
    """cluster=inline: the trainer sends its tensors (as numpy views) and no fingerprint; the
    explorer compares what its engine holds after loading with those tensors, exactly."""
    from rft.sync.weights import to_arrays

    sd, _ = _trainer_side(explorer)
    assert explorer.receive_weights((to_arrays(sd), None), 9) is None and explorer.version == 9
    held = explorer.engine.model.state_dict()
    assert all(torch.equal(held[k], v) for k, v in sd.items())
    # a load that leaves one tensor stale (and one that garbles one number) is caught, naming the tensor
    real = type(explorer.engine).update_weights
    name = sorted(sd)[-1]

    def stale_one(self, state):
        real(self, {k: (held[k].clone() if k == name else v) for k, v in state.items()})

    sd2 = {k: v + 0.25 for k, v in sd.items()}
    monkeypatch.setattr(type(explorer.engine), "update_weights", stale_one)
    with pytest.raises(RuntimeError, match=rf"weight sync to version 10 failed: after loading, the explorer's {name} "
                                           rf"\(and 0 more of {len(sd2)} tensors\) differ from the trainer's"):
        explorer.receive_weights((to_arrays(sd2), None), 10)
    assert explorer.version == 9

    def garble(self, state):
        real(self, state)
        self.model.state_dict()[name].view(-1)[0] += 1e-6

    monkeypatch.setattr(type(explorer.engine), "update_weights", garble)
    with pytest.raises(RuntimeError, match="version 11 failed"):
        explorer.receive_weights((to_arrays(sd2), None), 11)
    monkeypatch.setattr(type(explorer.engine), "update_weights", real)
    assert explorer.receive_weights((to_arrays(sd2), None), 12) is None and explorer.version == 12
    # an engine that cannot compare tensors (vLLM keeps them in its own process): the explorer
    # fingerprints the trainer's state dict (a tied output layer is one tensor there, counted once)
    import copy

    from rft.sync.weights import fingerprint, same_weights

    model = copy.deepcopy(explorer.engine.model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    state = model.state_dict()
    monkeypatch.delattr(type(explorer.engine), "differs")
    assert same_weights(explorer.receive_weights((to_arrays(state), None), 13), fingerprint(model.parameters()))
    assert explorer.version == 13
    state[name] = state[name].clone()
    monkeypatch.setattr(type(explorer.engine), "update_weights", stale_one)
    with pytest.raises(RuntimeError, match="weight sync to version 14 failed: the explorer now serves weights with fingerprint"):
        explorer.receive_weights((to_arrays({k: v + 1 for k, v in state.items()}), None), 14)


def test_same_bits_tells_apart_what_equality_does_not():
    from rft.sync.weights import same_bits

    nan = torch.tensor([float("nan"), 1.0])
    assert same_bits(nan, nan.clone())  # torch.equal says False: NaN != NaN
    assert not torch.equal(nan, nan.clone())
    assert not same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))  # equal as numbers, not as bits
    assert not same_bits(torch.ones(2), torch.ones(2, dtype=torch.float64))  # a dtype change
    assert not same_bits(torch.ones(2), torch.ones(1, 2))  # a shape change
    assert same_bits(torch.arange(4, dtype=torch.bfloat16), torch.arange(4, dtype=torch.bfloat16))
    assert same_bits(torch.tensor([True, False]), torch.tensor([True, False]))
    assert same_bits(torch.tensor([1 + 2j]), torch.tensor([1 + 2j]))


def test_engine_update_weights_copies_in_place_and_refuses_a_wrong_state_dict(explorer):
    sd, _ = _trainer_side(explorer)
    params = {n: p for n, p in explorer.engine.model.named_parameters()}
    before = {n: p.data_ptr() for n, p in params.items()}
    explorer.engine.update_weights(sd)
    # the same parameter tensors, now holding the new numbers (a tied output layer included)
    assert {n: p.data_ptr() for n, p in explorer.engine.model.named_parameters()} == before
    held = explorer.engine.model.state_dict()
    assert all(torch.equal(held[k], v) for k, v in sd.items())
    name = sorted(sd)[0]
    with pytest.raises(RuntimeError, match=rf"Missing key\(s\) in state_dict: \"{name}\""):
        explorer.engine.update_weights({k: v for k, v in sd.items() if k != name})
    with pytest.raises(RuntimeError, match=rf"size mismatch for {name}"):
        explorer.engine.update_weights({**sd, name: sd[name][:1]})


def test_memory_sync_through_shared_memory_serves_the_trainers_weights(explorer):
    from pathlib import Path

    from rft.sync.weights import SharedWeights, SharedWriter, read_shared, same_weights, shared_fits

    sd, expected = _trainer_side(explorer)
    writer = SharedWriter()
    try:
        weights = writer.write(sd)
        assert isinstance(weights, SharedWeights) and Path("/dev/shm", weights.segment).exists()
        # what an explorer reads are the trainer's numbers, and the sync passes its check
        got = read_shared(weights)
        assert all(torch.equal(got[k], v) for k, v in sd.items())
        assert same_weights(explorer.receive_weights((weights, expected), 8), expected) and explorer.version == 8
        # the next sync writes the same segment again (an explorer reads the new numbers)
        sd2 = {k: v + 0.5 for k, v in sd.items()}
        again = writer.write(sd2)
        assert again.segment == weights.segment
        assert all(torch.equal(t, sd2[k]) for k, t in read_shared(again).items())
        # other dtypes and an empty tensor; a new layout is a new segment, the old one unlinked
        other = {"a": torch.arange(5, dtype=torch.bfloat16), "b": torch.tensor([3, -1]), "c": torch.zeros(0, 4)}
        moved = writer.write(other)
        assert moved.segment != weights.segment and not Path("/dev/shm", weights.segment).exists()
        got = read_shared(moved)
        assert [got[k].dtype for k in "abc"] == [torch.bfloat16, torch.int64, torch.float32]
        assert got["a"].tolist() == [0, 1, 2, 3, 4] and got["b"].tolist() == [3, -1] and got["c"].shape == (0, 4)
    finally:
        writer.close()
    assert writer.shm is None and not Path("/dev/shm", moved.segment).exists()
    # a model too large for the node's shared memory goes through the object store instead
    assert shared_fits(1 << 20) and not shared_fits(1 << 60)


def test_segments_left_by_killed_runs_are_swept():
    import os
    import subprocess
    from pathlib import Path

    from rft.sync.weights import segment_prefix, sweep

    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid no process has now
    host = segment_prefix().split("_")[2]
    assert segment_prefix() == f"rft_{os.getpid()}_{host}_"
    mine, gone = Path(f"/dev/shm/{segment_prefix()}0a1b"), Path(f"/dev/shm/rft_{dead.pid}_{host}_0a1b")
    # a driver on another host (its trainer here): its pid means nothing on this one
    elsewhere = Path(f"/dev/shm/rft_{dead.pid}_{'0' * 6 if host != '0' * 6 else '1' * 6}_0a1b")
    other = Path("/dev/shm/not_rft_1_0a1b")
    for p in (mine, gone, elsewhere, other):
        p.write_bytes(b"x")
    try:
        sweep()  # a new run: segments of this host's drivers that are gone
        assert mine.exists() and not gone.exists() and elsewhere.exists() and other.exists()
        sweep(segment_prefix())  # this run's own, at its end
        assert not mine.exists() and elsewhere.exists() and other.exists()
    finally:
        for p in (mine, gone, elsewhere, other):
            p.unlink(missing_ok=True)


def test_memory_sync_shares_memory_only_with_ray_actors_on_the_trainers_node(monkeypatch):
    import os
    from types import SimpleNamespace

    from rft.sync.weights import MemorySync

    sent = []

    class Ray:  # a Ray actor handle as the synchronizer sees one
        def __init__(self, node):
            self.node = node

        def call(self, method, *args):
            assert method == "node"
            return self.node

        def submit(self, method, *args):
            sent.append((method, args))
            return args

        def get(self, future, timeout=None):
            return future

    sync = MemorySync(None, SimpleNamespace(sync_timeout=5))
    sync(Ray("n1"), [Ray("n1"), Ray("n1")], 3)
    assert sent[0] == ("sync_payload", (sync.prefix,)) and sync.prefix.startswith(f"rft_{os.getpid()}_")
    sent.clear()
    # one explorer elsewhere: the object store for all (handles made afresh each time: a handle
    # freed and another made may share an id(), never an entry of the synchronizer's cache)
    for _ in range(20):
        sync(Ray("n1"), [Ray("n1"), Ray("n2")], 4)
        assert sent.pop(0) == ("sync_payload", (None,))
        sent.clear()
    from rft.runtime.actors import InlineActor

    inline = InlineActor.__new__(InlineActor)
    inline.obj = SimpleNamespace(sync_payload=lambda shared, with_fingerprint: sent.append((shared, with_fingerprint)) or ({}, None),
                                 node=lambda: "")
    # in one process (no Ray node) the arrays are views: nothing to share, and no fingerprint (the
    # explorer checks what it loaded against the trainer's own tensors)
    sync(inline, [], 5)
    assert sent == [(None, False)]


def test_a_corrupted_collective_sync_is_caught(explorer, monkeypatch):
    import rft.sync.weights

    sd, expected = _trainer_side(explorer)
    names = [n for n, _ in sorted(explorer.engine.model.named_parameters())]

    def garbled_broadcast(group, tensors):
        # what a receive does, with the last tensor left stale (a dropped message)
        with torch.no_grad():
            for name, t in zip(names[:-1], tensors):
                t.copy_(sd[name])

    monkeypatch.setattr(rft.sync.weights, "broadcast", garbled_broadcast)
    explorer.engine.group = None
    with pytest.raises(RuntimeError, match="weight sync to version 8 failed"):
        explorer.collective_receive(8, expected)


# ---------------------------------------------------------------- off-policy correction


@pytest.mark.parametrize("mode", ["behavior", "decoupled", "none"])
def test_off_policy_correction_of_stale_experiences(mode):
    from rft.algorithms.off_policy import correct
    from rft.data.experience import Experience, collate

    algo = compose_cfg([f"algorithm.off_policy_correction={mode}", "algorithm.behavior_weight_cap=2.0"]).algorithm
    stale = Experience(tokens=[1, 2, 3, 4], prompt_length=2, logprobs=[-1.0, -2.0], policy_version=2)
    fresh = Experience(tokens=[1, 2, 3, 4], prompt_length=2, logprobs=[-1.0, -2.0], policy_version=3)
    mask = collate([stale, fresh], 0)["response_mask"]  # targets 1 and 2 are the response
    old = torch.full((2, 3), -0.5)
    w = correct([stale, fresh], old, mask, 3, algo)  # the trainer is at version 3
    if mode == "behavior":  # the stale row's ratio is taken against its sampling log-probs
        assert w is None and old.tolist() == [[-0.5, -1.0, -2.0], [-0.5, -0.5, -0.5]]
    elif mode == "decoupled":  # exp(-0.5 - -1) = e^0.5 = 1.6487; exp(-0.5 - -2) = e^1.5 = 4.48 -> cap 2
        assert old.tolist() == [[-0.5] * 3] * 2
        assert w[0].tolist() == pytest.approx([1.0, 1.6487213, 2.0]) and w[1].tolist() == [1.0] * 3
    else:
        assert w is None and old.tolist() == [[-0.5] * 3] * 2


# ---------------------------------------------------------------- config errors


def plan_error(*overrides) -> str:
    with pytest.raises(ConfigError) as e:
        make_plan(compose_cfg(["stages=[]", *overrides]), 2000)
    return str(e.value)


def test_a_staleness_bound_below_the_schedule_is_an_error():
    assert plan_error("synchronizer.sync_offset=1", "synchronizer.sync_interval=2", "synchronizer.max_staleness=1") == (
        "synchronizer.max_staleness=1 is below the staleness this schedule produces: sync_offset (1) + "
        "sync_interval (2) - 1 = 2, so experiences would be dropped every step. Raise max_staleness to 2 "
        "or lower sync_offset / sync_interval."
    )


def test_modes_need_a_buffer_that_outlives_them():
    assert plan_error("mode=explore").startswith(
        "mode=explore stores experiences for a later or separate mode=train run, so "
        "buffer.trainer_input.experience_buffer.storage_type must be sql or file (it is queue)")
    assert plan_error("mode=train").startswith("mode=train reads buffer.trainer_input.experience_buffer, and a queue has no writer")


def test_collective_sync_needs_ray_processes():
    assert plan_error("sync=collective", "cluster=inline").startswith(
        "synchronizer.sync_method=collective broadcasts between the trainer's and the explorers' processes")


@pytest.mark.parametrize("overrides, message", [
    (["cluster.gpu_per_node=2", "explorer.rollout_model.tensor_parallel_size=4"],
     "explorer.rollout_model.tensor_parallel_size=4 is more than cluster.gpu_per_node=2: one engine's "
     "tensor-parallel ranks must share a node. Lower tensor_parallel_size to at most 2."),
    (["cluster.gpu_per_node=4", "cluster.node_num=1", "explorer.rollout_model.engine_num=2",
      "explorer.rollout_model.tensor_parallel_size=2"],
     "cluster.node_num x gpu_per_node = 4 GPUs, and the explorers take all of them (engine_num 2 x "
     "tensor_parallel_size 2 = 4), leaving none for the trainer. Lower explorer.rollout_model.engine_num, "
     "add nodes, or set cluster.colocate=true to share the GPUs."),
])
@pytest.mark.slow  # 1.4 s alone, over the fast tier's second
def test_a_device_mapping_that_does_not_fit_is_an_error(overrides, message):
    assert plan_error(*overrides) == message


def test_placement_on_gpus_and_cpus():
    # 2 nodes x 4 GPUs, 3 engines of TP 2: 6 GPUs for explorers, the trainer takes 1 of the other 2
    p = check_placement(compose_cfg(["cluster.node_num=2", "cluster.gpu_per_node=4",
                                     "explorer.rollout_model.engine_num=3",
                                     "explorer.rollout_model.tensor_parallel_size=2"]))
    assert p.bundles == [{"GPU": 1, "CPU": 1}] + [{"GPU": 2, "CPU": 1}] * 3 and p.share == 1.0
    # CPU only, colocated: trainer and 2 explorers share one bundle of 2 CPUs, a third each
    p = check_placement(compose_cfg(["cluster.colocate=true", "cluster.cpus_per_actor=2",
                                     "explorer.rollout_model.engine_num=2"]))
    assert p.bundles == [{"CPU": 2}] and p.share == pytest.approx(1 / 3)


def test_a_sync_past_sync_timeout_is_a_clear_error(tmp_path):
    from omegaconf import OmegaConf

    from rft.errors import RunError
    from rft.sync.weights import MemorySync, wait

    class Stuck:  # an actor that never answers
        name = "grpo_explorer"

        def call(self, method, *args):
            return "fingerprint"

        def submit(self, method, *args):
            return None

        def get(self, future, timeout=None):
            raise TimeoutError(f"{self.name} did not answer within {timeout} s")

    sync = MemorySync(tmp_path, OmegaConf.create({"sync_timeout": 2.5}))
    with pytest.raises(RunError) as e:
        wait(sync(Stuck(), [Stuck()], 3), 2.5)
    assert str(e.value) == (
        "a weight sync did not finish within synchronizer.sync_timeout=2.5 s (grpo_explorer did not answer "
        "within 2.5 s). The newest checkpoint is kept; raise sync_timeout if the model is large, then run "
        "the same command again to resume.")


def test_a_sync_is_waited_for_before_an_explorers_result_counts_and_a_failed_check_stops_the_run():
    """The driver starts a sync and goes on (the explorers load the weights meanwhile); it waits for
    it before it takes any explorer's result, trains again, evaluates or saves: an explore queued
    after a sync whose check failed ran on the old weights and must never count."""
    from types import SimpleNamespace

    from rft.runtime.explorers import ExplorerPool
    from rft.runtime.faults import TrainerCalls
    from rft.runtime.schedule import Schedule

    made = []

    class Explorer:
        def submit(self, method, *args):
            made.append((method, args))
            return method

        def get(self, future, timeout=None):
            assert timeout == 7.0  # synchronizer.sync_timeout
            raise RuntimeError("weight sync to version 3 failed: the explorer now serves weights with ...")

    explorer = Explorer()
    run = ExplorerPool(compose_cfg(["synchronizer.sync_timeout=7", "synchronizer.sync_offset=0"]), [explorer],
                       TrainerCalls(object(), None),
                       lambda trainer, explorers, version: [(e, e.submit("receive_weights", version)) for e in explorers],
                       synced=2, monitor=None, stage_dir=None, title="grpo", owner=None)
    run.snapshots, run.pending = False, None
    run.sync_all(3)  # submitted, not waited for
    assert made == [("receive_weights", (3,))] and run.synced == 3 and run.unfinished_sync is not None
    # the next collect waits for it first (run.pending=None: taking the explore result would raise
    # AttributeError), and the failed check stops the run
    with pytest.raises(RuntimeError, match="weight sync to version 3 failed"):
        run.collect()
    assert run.unfinished_sync is None
    schedule = SimpleNamespace(pool=run)
    for method in (Schedule._train, ExplorerPool.evaluate, Schedule._save):
        run.unfinished_sync = (3, [(explorer, "receive_weights")])
        with pytest.raises(RuntimeError, match="weight sync to version 3 failed"):
            method(schedule, 3, None) if method is not ExplorerPool.evaluate else method(run, 3)


def test_a_syncing_step_queues_the_sync_and_the_next_explore_behind_the_train_step():
    """Each actor runs its calls in order: at a step that syncs, the driver submits the trainer's
    step, the sync and the next explore before it takes the step's result, so the explorer loads
    the new weights and explores as soon as the trainer is done. Not at a step that evaluates or
    saves: the eval and the checkpoint come first. A step that does not sync only trains; so does
    every step in one process, or in sleep mode."""
    from types import SimpleNamespace

    from rft.data.experience import Experience
    from rft.runtime.explorers import ExplorerPool
    from rft.runtime.faults import TrainerCalls
    from rft.runtime.schedule import Schedule

    log = []

    class Actor:
        def __init__(self, name):
            self.name = name

        def submit(self, method, *args):
            log.append(("submit", self.name, method))
            return self.name, method

        def get(self, future, timeout=None):
            log.append(("get", *future))
            return {"loss/policy": 0.5} if future[1] == "train_step" else None

        def call(self, method):
            log.append(("call", self.name, method))

    def make(overrides):
        run = object.__new__(Schedule)
        run.cfg = compose_cfg(["synchronizer.sync_offset=0", "explorer.eval_interval=5", "trainer.save_interval=10",
                               *overrides])
        run.plan = SimpleNamespace(total_steps=20, input_kind="tasks")
        run.trainer = TrainerCalls(Actor("trainer"), None)
        sync = lambda trainer, explorers, version: [
            (e, e.submit("receive_weights", trainer.submit("sync_payload"), version)) for e in explorers]
        run.pool = ExplorerPool(run.cfg, [Actor("explorer")], run.trainer, sync, synced=0, monitor=None,
                                stage_dir=None, title="grpo", owner=None)
        run.explores = run.trains = True
        run.pool.snapshots = False
        run.explore_metrics = {}
        run.curriculum = None  # data_processor.online_curriculum off: the explorers draw their own tasks
        run.monitor = SimpleNamespace(record_batch=lambda record: None)
        batch = [Experience(tokens=[1, 2, 3], prompt_length=1, logprobs=[0.0, 0.0])]
        run._read_batch = lambda step, produced: (batch, {})
        return run

    run = make([])
    for step in (3, 5, 10):  # explore step s - 1 was collected; training step s learns from it
        run.pool.synced, run.next_explore = step - 1, step
        log.clear()
        metrics = run._train(step, None)
        assert metrics["loss/policy"] == 0.5 and run.pool.synced == step
        queued = [("submit", "trainer", "train_step"), ("submit", "trainer", "sync_payload"),
                  ("submit", "explorer", "receive_weights")]
        if step == 3:  # sync_offset=0: explore step 3 (training step 4 learns from it), on version 3
            queued.append(("submit", "explorer", "explore"))
            assert run.next_explore == 4 and run.pool.pending[-1].step == 3 and run.pool.pending[-1].version == 3
        else:  # step 5 evaluates (eval_interval=5), step 10 saves (save_interval=10)
            assert run.next_explore == step
        assert log == [*queued, ("get", "trainer", "train_step")]
        run.pool.unfinished_sync = None  # (waited for by the next step's collect)

    # in one process (cluster=inline) a call runs when submitted, and in sleep mode the engines
    # sleep while the trainer trains (the GPU is the trainer's): the sync waits for _end_step
    trains = [("submit", "trainer", "train_step"), ("get", "trainer", "train_step")]
    for overrides, expected in ((["synchronizer.sync_interval=2"], trains), (["cluster=inline"], trains),
                                (["explorer.rollout_model.enable_sleep_mode=true"], [("call", "explorer", "sleep"), *trains])):
        run = make(overrides)
        run.pool.synced, run.next_explore = 2, 3
        log.clear()
        run._train(3, None)
        assert log == expected and run.pool.synced == 2 and run.next_explore == 3, overrides


def test_sleep_mode_frees_the_engines_only_while_the_trainer_trains():
    from types import SimpleNamespace

    from rft.runtime.explorers import ExplorerPool

    calls = []
    explorer = SimpleNamespace(call=lambda method: calls.append(method))
    run = SimpleNamespace(cfg=compose_cfg(["explorer.rollout_model.enable_sleep_mode=true"]),
                          explorers=[explorer, explorer], asleep=False)
    for awake in (True, False, False, True, True):  # explore, train, (again), sync, explore
        ExplorerPool.awake(run, awake)
    assert calls == ["sleep", "sleep", "wake_up", "wake_up"]  # two engines, each once per change
    run.cfg = compose_cfg([])  # off: never touched
    ExplorerPool.awake(run, False)
    assert len(calls) == 4


def test_the_driver_of_a_ray_run_does_not_import_the_trainer():
    """The runner (the driver's loop) needs neither torch nor the trainer's transformers and peft
    modules: each would be a copy in the driver besides the actors' (about 0.1 GB for the trainer's
    modules, measured with PSS). A whole Ray run's driver is checked in
    tests/test_e2e.py::test_shortened_default_learns_through_ray."""
    import subprocess
    import sys

    code = ("import sys, rft.runtime.runner, rft.runtime.actors, rft.sync.weights, rft.rollout.explorer, rft.runtime.checkpoint; "
            "print(sorted(m for m in ('torch', 'rft.trainer.trainer', 'peft', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_trainer_class_is_imported_in_its_own_process(tmp_path):
    """start_trainer names the class as "rft.trainer.trainer.Trainer" (rft.registry.TRAINER_BACKENDS);
    the actor's shell imports it."""
    from rft.registry import TRAINER_BACKENDS
    from rft.runtime.actors import InlineActor

    assert TRAINER_BACKENDS.path("torch") == "rft.trainer.trainer.Trainer"
    a = InlineActor("collections.OrderedDict", [("a", 1)], name="t", log_dir=str(tmp_path), level="INFO")
    assert type(a.obj).__name__ == "OrderedDict" and a.call("get", "a") == 1


def test_rollout_metrics_by_hand():
    from rft.data.experience import Experience
    from rft.rollout.explorer import rollout_metrics

    exps = [Experience(list(range(2 + n)), 2, [0.0] * n, reward=r, group_id="g")
            for n, r in [(4, 1.0), (2, 0.0), (6, 0.5)]]
    m = rollout_metrics(exps, [exps], {}, 2.0)
    assert m["reward/mean"] == 0.5  # (1 + 0 + 0.5) / 3
    # deviations 0.5, -0.5, 0: sum of squares 0.5, over n - 1 = 2: variance 0.25
    assert m["reward/std"] == pytest.approx(0.5, rel=1e-15)
    assert (m["reward/min"], m["reward/max"]) == (0.0, 1.0)
    assert m["response_length/mean"] == 4.0 and m["response_length/max"] == 6.0  # (4 + 2 + 6) / 3
    assert m["response_length/min"] == 2.0
    assert m["rollout/tokens_per_s"] == 6.0  # 12 tokens in 2 s
    one = rollout_metrics(exps[:1], [exps[:1]], {}, 1.0)
    assert one["reward/std"] == 0.0 and one["reward/mean"] == 1.0
    # a step whose every task failed scored nothing: no reward or length is logged for it (a 0 would
    # read as a real reward in every plot, report and sweep objective), only what went wrong
    none = rollout_metrics([], [], {"failed_tasks": 4}, 1.0)
    assert none["rollout/experiences"] == 0 and none["rollout/failed_tasks"] == 4
    assert not [k for k in none if k.startswith(("reward/", "response_length/"))]


def test_rollout_metrics_split_the_length_by_correctness():
    from rft.data.experience import Experience
    from rft.rollout.explorer import rollout_metrics

    exps = [Experience(list(range(2 + n)), 2, [0.0] * n, reward=r, group_id="g")
            for n, r in [(4, 1.0), (10, 0.0), (20, 0.5), (6, 1.0), (3, -1.0)]]
    m = rollout_metrics(exps, [exps], {}, 1.0)
    assert m["response_length/correct_mean"] == 5.0  # reward >= 1: (4 + 6) / 2
    assert m["response_length/incorrect_mean"] == 11.0  # 0.5 is not full credit: (10 + 20 + 3) / 3
    assert m["response_length/mean"] == 8.6  # (4 + 10 + 20 + 6 + 3) / 5, unchanged
    # a step with no response of a kind logs no value for it (a 0 would pull the mean over seeds down)
    right = rollout_metrics(exps[:1], [exps[:1]], {}, 1.0)
    assert right["response_length/correct_mean"] == 4.0 and "response_length/incorrect_mean" not in right
    wrong = rollout_metrics(exps[1:2], [exps[1:2]], {}, 1.0)
    assert wrong["response_length/incorrect_mean"] == 10.0 and "response_length/correct_mean" not in wrong


def test_a_trainer_that_dies_during_a_sync_is_named_with_its_checkpoint(tmp_path):
    """With the explorer one step ahead a trainer's death is often first seen by the weight sync (the
    explorer's call reads the dead trainer's payload): the run stops with the trainer's message, not
    a raw Ray error, and no explorer is restarted for it."""
    from types import SimpleNamespace

    from ray.exceptions import RayActorError

    from rft.errors import RunError
    from rft.runtime.explorers import ExplorerPool
    from rft.runtime.faults import TrainerCalls

    class Explorer:
        pings = 0

        def call(self, method):
            assert method == "ping"
            Explorer.pings += 1
            return 1

        def get(self, future, timeout=None):  # the explorer's receive, which read the dead trainer's payload
            raise RayActorError(error_msg="The actor died unexpectedly")

    def raising_sync(trainer, explorers, version):  # a sync whose own trainer call finds it dead
        raise RayActorError(error_msg="The actor died unexpectedly")

    def sync(trainer, explorers, version):
        return [(e, "receive_weights") for e in explorers]

    expected = ("the trainer actor died (RayActorError). Its newest checkpoint: none yet (the stage "
                "restarts from its beginning). Run the same command again to resume from it.")
    for sync_method in (raising_sync, sync):
        run = SimpleNamespace(cfg=SimpleNamespace(cluster=SimpleNamespace(max_actor_restarts=1),
                                                  synchronizer=SimpleNamespace(sync_timeout=5)),
                              sync=sync_method, trainer=TrainerCalls(object(), tmp_path), explorers=[Explorer()],
                              awake=lambda awake: None, _revive=lambda *a, **k: pytest.fail("no explorer died"),
                              unfinished_sync=None, snapshots=False)
        for name in ("finish_sync", "_synced_to"):
            setattr(run, name, getattr(ExplorerPool, name).__get__(run))
        Explorer.pings = 0
        with pytest.raises(RunError) as e:
            ExplorerPool.sync_all(run, 3)  # raising_sync: at once
            run.finish_sync()  # sync: when the driver waits for it
        assert str(e.value) == expected
        assert Explorer.pings == 1


@pytest.mark.slow
def test_asking_for_the_ray_node_outside_ray_does_not_import_ray():
    """Memory sync asks each actor for its Ray node; in one process (cluster=inline) the answer is
    "" without importing Ray (~50 MB and ~0.2 s of a run that never uses it)."""
    import subprocess
    import sys

    code = "import sys; from rft.sync.weights import node_id; print(repr(node_id()), 'ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["''", "False"]
    # nor does asking whether a failed call's actor died (the runner asks on every error)
    code = ("import sys; from rft.runtime.faults import actor_died; "
            "print(actor_died(RuntimeError('a user error')), 'ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_an_inline_actor_takes_its_log_file_away_when_it_ends(tmp_path):
    """One process can run run after run (a sweep's jobs under Hydra's basic launcher): an inline
    actor's log handler goes with the actor, also one whose object failed to build, so a later
    run's lines never land in an earlier run's files (nor leak its file)."""
    import logging

    from rft.runtime.actors import InlineActor

    class Fails:
        def __init__(self):
            raise ValueError("no model here")

    log, threads = logging.getLogger("rft"), torch.get_num_threads()
    before = list(log.handlers)
    try:
        first = InlineActor(dict, name="first", log_dir=str(tmp_path / "a"), level="INFO")
        log.info("during the first")
        first.kill()
        with pytest.raises(ValueError, match="no model here"):
            InlineActor(Fails, name="failed", log_dir=str(tmp_path / "b"), level="INFO")
        second = InlineActor(dict, name="second", log_dir=str(tmp_path / "c"), level="INFO")
        logging.getLogger("rft.rollout.explorer").info("during the second")
        second.kill()
    finally:
        torch.set_num_threads(threads)
    assert log.handlers == before and first.log_handler.stream is None  # closed
    first_log, second_log = (tmp_path / "a" / "first.log").read_text(), (tmp_path / "c" / "second.log").read_text()
    assert "during the first" in first_log and "during the second" not in first_log
    assert "during the second" in second_log and "during the first" not in second_log
    assert "failed started" in (tmp_path / "b" / "failed.log").read_text()


def test_long_lived_freezes_what_is_made_inside_and_gives_the_collector_back():
    """rft.runtime.actors.long_lived: no full collections while an actor is built, then its objects frozen."""
    import gc

    from rft.runtime.actors import FULL_COLLECTIONS_OFF, long_lived

    gc.unfreeze()
    before = gc.get_threshold()
    assert gc.get_freeze_count() == 0
    with long_lived():
        # young and middle collections go on (a build's short-lived cycles are freed), full ones wait
        assert gc.get_threshold() == (before[0], before[1], FULL_COLLECTIONS_OFF)
        young = gc.get_stats()[0]["collections"]
        kept = [[i] for i in range(5 * before[0])]  # tracked allocations, 5x the young threshold
        assert gc.get_stats()[0]["collections"] > young  # the collector ran by itself (not disabled)
    try:
        assert gc.get_threshold() == before and gc.get_freeze_count() >= len(kept)
        # frozen: in no generation, so a full collection does not scan them
        assert gc.is_tracked(kept[0]) and id(kept[0]) not in {id(o) for o in gc.get_objects(generation=2)}
        with pytest.raises(ValueError, match="bad build"):
            with long_lived():
                raise ValueError("bad build")
        assert gc.get_threshold() == before  # an actor that failed to build leaves the collector as it was
    finally:
        gc.unfreeze()
    del kept


def test_an_actor_whose_constructor_raised_is_reported_by_its_error():
    """rft.runtime.actors.not_started: what Ray raises for a call to an actor whose __init__ raised."""
    from pathlib import Path

    from rft.errors import ConfigError, RunError
    from rft.runtime.actors import not_started

    class Died(Exception):
        def __init__(self, text, init_failed):
            super().__init__(text)
            self.actor_init_failed = init_failed

    creation = ("The actor died because of an error raised in its creation task, ray::_Host.__init__() "
                "(pid=7)\n  File \"rft/rollout/explorer.py\", line 234, in __init__\n{}\n")
    e = not_started(Died(creation.format("rft.errors.ConfigError: model.model_path='x' could not be loaded."), True),
                    "grpo_explorer", Path("run/log/grpo_explorer.log"))
    assert type(e) is ConfigError and str(e) == "model.model_path='x' could not be loaded."
    e = not_started(Died(creation.format("RuntimeError: out of memory"), True), "grpo_trainer",
                    Path("run/log/grpo_trainer.log"))
    assert type(e) is RunError
    assert str(e) == "grpo_trainer did not start: RuntimeError: out of memory (the traceback is in run/log/grpo_trainer.log)"
    # one that died later (killed, out of memory): Ray may restart it, the runner decides
    assert not_started(Died("The actor died unexpectedly before finishing this task.", False), "x", Path("x.log")) is None


def test_a_checkpoint_that_cannot_be_written_stops_the_run_naming_the_disk_and_leaves_no_tmp(tmp_path):
    import errno

    from rft.errors import RunError
    from rft.runtime import checkpoint

    checkpoint.write(tmp_path, 2, {"version": 2})

    def full_disk(tmp):
        (tmp / "trainer_state.pt").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(RunError) as e:
        checkpoint.write(tmp_path, 4, {"version": 4}, full_disk)
    assert str(e.value).startswith(f"writing checkpoint step 4 to {tmp_path / 'checkpoints' / 'step_4.tmp'} failed "
                                   f"(OSError: [Errno 28] No space left on device); that disk has ")
    assert str(e.value).endswith("run the same command again to resume from the newest checkpoint (step 2).")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_2"]


def score_one_and_a_half(prompt, response, task):
    return 1.5


@pytest.mark.slow  # an engine: 200 greedy eval rollouts
def test_eval_accuracy_is_the_mean_reward_and_may_pass_one():
    """README: "accuracy" is the mean reward over the eval set (with a 0/1 reward, the share solved)."""
    from rft.data.tasks import ensure_task_data
    from rft.models import ensure_model

    cfg = compose_cfg(["cluster=inline", "buffer.explorer_input.eval_tasksets.0.reward_fn=test_runtime_units.score_one_and_a_half"])
    ensure_model(cfg.model)
    ensure_task_data(cfg.buffer.explorer_input)
    m = Explorer(cfg).evaluate(0)
    # every one of the 200 eval tasks scored 1.5: the mean, 1.5, not a share of tasks solved
    assert m["eval/accuracy"] == 1.5 and m["eval/failed_tasks"] == 0


FAILED_STEP = {"rollout/experiences": 0, "rollout/failed_tasks": 4, "rollout/errors": 8, "rollout/timeouts": 0}


def stage_run_of(cfg, tmp_path, total_steps: int, start: int = 0):
    """The check of a stage whose steps are all collected (no checkpoint yet)."""
    from types import SimpleNamespace

    from rft.runtime.faults import LearningSignal

    return LearningSignal(cfg, SimpleNamespace(total_steps=total_steps), start, tmp_path, "grpo", None)


def test_a_run_shorter_than_max_failed_steps_whose_every_step_failed_stops_naming_the_environment(tmp_path):
    """2 steps, max_failed_steps 3: both failed, and the run saved the unchanged model with exit 0;
    the message blamed the reward function when the environment had raised."""
    from rft.errors import RunError

    cfg = compose_cfg(["stages=[]", "model=tiny_tools", "task=calculator", "buffer.total_steps=2"])
    run = stage_run_of(cfg, tmp_path, total_steps=2)
    run.check(0, FAILED_STEP, ("workflow", "TypeError: boom"))  # 1 of 2: it goes on
    with pytest.raises(RunError) as e:
        run.check(1, FAILED_STEP, ("workflow", "TypeError: boom"))
    assert str(e.value) == (
        f"every task of the last 2 steps failed (environment 'calculator' (workflow_args.env): 8 errors and 0 "
        f"timeouts in the last step; the last error: TypeError: boom), so nothing can be learned. Each explorer's "
        f"log in {tmp_path / 'log'} has the details. Fix the environment (its constructor, reset or step), then "
        f"run the same command again to resume from the newest checkpoint: none yet. explorer.max_failed_steps=3 "
        f"sets how many such steps stop a run (0: never).")
    # a longer explorer.max_timeout is offered only where calls timed out (8 errors, 0 timeouts above: a
    # larger timeout would not help an environment that raises)
    run = stage_run_of(cfg, tmp_path, total_steps=2)
    timed_out = {**FAILED_STEP, "rollout/errors": 0, "rollout/timeouts": 8}
    run.check(0, timed_out, None)
    with pytest.raises(RunError, match=r"0 errors and 8 timeouts in the last step; the last error: none recorded "
                                       r"\(timeouts\)\), .* Fix the reward function \(or raise explorer.max_timeout if "
                                       r"it is only slow\), then"):
        run.check(1, timed_out, None)
    # resumed at step 9 of 10: its one step failed, and it is all this run does
    run = stage_run_of(compose_cfg(["stages=[]"]), tmp_path, total_steps=10, start=9)
    with pytest.raises(RunError, match=r"^every task of the last 1 steps failed \(reward function 'exact_match': "):
        run.check(9, FAILED_STEP, ("reward", "ValueError: no"))
    # a longer run goes on until max_failed_steps in a row
    run = stage_run_of(compose_cfg(["stages=[]"]), tmp_path, total_steps=10)
    for step in range(2):
        run.check(step, FAILED_STEP, ("reward", "ValueError: no"))


def test_an_experience_pipeline_that_keeps_nothing_for_max_failed_steps_stops_the_run(tmp_path):
    """A reward_filter whose min_reward no response reaches dropped every experience of every step:
    each step trained on nothing, and the run went on to its end and exit 0."""
    from rft.errors import RunError

    run = stage_run_of(compose_cfg(["stages=[]"]), tmp_path, total_steps=10)
    # 16 experiences in; the shaping operator keeps them all, the filter none
    emptied = {"rollout/experiences": 16, "rollout/failed_tasks": 0, "reward/min": 0.0, "reward/max": 1.0,
               "experience_pipeline/in": 16, "experience_pipeline/reward_shaping_mapper/out": 16,
               "experience_pipeline/reward_filter/out": 0, "experience_pipeline/kept": 0}
    kept = {**emptied, "experience_pipeline/reward_filter/out": 4, "experience_pipeline/kept": 4}
    run.check(0, emptied, None)
    run.check(1, emptied, None)
    run.check(2, kept, None)  # a step that kept some: the count starts again
    run.check(3, emptied, None)
    run.check(4, emptied, None)
    with pytest.raises(RunError) as e:
        run.check(5, emptied, None)  # the third in a row: explorer.max_failed_steps (3)
    assert str(e.value) == (
        "the experience pipeline (data_processor.experience_pipeline.operators) kept none of the experiences of the "
        "last 3 steps (16 in the last step; reward_filter left none), so nothing was trained on. Loosen "
        "reward_filter's args or remove it, then run the same command again to resume from the newest checkpoint: "
        "none yet. explorer.max_failed_steps=3 sets how many such steps stop a run (0: never).")
    # max_failed_steps=0: never; a step of no experiences at all is the failed-tasks check's
    run = stage_run_of(compose_cfg(["stages=[]", "explorer.max_failed_steps=0"]), tmp_path, total_steps=10)
    for step in range(5):
        run.check(step, emptied, None)


def test_every_task_failed_as_the_reward_models_worker_died_names_the_reward_model_and_its_log(tmp_path, monkeypatch):
    """The worker's process killed (the OOM killer): every call raised, every task failed, and the
    run's last paragraph said "Fix the reward function" of a reward nothing was wrong with. It
    names the reward model (its model_path), the worker's log and what to change."""
    from types import SimpleNamespace

    import ray
    import ray.exceptions

    import rft.rewards.reward_model as rm
    from rft.errors import RunError
    from rft.rollout.explorer import last_failure, run_jobs

    monkeypatch.setattr(rm, "_in_ray_actor", lambda: True)  # an explorer's client: the worker is an actor
    client = rm.RewardModelReward("/models/rm")
    client._actor = SimpleNamespace(run=SimpleNamespace(remote=lambda *args: "a future"))

    def dead(future, *args, **kwargs):
        raise ray.exceptions.ActorDiedError()

    monkeypatch.setattr(ray, "get", dead)
    task = SimpleNamespace(task_id="0", answer="357", row={}, messages=[])
    # the explorer's scoring of two groups, then its counters as the step's explorers hand them on
    _, c = run_jobs(lambda job: client(*job), [("042+315=", ["357"], task)] * 2, runners=1, timeout=5.0, retries=0)
    failure = last_failure(c, "reward")
    died = (f"WorkerDied: the reward model worker {client.name} (model_path '/models/rm') died: ActorDiedError: The "
            f"actor died unexpectedly before finishing this task. Ray restarts it up to cluster.max_actor_restarts times "
            f"(the task is retried meanwhile, explorer.max_retry_times); why it died is in its log, "
            f"<stage>/log/{client.name}.log (or the system's, for the OOM killer).")
    assert failure == (("reward_model", client.name, "/models/rm"), died)
    run = stage_run_of(compose_cfg(["stages=[]"]), tmp_path, total_steps=2)
    run.check(0, FAILED_STEP, failure)
    with pytest.raises(RunError) as e:
        run.check(1, FAILED_STEP, failure)
    log = tmp_path / "log"
    assert str(e.value) == (
        f"every task of the last 2 steps failed (reward model '/models/rm', whose worker {client.name} died: 8 errors "
        f"and 0 timeouts in the last step; the last error: {died}), so nothing can be learned. Each explorer's log in "
        f"{log} has the details. Find why the worker died in its log, {log / client.name}.log (or the system's, for the "
        f"OOM killer: give the reward model more memory, a smaller args.batch_size or args.max_length, or a device of "
        f"its own with args.colocate=false), then run the same command again to resume from the newest checkpoint: "
        f"none yet. explorer.max_failed_steps=3 sets how many such steps stop a run (0: never).")


def zero_reward_warnings(overrides: list[str], tmp_path) -> list[str]:
    """What the learning-signal check prints after 3 steps whose every reward is 0."""
    from types import SimpleNamespace

    run = stage_run_of(compose_cfg(["stages=[]", *overrides]), tmp_path, total_steps=10)
    printed = []
    run.monitor = SimpleNamespace(print=printed.append)
    for step in range(3):
        run.check(step, {"rollout/experiences": 8, "reward/min": 0.0, "reward/max": 0.0}, None)
    return printed


def test_equal_rewards_of_a_multi_turn_run_name_the_environment_not_an_unused_reward(tmp_path):
    # it said "Check the reward function ('exact_match')", which a multi-turn conversation never calls
    printed = zero_reward_warnings(["model=tiny_tools", "task=calculator"], tmp_path)
    assert printed == ["[grpo] WARNING: every reward of the first 3 steps was 0: the advantages are all 0 and nothing "
                       "is learned. Check the environment ('calculator.step(text)') and that "
                       "buffer.explorer_input.taskset.format.response_key='answer' names the column of reference "
                       "answers (task.answer)."]


def an_agent(client, task, model, seed):
    """An openai_agent agent (planning checks its signature; never called here)."""


def test_equal_rewards_of_an_agent_run_name_the_agent_not_the_reward_function(tmp_path):
    # it said "Check the reward function ('exact_match')": the agent's return value is the reward
    printed = zero_reward_warnings(["buffer.explorer_input.taskset.workflow=openai_agent",
                                    "+buffer.explorer_input.taskset.workflow_args.agent=test_runtime_units.an_agent",
                                    "explorer.rollout_model.enable_openai_api=true"], tmp_path)
    assert printed == ["[grpo] WARNING: every reward of the first 3 steps was 0: the advantages are all 0 and nothing "
                       "is learned. Check the agent ('test_runtime_units.an_agent(client, task, ...)') and that "
                       "buffer.explorer_input.taskset.format.response_key='answer' names the column of reference "
                       "answers (task.answer)."]


class ReturnsAnInt:
    """An environment whose step answers 1 (a reward) instead of (message, parts, done)."""

    stop: list = []

    def __init__(self):
        self.info = {}

    def reset(self, task):
        return task.messages

    def step(self, text):
        return 1


@pytest.mark.slow  # an engine
def test_an_environment_of_the_wrong_shape_stops_the_explorer_with_its_name_not_a_traceback(caplog):
    """The explorer wrapped the workflow's error in "workflow 'multi_turn' raised TypeError: cannot
    unpack non-iterable int object" and printed its traceback on the console."""
    from rft.data.tasks import ensure_task_data
    from rft.models import ensure_model

    cfg = compose_cfg(["stages=[]", "cluster=inline", "model=tiny_tools", "task=calculator", "buffer.batch_size=2",
                       "algorithm.repeat_times=2", "buffer.explorer_input.eval_tasksets=[]",
                       "buffer.explorer_input.taskset.workflow_args.env=test_runtime_units.ReturnsAnInt"])
    ensure_model(cfg.model)
    ensure_task_data(cfg.buffer.explorer_input)
    with pytest.raises(ConfigError) as e:
        Explorer(cfg).explore(0)
    assert str(e.value).startswith("test_runtime_units.ReturnsAnInt.step(text) (turn 1) returned int 1; it must return")
    assert not [r for r in caplog.records if r.levelno >= 30 and r.exc_info]  # no traceback for the console


# ---------------------------------------------------------------- joining a Ray cluster

NO_RAY_FIX = ("Start the Ray cluster before the run (`ray start --head` on the head node, `ray start "
              "--address=<head>:6379` on the others; launchers/ray_slurm.sbatch does both in a Slurm job), give the "
              "head's host:port (`ray status` there prints it), or set cluster.ray_address=null for a Ray instance "
              "of the run's own.")


def closed_port() -> int:
    import socket

    with socket.socket() as s:  # bound, then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("scheme", ["", "ray://"])
def test_a_ray_address_where_nothing_listens_is_one_paragraph_at_once(tmp_path, scheme, monkeypatch):
    # ray.init printed GCS retry lines for minutes (over 200 s here) before it failed
    import ray

    from rft.runtime import main

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # another test's instance in this process

    port = closed_port()
    cfg = compose_cfg(["cluster=ray", f"cluster.ray_address={scheme}127.0.0.1:{port}"])
    with pytest.raises(ConfigError) as e:
        main._start_ray(cfg, tmp_path)
    assert str(e.value) == (f"cluster.ray_address={scheme}127.0.0.1:{port}: nothing answers at 127.0.0.1:{port} "
                            f"(Connection refused). " + NO_RAY_FIX)


def test_auto_on_a_node_without_ray_is_one_paragraph(tmp_path, monkeypatch):
    # Ray's ConnectionError was a traceback; its words (Ray 2.x) are kept in the paragraph
    import ray

    from rft.runtime import main

    def no_cluster(**kwargs):
        assert kwargs["address"] == "auto"
        raise ConnectionError("Could not find any running Ray instance. Please specify the one to connect to by "
                              "setting `--address` flag or `RAY_ADDRESS` environment variable.")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", no_cluster)
    with pytest.raises(ConfigError) as e:
        main._start_ray(compose_cfg(["cluster=ray", "cluster.ray_address=auto"]), tmp_path)
    assert str(e.value) == ("cluster.ray_address=auto: no Ray cluster runs on this node (Ray: Could not find any "
                            "running Ray instance. Please specify the one to connect to by setting `--address` flag "
                            "or `RAY_ADDRESS` environment variable). " + NO_RAY_FIX)
