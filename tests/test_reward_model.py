"""Reward models on a worker of their own (rft/rewards/reward_model.py): the scores against hand
computations, batching and padding, the config errors, where the workers are placed, and a run
whose reward model answers from its own Ray actor."""

import math
import re
import threading
from types import SimpleNamespace

import pytest
import torch
from conftest import compose_cfg

import rft.runtime.main
from rft.data.buffer import read_experiences
from rft.errors import ConfigError
from rft.models import build_tiny_model
from rft.plan.placement import check_placement, reward_models
from rft.reporting.monitor import read_metrics
from rft.rewards.reward_model import RewardModelReward, RewardModelWorker, local_worker, worker_args, worker_name
from rft.rewards.scoring import build

THETA = 0.37  # the engineered classifier scores the last token t as cos(THETA * (t - id("7")))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("rm") / "tiny")


def _classifier(tiny, path, num_labels=1, engineered=False, seed=0):
    from transformers import AutoConfig, AutoTokenizer, Qwen2ForSequenceClassification

    tok = AutoTokenizer.from_pretrained(tiny)
    config = AutoConfig.from_pretrained(tiny)
    config.num_labels = num_labels
    config.pad_token_id = tok.pad_token_id
    torch.manual_seed(seed)
    model = Qwen2ForSequenceClassification(config)
    if engineered:
        # every layer adds nothing to the residual stream (o_proj and down_proj are zero), so the
        # last hidden state is norm(embedding of the token): the score is a function of the last
        # token alone. Each embedding has RMS 1 in the plane of dims 0 and 1 at angle theta_t, and
        # the head reads dim 0: score = cos(theta_t), highest for "7" (up to the norm's eps)
        h = config.hidden_size
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            seven = tok.convert_tokens_to_ids("7")
            theta = THETA * (torch.arange(config.vocab_size) - seven).float()
            emb = torch.zeros(config.vocab_size, h)
            emb[:, 0], emb[:, 1] = math.sqrt(h) * torch.cos(theta), math.sqrt(h) * torch.sin(theta)
            model.model.embed_tokens.weight.copy_(emb)
            model.score.weight.zero_()
            model.score.weight[num_labels - 1, 0] = 1 / math.sqrt(h)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def random_classifier(tiny, tmp_path_factory):
    return _classifier(tiny, tmp_path_factory.mktemp("rm") / "random-cls")


@pytest.fixture(scope="module")
def engineered_classifier(tiny, tmp_path_factory):
    return _classifier(tiny, tmp_path_factory.mktemp("rm") / "cls7", engineered=True)


def engineered_score(tok, text: str) -> float:
    """What the engineered classifier gives `text`, by hand: cos(theta) of its last token."""
    last = tok(text)["input_ids"][-1]
    return math.cos(THETA * (last - tok.convert_tokens_to_ids("7")))


PROMPTS = ["042+315", "1+1", "100+200=", "7", "333+444"]
RESPONSES = ["357", "2", "300 and some more text", "7", ""]
ANSWERS = ["357", "2", "300", "7", "777"]


def test_classifier_scores_a_known_function_of_the_last_real_token(engineered_classifier):
    w = RewardModelWorker(str(engineered_classifier), batch_size=3)
    got = w.score(PROMPTS, RESPONSES, ANSWERS)  # lengths 10 to 28: padded in both chunks
    want = [engineered_score(w.tokenizer, p + r) for p, r in zip(PROMPTS, RESPONSES)]
    assert got == pytest.approx(want, abs=1e-5)
    assert got[0] == pytest.approx(1.0, abs=1e-5) and got[3] == pytest.approx(1.0, abs=1e-5)  # end in "7"
    assert max(got[1], got[2], got[4]) < 0.99


def test_two_labels_score_the_probability_of_label_one(tiny, tmp_path):
    path = _classifier(tiny, tmp_path / "cls2", num_labels=2, engineered=True)
    w = RewardModelWorker(str(path))
    got = w.score(PROMPTS, RESPONSES, ANSWERS)
    # logits (0, cos theta): softmax's label 1 = sigmoid(cos theta)
    want = [1 / (1 + math.exp(-engineered_score(w.tokenizer, p + r))) for p, r in zip(PROMPTS, RESPONSES)]
    assert got == pytest.approx(want, abs=1e-5)


def test_batched_classifier_scores_equal_one_at_a_time(random_classifier):
    batched = RewardModelWorker(str(random_classifier), batch_size=4)
    single = RewardModelWorker(str(random_classifier), batch_size=1)
    a = batched.score(PROMPTS, RESPONSES, ANSWERS)
    b = single.score(PROMPTS, RESPONSES, ANSWERS)
    c = [single.score([p], [r], [x])[0] for p, r, x in zip(PROMPTS, RESPONSES, ANSWERS)]
    assert len({round(x, 4) for x in a}) == len(a)  # random weights: the scores differ
    assert a == pytest.approx(b, abs=1e-5) and b == c
    # padding: the longest text alone, or batched with short ones, scores the same
    assert batched.score(PROMPTS[2:3] * 3 + PROMPTS[:1], RESPONSES[2:3] * 3 + RESPONSES[:1])[0] == \
        pytest.approx(a[2], abs=1e-5)
    assert batched.model.training is False and batched.device == torch.device("cpu")


def test_yes_no_judge_is_p_yes_over_p_yes_plus_p_no_at_the_last_real_token(tiny):
    template = "Q:{prompt} A:{answer} R:{response} ok?"
    w = RewardModelWorker(str(tiny), kind="yes_no", template=template, yes_token="y", no_token="n", batch_size=3)
    got = w.score(PROMPTS, RESPONSES, ANSWERS)
    # by hand: each text alone, unpadded, the logits of "y" and "n" after its last token
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    y, n = tok.convert_tokens_to_ids("y"), tok.convert_tokens_to_ids("n")
    want = []
    for p, r, a in zip(PROMPTS, RESPONSES, ANSWERS):
        ids = torch.tensor([tok(template.format(prompt=p, response=r, answer=a))["input_ids"]])
        with torch.no_grad():
            logits = model(ids).logits[0, -1].double()
        want.append(math.exp(logits[y]) / (math.exp(logits[y]) + math.exp(logits[n])))
    assert got == pytest.approx(want, abs=1e-5)
    assert len({round(x, 4) for x in got}) > 1


def test_yes_no_tokens_must_be_single_tokens(tiny):
    # the tiny tokenizer has a token per character: " yes" (the default) is four, each shown as its text
    # (its vocabulary's space is the byte-level 'Ġ')
    with pytest.raises(ConfigError, match=r"yes_token=' yes' is 4 tokens \[' ', 'y', 'e', 's'\] for the reward model"):
        RewardModelWorker(str(tiny), kind="yes_no")
    with pytest.raises(ConfigError, match="no_token='no' is 2 tokens"):
        RewardModelWorker(str(tiny), kind="yes_no", yes_token="y", no_token="no")


def test_a_chat_template_wraps_the_tasks_question(engineered_classifier, tiny):
    task = SimpleNamespace(task_id="t", answer="7", row={},
                           messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "3+4"}])
    client = RewardModelReward(str(engineered_classifier), chat_template=True)
    worker, _ = local_worker(client.args)
    text = worker.tokenizer.apply_chat_template([{"role": "user", "content": "3+4"},
                                                 {"role": "assistant", "content": "7"}], tokenize=False)
    assert worker.texts(["3+4"], ["7"], ["7"]) == [text]
    # the policy's prompt is not what the reward model reads: the task's question is
    assert client("<policy prompt>", ["7"], task) == pytest.approx([engineered_score(worker.tokenizer, text)], abs=1e-5)
    judge = RewardModelWorker(str(tiny), kind="yes_no", chat_template=True, template="{prompt}={response}?",
                              yes_token="y", no_token="n")
    assert judge.texts(["3+4"], ["7"], [""]) == [
        judge.tokenizer.apply_chat_template([{"role": "user", "content": "3+4=7?"}], tokenize=False,
                                            add_generation_prompt=True)]


@pytest.mark.parametrize("args, message", [
    ({"kind": "regression"}, "kind='regression' is not a reward model kind; choose one of ['classifier', 'yes_no']"),
    ({"template": "{prompt} {reply}"}, "template='{prompt} {reply}' has ['reply']; it may use {answer}, {prompt}, {response}"),
    ({"template": "{prompt}"}, "has no {response}"),
    ({"batch_size": 0}, "batch_size=0 must be an integer >= 1."),
    ({"yes_token": "y"}, "yes_token and no_token are for kind=yes_no"),
    ({"dtype": "fp12"}, "dtype='fp12' is not a dtype"),
    ({"colocate": "yes"}, "colocate='yes' must be true or false."),
])
def test_args_are_checked(args, message):
    with pytest.raises(ConfigError) as e:
        worker_args(model_path="some/model", **args)
    assert message in str(e.value)


def test_a_model_that_does_not_load_names_the_path(tmp_path, random_classifier, tiny):
    with pytest.raises(ConfigError, match=re.escape(f"model_path='{tmp_path}/nothing' could not be loaded as kind=classifier")):
        RewardModelWorker(str(tmp_path / "nothing"))
    three = _classifier(tiny, tmp_path / "cls3", num_labels=3)
    with pytest.raises(ConfigError, match="has num_labels=3; kind=classifier takes 1 .* or 2"):
        RewardModelWorker(str(three))


def test_in_process_clients_share_one_worker_and_score_groups_concurrently(random_classifier):
    """Without Ray (cluster=inline) the client builds the worker here, once for equal args; the
    explorer's threads call it one at a time, and each group scores as it would alone."""
    spec = [{"fn": "exact_match", "weight": 1.0},
            {"fn": "reward_model", "weight": 0.5, "args": {"model_path": str(random_classifier), "batch_size": 2}}]
    a, b = build(spec, "reward_fn"), build(spec, "reward_fn")
    ca, cb = a.parts[1].call, b.parts[1].call
    assert ca._local is cb._local and ca._local[0] is local_worker(ca.args)[0]
    worker = ca._local[0]
    tasks = [SimpleNamespace(task_id=str(i), answer=ANSWERS[i], row={}, messages=[]) for i in range(5)]
    groups = [(PROMPTS[i], [RESPONSES[i], RESPONSES[(i + 1) % 5], "357"], tasks[i]) for i in range(5)]
    alone = [worker.score([p] * 3, rs) for p, rs, _ in groups]
    got = [None] * 5

    def run(i):
        got[i] = (a if i % 2 else b)(*groups[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, rewards in enumerate(got):
        for r, response, rm in zip(rewards, groups[i][1], alone[i]):
            assert r.parts == {"exact_match": float(response == ANSWERS[i]), "reward_model": rm}
            assert float(r) == r.parts["exact_match"] + 0.5 * rm
    assert a.take_counters() == {"reward/reward_model/failures": 0}


def _reward(path, **more):
    args = ", ".join(f"{k}: {v}" for k, v in {"model_path": f"'{path}'", **more}.items())
    return f"[{{fn: exact_match, weight: 1}}, {{fn: reward_model, weight: 0.5, args: {{{args}}}}}]"


@pytest.mark.slow
def test_workers_are_placed_like_engines_one_per_distinct_args():
    taskset = "buffer.explorer_input.taskset.reward_fn="
    evalset = "buffer.explorer_input.eval_tasksets.0.reward_fn="
    # CPU: a bundle of its own after the trainer's and the explorer's, of args.num_cpus (default 1)
    p = check_placement(compose_cfg(["stages=[]", taskset + _reward("/m/rm", num_cpus=2)]))
    assert p.bundles == [{"CPU": 1}, {"CPU": 1}, {"CPU": 2}] and p.slots == ((0, 1.0), (1, 1.0), (2, 1.0))
    (place,) = p.reward_models
    assert place.where == "buffer.explorer_input.taskset.reward_fn[1].args"
    assert place.name == worker_name(worker_args(model_path="/m/rm", num_cpus=2)) and place.name.startswith("reward_model_rm_")
    # the same args in the eval set: one worker; other args: two
    same = compose_cfg(["stages=[]", taskset + _reward("/m/rm"), evalset + _reward("/m/rm")])
    assert len(reward_models(same)) == 1
    other = compose_cfg(["stages=[]", taskset + _reward("/m/rm"), evalset + _reward("/m/rm", batch_size=2)])
    assert [r.where for r in reward_models(other)] == ["buffer.explorer_input.taskset.reward_fn[1].args",
                                                       "buffer.explorer_input.eval_tasksets[0].reward_fn[1].args"]
    # mode=explore does not evaluate: only the taskset's
    explore = compose_cfg(["stages=[]", "mode=explore", "buffer=sql", evalset + _reward("/m/rm")])
    assert reward_models(explore) == []
    # GPU: one GPU of its own, taken before the trainer's
    gpu = check_placement(compose_cfg(["stages=[]", "cluster.gpu_per_node=3", taskset + _reward("/m/rm")]))
    assert gpu.bundles == [{"GPU": 1, "CPU": 1}] * 2 + [{"GPU": 1, "CPU": 1}] and gpu.slots[2] == (2, 1.0)
    with pytest.raises(ConfigError, match=r"the reward models \(buffer.explorer_input.taskset.reward_fn\[1\].args\) need a GPU each"):
        check_placement(compose_cfg(["stages=[]", "cluster.gpu_per_node=2", taskset + _reward("/m/rm")]))
    # colocate: true shares the trainer's bundle, half each
    co = check_placement(compose_cfg(["stages=[]", "cluster.gpu_per_node=2", taskset + _reward("/m/rm", colocate="true")]))
    assert co.bundles == [{"GPU": 1, "CPU": 1}] * 2 and co.slots == ((0, 0.5), (1, 1.0), (0, 0.5))
    # cluster.colocate=true: one more actor sharing the one bundle
    one = check_placement(compose_cfg(["stages=[]", "cluster.colocate=true", taskset + _reward("/m/rm")]))
    assert one.bundles == [{"CPU": 1}] and one.slots == ((0, pytest.approx(1 / 3)),) * 3
    # a bad argument fails the plan, naming the part
    with pytest.raises(ConfigError, match=r"buffer.explorer_input.taskset.reward_fn\[1\].args: kind='judge' is not"):
        check_placement(compose_cfg(["stages=[]", taskset + _reward("/m/rm", kind="judge")]))


def _started_pid(log):
    return int(re.search(r"started in process (\d+)", log.read_text()).group(1))


@pytest.mark.slow
def test_a_run_scores_with_a_reward_model_on_its_own_ray_actor(engineered_classifier, tmp_path):
    """Two GRPO steps with cluster=local: exact_match + 0.5 * a reward model that the runner serves
    from a Ray actor of its own (a third CPU bundle). The stored experiences carry both parts, the
    reward model's are the engineered classifier's scores (by hand), the sum is the reward."""
    from transformers import AutoTokenizer

    cfg = compose_cfg(["stages=[]", "cluster=local", "cluster.num_cpus=3", "buffer=sql", "monitor=console",
                       "buffer.total_steps=2", "buffer.batch_size=4", "algorithm.repeat_times=4",
                       "explorer.eval_on_startup=false", "explorer.eval_interval=2", "trainer.save_interval=2",
                       f"checkpoint_root_dir={tmp_path}",
                       f"buffer.explorer_input.taskset.reward_fn={_reward(engineered_classifier)}"])
    rft.runtime.main.main(cfg)
    stage = tmp_path / "rft" / cfg.name
    # the worker ran in a process of its own, not the explorer's
    (rm_log,) = (stage / "log").glob("reward_model_cls7_*.log")
    assert _started_pid(rm_log) != _started_pid(stage / "log" / "grpo_explorer.log")
    steps = [m for m in read_metrics(stage / "metrics.jsonl") if "reward/mean" in m]
    assert len(steps) == 2
    for m in steps:
        assert m["reward/mean"] == pytest.approx(m["reward/exact_match/mean"] + 0.5 * m["reward/reward_model/mean"])
        assert m["reward/reward_model/failures"] == 0
    tok = AutoTokenizer.from_pretrained(engineered_classifier)
    exps = read_experiences(str(stage / "buffer.db"), limit=1000)
    assert len(exps) == 2 * 4 * 4
    for e in exps:
        assert set(e.reward_parts) == {"exact_match", "reward_model"}
        assert e.reward == pytest.approx(e.reward_parts["exact_match"] + 0.5 * e.reward_parts["reward_model"], abs=1e-12)
        assert e.reward_parts["reward_model"] == pytest.approx(
            engineered_score(tok, e.info["prompt"] + e.info["response"]), abs=1e-5)
    assert len({round(e.reward_parts["reward_model"], 5) for e in exps}) > 1


@pytest.mark.slow
def test_a_ray_worker_that_does_not_load_is_a_config_error_naming_key_and_path(tmp_path):
    import ray

    from rft.runtime.actors import RayActor, start_reward_models, wait_reward_models

    cfg = compose_cfg(["stages=[]", "cluster=local",
                       f"buffer.explorer_input.taskset.reward_fn={_reward(tmp_path / 'nothing')}"])
    ray.init(num_cpus=2, namespace="test_reward_model", include_dashboard=False, log_to_driver=False,
             logging_level="ERROR")
    try:
        options = [{}, {}, {"num_cpus": 1}]  # trainer, explorer, then the reward model's
        workers = start_reward_models(RayActor, cfg, dict(log_dir=str(tmp_path / "log"), level="INFO", threads=1), options)
        assert len(options) == 2 and [w.name for w in workers] == [reward_models(cfg)[0].name]
        with pytest.raises(ConfigError) as e:
            wait_reward_models(workers)
    finally:
        ray.shutdown()
    assert str(e.value).startswith(f"buffer.explorer_input.taskset.reward_fn[1].args: the reward model worker "
                                   f"{workers[0].name} for '{tmp_path}/nothing' did not start: reward model "
                                   f"model_path='{tmp_path}/nothing' could not be loaded as kind=classifier")


def test_a_dead_worker_is_named_with_its_log_not_as_rays_bare_error(monkeypatch):
    """The worker's process killed (by the OOM killer, a SIGKILL): each group's call raised Ray's
    ActorDiedError, a dozen lines of Ray's text that named neither the reward part nor where to
    look, and the run's last message said to fix the reward function. It is one line naming the
    worker, its model and its log; the task is retried, then counted as failed (never scored 0)."""
    import ray
    import ray.exceptions

    import rft.rewards.reward_model as rm

    monkeypatch.setattr(rm, "_in_ray_actor", lambda: True)  # an explorer's client: the worker is an actor
    client = RewardModelReward("/models/rm")
    client._actor = SimpleNamespace(run=SimpleNamespace(remote=lambda *args: "a future"))

    def dead(future, *args, **kwargs):
        raise ray.exceptions.ActorDiedError()

    monkeypatch.setattr(ray, "get", dead)
    task = SimpleNamespace(task_id="0", answer="357", row={}, messages=[])
    with pytest.raises(RuntimeError) as e:
        client("042+315=", ["357", "358"], task)
    assert str(e.value) == (
        f"the reward model worker {client.name} (model_path '/models/rm') died: ActorDiedError: The actor died "
        f"unexpectedly before finishing this task. Ray restarts it up to cluster.max_actor_restarts times (the "
        f"task is retried meanwhile, explorer.max_retry_times); why it died is in its log, "
        f"<stage>/log/{client.name}.log (or the system's, for the OOM killer).")
    assert client.take_counters() == {"failures": 1}
