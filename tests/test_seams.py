"""The seams a study extends without touching rft/, each given as a dotted path into the study's
module (this one; README "Extension points"): a workflow of its own (here two turns, the second
user turn masked out of the loss), an algorithm that needs a reference model, a loss with a
hyperparameter of its own (algorithm.args), a reward with its own args, a rollout engine, a
trainer backend and a tool environment."""

from pathlib import Path

import pytest
import torch
from conftest import compose_cfg

from rft.algorithms import needs
from rft.algorithms.losses import ppo_clip_loss
from rft.data.buffer import read_experiences
from rft.data.experience import Experience, collate
from rft.data.readers import encode_prompt
from rft.registry import EngineInfo, TrainerBackendInfo
from rft.rollout.engines.hf import HFEngine
from rft.trainer.trainer import Trainer

SECOND_TURN = "+0="  # the fixed user turn between the model's two answers
SEEN: dict[str, list] = {"masks": [], "exps": [], "ref_logp": [], "old_logp": [], "scale": [], "generate": [],
                         "train_step": [], "bonus": [], "tracked": []}


def two_turn(tasks, engine, ctx):
    """Answer, hear a fixed second user turn, answer again; the reward checks the last answer.
    The second user turn's tokens sit inside the response, with loss_mask 0."""
    tok = ctx.tokenizer
    user = tok.encode(ctx.args.get("second_turn", SECOND_TURN), add_special_tokens=False)
    prompts = [encode_prompt(tok, t.messages, ctx.max_prompt_tokens) for t in tasks]
    first = engine.generate(prompts, ctx.n, ctx.rollout_args, seed=ctx.seed)
    convs = [(i, p + s.token_ids + user, s) for i, (p, group) in enumerate(zip(prompts, first)) for s in group]
    second = engine.generate([c for _, c, _ in convs], 1, ctx.rollout_args, seed=ctx.seed + 1)
    texts = [[] for _ in tasks]
    for (i, _, _), (s2,) in zip(convs, second):
        texts[i].append(tok.decode(s2.token_ids, skip_special_tokens=True))
    rewards = ctx.score([(tok.decode(p), t, task) for p, t, task in zip(prompts, texts, tasks)])
    out = [[] if r is not None else None for r in rewards]
    for k, ((i, conv, s1), (s2,)) in enumerate(zip(convs, second)):
        if rewards[i] is None:
            continue
        out[i].append(Experience(
            tokens=conv + s2.token_ids, prompt_length=len(prompts[i]),
            logprobs=s1.logprobs + [0.0] * len(user) + s2.logprobs,
            loss_mask=[1] * len(s1.token_ids) + [0] * len(user) + [1] * len(s2.token_ids),
            reward=rewards[i][k % ctx.n], group_id=f"{ctx.step}/{ctx.seed}/{tasks[i].task_id}",
            task_id=tasks[i].task_id, policy_version=ctx.policy_version,
        ))
    return out


def raising_workflow(tasks, engine, ctx):
    raise KeyError("no such tool")


def recording_loss(logp, batch, cfg):
    """PPO's loss, recording the mask the trainer hands it."""
    SEEN["masks"].append(batch["response_mask"].detach().clone())
    return ppo_clip_loss(logp, batch, cfg)


@needs(reference=True)
def anchored_loss(logp, batch, cfg):
    """A study's algorithm: PPO, plus imitating its own samples (so the policy moves even when every
    reward is 0, as on the untrained tiny model), plus a squared pull towards the reference."""
    SEEN["ref_logp"].append(batch["ref_logp"].detach().clone())
    SEEN["old_logp"].append(batch["old_logp"].detach().clone())
    loss, metrics = ppo_clip_loss(logp, batch, cfg)
    return loss - logp + 0.1 * (logp - batch["ref_logp"]) ** 2, metrics


def scaled_loss(logp, batch, cfg, scale: float):
    """A study's loss with a hyperparameter of its own, which no key of rft's config holds: PPO's,
    times `scale` (+algorithm.args.scale=...)."""
    SEEN["scale"].append(scale)
    loss, metrics = ppo_clip_loss(logp, batch, cfg)
    return scale * loss, metrics


def bonus_reward(prompt, response, task, bonus: float = 0.0):
    """A study's reward with an argument of its own: exact match plus `bonus`."""
    from rft.rewards.verifiers import exact_match

    SEEN["bonus"].append(bonus)
    return exact_match(prompt, response, task) + bonus


class RecordingEngine(HFEngine):
    """A study's rollout engine (the methods of rft/rollout/engines/base.py): here the HF engine,
    recording each generate call."""

    info = EngineInfo()

    def generate(self, prompts, n, args, seed):
        SEEN["generate"].append(len(prompts) * n)
        return super().generate(prompts, n, args, seed)


class RecordingTrainer(Trainer):
    """A study's trainer backend (the methods of rft/trainer/base.py): here the one-process
    trainer, recording each step's experiences."""

    info = TrainerBackendInfo()

    def train_step(self, exps):
        SEEN["train_step"].append(len(exps))
        return super().train_step(exps)


class TwoTriesEnv:
    """A study's environment (the shape rft/rollout/environments/tools.py describes), written from
    scratch: the model answers, hears "Once more.", answers again; the second answer is scored,
    and trying twice earns a part of its own."""

    stop = list("0123456789")  # a turn ends at its first digit (kept in the turn)

    def __init__(self, tried: float = 0.5):
        self.tried, self.turn, self.info = tried, 0, {"turns": 0}

    def reset(self, task):
        self.task = task
        return task.messages

    def step(self, text):
        self.turn += 1
        self.info["turns"] = self.turn
        if self.turn == 1:
            return "Once more.", {"tried": self.tried}, False
        return None, {"correct": float(text.strip() == self.task.answer)}, True


class RecordingTracker:
    """A study's metrics tracker (monitor.monitor_type; rft/reporting/monitor.py says its methods)."""

    def __init__(self, cfg, run_dir, stage, start_step):
        self.stage = stage

    def log(self, step, metrics):
        SEEN["tracked"].append((self.stage, step, metrics.get("reward/mean")))

    def close(self):
        SEEN["tracked"].append((self.stage, "closed", None))


def test_collate_takes_the_loss_mask_and_checks_its_length():
    e = Experience([5, 6, 7, 8, 9], 2, [-1.0, -1.0, -1.0], loss_mask=[1, 0, 1])
    # targets are tokens 1..4; the response tokens 7, 8, 9 are targets 1, 2, 3
    assert collate([e], 0)["response_mask"].tolist() == [[0.0, 1.0, 0.0, 1.0]]
    plain = Experience([5, 6, 7, 8, 9], 2, [-1.0, -1.0, -1.0])
    assert collate([plain], 0)["response_mask"].tolist() == [[0.0, 1.0, 1.0, 1.0]]
    with pytest.raises(ValueError, match="loss_mask has 2 entries for 3 response tokens"):
        collate([Experience([5, 6, 7, 8, 9], 2, [], loss_mask=[1, 0])], 0)
    # rows of other lengths are right-padded: ids with the pad id, masks with 0
    short = Experience([5, 6, 7], 1, [-1.0, -1.0])
    out = collate([plain, short], 0)
    assert out["input_ids"].tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 0, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert out["response_mask"].tolist() == [[0.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]]
    assert out["prompt_length"].tolist() == [2, 1]
    with pytest.raises(ValueError, match="prompt_length 0: a response needs a prompt of at least one token"):
        collate([Experience([5, 6, 7], 0, [])], 0)


def test_a_workflow_that_returns_the_wrong_shape_is_named():
    from rft.errors import ConfigError
    from rft.rollout.workflows.single_turn import check_output

    good = Experience([5, 6, 7, 8], 2, [-1.0, -1.0], loss_mask=[1, 0], task_id="t/0", group_id="0/1/t/0")
    check_output([[good], None], [0, 1], "my.workflow")  # None: a failed task
    bad = Experience([5, 6, 7, 8], 2, [-1.0, -1.0], loss_mask=[1, 0, 1], task_id="t/1", group_id="0/1/t/1")
    with pytest.raises(ConfigError) as e:
        check_output([[bad]], [0], "my.workflow")
    assert str(e.value) == (
        "workflow 'my.workflow' returned an experience (task 't/1') whose loss_mask has 3 entries for its 2 "
        "response tokens: it needs one per token after the prompt (tokens[prompt_length:]), or none.")
    with pytest.raises(ConfigError, match="returned list of 1 entries for 2 tasks; it must return one entry per task"):
        check_output([[good]], [0, 1], "my.workflow")
    with pytest.raises(ConfigError) as e:
        check_output([[Experience([5, 6], 0, [], task_id="t/2", group_id="0/1/t/2")]], [0], "my.workflow")
    assert str(e.value) == (
        "workflow 'my.workflow' returned an experience (task 't/2') with prompt_length 0: the response's "
        "first token is predicted from the prompt, so prompt_length must be at least 1 (the prompt's "
        "token count: tokens[:prompt_length]).")


def test_a_misspelt_workflow_fails_while_planning():
    from rft.errors import ConfigError
    from rft.plan.batch import make_plan

    with pytest.raises(ConfigError, match=r"buffer.explorer_input.taskset.workflow='single_turns' is not one of "
                                          r"\['multi_turn', 'openai_agent', 'single_turn'\]; give a registered name or the dotted path"):
        make_plan(compose_cfg(["stages=[]", "buffer.explorer_input.taskset.workflow=single_turns"]), 2000)


def no_context(tasks, engine):
    return [None for _ in tasks]


def test_a_workflow_of_the_wrong_shape_fails_while_planning():
    """A study's workflow must take (tasks, engine, ctx): one that cannot is found before the run,
    not as a failure of every task."""
    from rft.errors import ConfigError
    from rft.plan.batch import _check_workflow, make_plan
    from rft.registry import resolve
    from rft.rollout.workflows.single_turn import WORKFLOWS

    with pytest.raises(ConfigError) as e:
        make_plan(compose_cfg(["stages=[]", "buffer.explorer_input.taskset.workflow=test_seams.no_context"]), 2000)
    assert str(e.value) == (
        "buffer.explorer_input.taskset.workflow='test_seams.no_context' cannot be called as fn(tasks, engine, ctx) "
        "(too many positional arguments); its signature is test_seams.no_context(tasks, engine). A workflow takes "
        "the step's tasks, the engine and the context (ctx.args holds workflow_args) and returns one list of "
        "Experience (or None) per task.")
    # the registered ones and the test's own two-turn workflow pass
    for wf in ("single_turn", "multi_turn", "openai_agent", "test_seams.two_turn"):
        _check_workflow(resolve(WORKFLOWS, wf, "workflow"), wf, "workflow")


def _run(tmp_path, *overrides):
    import rft.runtime.main

    for v in SEEN.values():
        v.clear()
    cfg = compose_cfg(["stages=[]", "cluster=inline", "monitor=console", f"checkpoint_root_dir={tmp_path}",
                       "buffer.batch_size=4", "algorithm.repeat_times=2", "buffer.total_steps=2",
                       "explorer.eval_on_startup=false", "buffer.explorer_input.eval_tasksets=[]",
                       "model.max_response_tokens=4", *overrides])
    rft.runtime.main.main(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("buffer", ["queue", "sql"])
def test_a_two_turn_workflow_runs_through_the_buffer_into_the_trainer(tmp_path, buffer):
    _run(tmp_path, f"buffer={buffer}", "buffer.explorer_input.taskset.workflow=test_seams.two_turn",
         f"+buffer.explorer_input.taskset.workflow_args.second_turn='{SECOND_TURN}'",
         "algorithm.policy_loss_fn=test_seams.recording_loss", "name=two_turn")
    # 2 steps x 4 tasks x 2 rollouts, one micro-batch per step (micro_batch_size_per_gpu >= 8)
    assert len(SEEN["masks"]) == 2
    if buffer == "sql":
        from rft.models import load_tokenizer

        user_ids = load_tokenizer(compose_cfg().model).encode(SECOND_TURN, add_special_tokens=False)
        stored = read_experiences(str(tmp_path / "rft" / "two_turn" / "buffer.db"), 100)
        assert len(stored) == 16
        for e in stored:
            assert e.loss_mask.count(0) == len(user_ids) and len(e.loss_mask) == e.response_length
            # the zeros are one block, and it holds the second user turn's tokens
            first = e.loss_mask.index(0)
            assert e.loss_mask[first:first + len(user_ids)] == [0] * len(user_ids)
            assert e.tokens[e.prompt_length + first:e.prompt_length + first + len(user_ids)] == user_ids
        # the trainer's mask of step 1 is the workflow's, token for token
        mask = SEEN["masks"][0]
        for row, e in zip(mask, stored[:8]):
            want = torch.zeros(row.shape[0])
            want[e.prompt_length - 1:e.prompt_length - 1 + len(e.loss_mask)] = torch.tensor(e.loss_mask, dtype=torch.float32)
            assert torch.equal(row, want)
    else:
        for mask in SEEN["masks"]:
            # every row masks out exactly the second user turn's tokens between its answered ones
            assert mask.shape[0] == 8
            for row in mask:
                ones = row.nonzero().flatten().tolist()
                assert len(ones) >= 2 and (ones[-1] - ones[0] + 1) - len(ones) == len(SECOND_TURN)


@pytest.mark.slow
def test_an_algorithm_that_needs_a_reference_model_given_as_a_dotted_path(tmp_path):
    _run(tmp_path, "algorithm.policy_loss_fn=test_seams.anchored_loss", "name=anchored", "algorithm.optimizer.lr=1e-2")
    assert len(SEEN["ref_logp"]) == 2
    # step 1 trains the starting weights: the reference (the starting model) gives the same
    # log-probs as the current weights; by step 2 the policy has moved away from it
    assert torch.allclose(SEEN["ref_logp"][0], SEEN["old_logp"][0], atol=1e-6)
    assert (SEEN["ref_logp"][1] - SEEN["old_logp"][1]).abs().max() > 1e-3


@pytest.mark.slow
def test_a_study_engine_trainer_loss_and_reward_of_its_own_run_a_stage(tmp_path):
    """Five seams in one run, each a dotted path into this module, rft/ untouched."""
    _run(tmp_path, "name=own_parts", "explorer.rollout_model.engine_type=test_seams.RecordingEngine",
         "trainer.trainer_strategy=test_seams.RecordingTrainer",
         "algorithm.policy_loss_fn=test_seams.scaled_loss", "+algorithm.args.scale=0.25",
         "buffer.explorer_input.taskset.reward_fn={fn: test_seams.bonus_reward, args: {bonus: 0.5}}",
         "monitor.monitor_type=[test_seams.RecordingTracker]")
    # 2 steps of 4 tasks x 2 rollouts: generated by the study's engine, trained by its trainer
    # with its loss at its own scale, scored by its reward with its own bonus
    assert SEEN["generate"] == [8, 8]
    assert SEEN["train_step"] == [8, 8]
    assert SEEN["scale"] == [0.25, 0.25]
    assert SEEN["bonus"] and set(SEEN["bonus"]) == {0.5}
    # and its tracker saw each step's metrics, with the reward its reward gave (at least the bonus)
    steps = [(step, reward) for stage, step, reward in SEEN["tracked"] if step in (1, 2)]
    assert [step for step, _ in steps] == [1, 2] and all(r >= 0.5 for _, r in steps)
    assert SEEN["tracked"][-1] == ("grpo", "closed", None)


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.policy_loss_fn=test_seams.scaled_loss"],
     "algorithm.policy_loss_fn=test_seams.scaled_loss needs ['scale'] in algorithm.args, which has no default: "
     "set +algorithm.args.scale=<value>."),
    (["algorithm.policy_loss_fn=test_seams.scaled_loss", "+algorithm.args.scale=1", "+algorithm.args.scael=2"],
     "algorithm.args has ['scael'], which algorithm.policy_loss_fn=test_seams.scaled_loss does not take; its own "
     "arguments are ['scale'] (the rest of its settings are the algorithm.* keys it reads from cfg). Did you mean "
     "scale (not scael)?"),
    # a built-in loss reads its settings from the algorithm section: it takes no args
    (["+algorithm.args.clip=0.1"],
     "algorithm.args has ['clip'], which algorithm.policy_loss_fn=ppo_clip does not take; its own arguments are [] "
     "(the rest of its settings are the algorithm.* keys it reads from cfg)."),
    (["+algorithm.advantage_args.eps=0.1"],
     "algorithm.advantage_args has ['eps'], which algorithm.advantage_fn=grpo does not take; its own arguments are "
     "[] (the rest of its settings are the algorithm.* keys it reads from cfg)."),
    (["trainer.trainer_strategy=test_seams.nowhere"],
     "trainer.trainer_strategy='test_seams.nowhere': cannot import it (AttributeError: module 'test_seams' has no "
     "attribute 'nowhere')."),
    # a misspelt name: the module's own functions nearest to it (not what it imported: pytest)
    (["algorithm.policy_loss_fn=test_seams.scaled_los"],
     "algorithm.policy_loss_fn='test_seams.scaled_los': cannot import it (AttributeError: module 'test_seams' has no "
     "attribute 'scaled_los'). Did you mean test_seams.scaled_loss?"),
])
def test_a_study_function_s_own_args_are_checked_against_its_signature_when_planning(overrides, message):
    from rft.errors import ConfigError
    from rft.plan.batch import check_config

    with pytest.raises(ConfigError) as e:
        check_config(compose_cfg(["stages=[]", *overrides]))
    assert str(e.value) == message


def test_a_study_loss_gets_its_args_bound():
    from rft.algorithms import POLICY_LOSS_FNS, with_args

    fn = with_args(POLICY_LOSS_FNS, "test_seams.scaled_loss", {"scale": 3.0}, "algorithm.args")
    assert fn.keywords == {"scale": 3.0} and fn.func is scaled_loss
    # a registered loss without args is the function itself
    assert with_args(POLICY_LOSS_FNS, "ppo_clip", {}, "algorithm.args") is ppo_clip_loss


@pytest.mark.slow  # an engine
def test_a_study_environment_of_its_own_runs_its_conversations():
    from rft.data.tasks import ensure_task_data
    from rft.models import ensure_model
    from rft.rollout.explorer import Explorer

    cfg = compose_cfg(["stages=[]", "cluster=inline", "model=tiny_tools", "task=calculator", "buffer.batch_size=2",
                       "algorithm.repeat_times=2", "buffer.explorer_input.eval_tasksets=[]", "model.max_response_tokens=32",
                       "buffer.explorer_input.taskset.workflow_args.env=test_seams.TwoTriesEnv",
                       "+buffer.explorer_input.taskset.workflow_args.env_args.tried=0.25"])
    ensure_model(cfg.model)
    ensure_task_data(cfg.buffer.explorer_input)
    exps, counters = Explorer(cfg).explore(0)
    assert len(exps) == 4 and counters["failed_tasks"] == 0
    both = [e for e in exps if "correct" in e.reward_parts]
    assert both  # conversations that reached the second answer (others ran out of tokens)
    for e in both:
        # two assistant turns with "Once more." between them, masked out of the loss
        assert 0 in e.loss_mask and e.loss_mask[0] == 1 and e.loss_mask[-1] == 1
        # the parts summed: 0.25 for trying twice, plus 0 or 1 for the second answer
        assert e.reward_parts["tried"] == 0.25 and e.reward == 0.25 + e.reward_parts["correct"]


@pytest.mark.slow
def test_a_workflow_that_raises_stops_the_run_with_one_paragraph(tmp_path, capsys, monkeypatch):
    # under Ray, as a real run: the explorer's process imports this module from the path
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    with pytest.raises(SystemExit) as e:
        _run(tmp_path, "buffer.explorer_input.taskset.workflow=test_seams.raising_workflow", "name=raising",
             "cluster=local")
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert ("rft: the run stopped: workflow 'test_seams.raising_workflow' raised KeyError: 'no such tool' "
            "(at step 0; the traceback is in the explorer's log under <stage>/log/).") in err
    assert "Traceback" not in err


@pytest.mark.parametrize("overrides, want", [
    # ppo_clip declares that a row with advantages all 0 adds nothing (an on-policy update skips it)
    ([], dict(grouped=True, zero_at_zero_advantage=True)),  # grpo
    (["algorithm.kl_loss_fn=k3"], dict(grouped=True, reference=True, zero_at_zero_advantage=True)),
    (["algorithm.kl_penalty_fn=k1"], dict(grouped=True, reference=True, zero_at_zero_advantage=True)),
    (["algorithm=dpo"], dict(reference=True, paired=True, imitation=True)),
    (["algorithm=sft"], dict(imitation=True)),
    (["algorithm=ppo"], dict(critic=True, zero_at_zero_advantage=True)),
    (["algorithm.policy_loss_fn=test_seams.anchored_loss"], dict(grouped=True, reference=True)),
])
def test_an_algorithm_config_needs_what_its_functions_declare(overrides, want):
    from rft.algorithms import Needs, algorithm_needs

    assert algorithm_needs(compose_cfg(overrides).algorithm) == Needs(**want)
