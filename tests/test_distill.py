"""On-policy distillation (algorithm=opd, algorithm.distill_coef): the per-token advantage, the
teacher reading the student's own token ids, and the config's errors."""

import pytest
import torch
from conftest import compose_cfg

from rft.algorithms.distill import distill_advantage, reverse_kl
from rft.errors import ConfigError
from rft.models import build_tiny_model, ensure_model, load_tokenizer
from rft.plan.batch import make_plan, stage_configs


def test_the_advantage_is_the_teacher_minus_the_student_log_prob_on_each_counted_token():
    teacher = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -3.0]])
    student = torch.tensor([[-1.5, -1.0, -9.0], [-0.5, -2.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    # row 0: -1.0 - -1.5 = 0.5 (the teacher likes the token more: pushed up), -2.0 - -1.0 = -1.0,
    #        the third token is not counted: 0;  row 1: 0.0, -0.5 - -2.0 = 1.5, -3.0 - -1.0 = -2.0
    assert distill_advantage(teacher, student, mask).tolist() == [[0.5, -1.0, 0.0], [0.0, 1.5, -2.0]]
    # the reverse KL estimate: mean over the 5 counted tokens of student - teacher
    # = (-0.5 + 1.0 + 0.0 - 1.5 + 2.0) / 5 = 0.2
    assert reverse_kl(teacher, student, mask) == pytest.approx(0.2)
    assert reverse_kl(teacher, student, torch.zeros_like(mask)) == 0.0
    assert not distill_advantage(teacher.requires_grad_(), student, mask).requires_grad


def _plan(overrides):
    cfg = stage_configs(compose_cfg(["cluster=inline", *overrides]))[-1]
    return make_plan(cfg, 2000)


def test_distillation_without_a_teacher_or_with_an_imitation_loss_is_refused():
    with pytest.raises(ConfigError) as e:
        _plan(["algorithm=opd"])
    assert str(e.value) == (
        "algorithm.distill_coef=1.0 distils from a teacher, but algorithm.teacher_model_path is not set. Give the "
        "teacher: a local directory or a hub id of a causal LM with the policy's tokenizer "
        "(algorithm.teacher_model_path=<path>), or set algorithm.distill_coef=0.")
    with pytest.raises(ConfigError) as e:
        _plan(["algorithm=sft", "stages=[]", "algorithm.distill_coef=0.5", "algorithm.teacher_model_path=t"])
    assert "algorithm.policy_loss_fn=sft never reads (it imitates given tokens)" in str(e.value)
    # the default's warm-up stage turns the term off (it inherits the RL stage's algorithm)
    cfgs = stage_configs(compose_cfg(["cluster=inline", "algorithm=opd", "algorithm.teacher_model_path=t"]))
    assert [c.algorithm.distill_coef for c in cfgs] == [0.0, 1.0]
    plan = make_plan(cfgs[1], 2000)
    assert plan.needs.teacher and not plan.needs.reference and not plan.needs.grouped


def _trainer(teacher, extra=()):
    from rft.trainer.trainer import Trainer

    cfg = stage_configs(compose_cfg(["stages=[]", "cluster=inline", "algorithm=opd",
                                     f"algorithm.teacher_model_path={teacher}", *extra]))[0]
    ensure_model(cfg.model)
    return cfg, Trainer(cfg, make_plan(cfg, 2000))


@pytest.mark.slow  # two tiny models built and a trainer (~5 s)
def test_the_teacher_scores_the_sampled_ids_not_a_retokenisation(tmp_path):
    from transformers import AutoModelForCausalLM

    from rft.data.experience import Experience

    # "12" is one token of this tokenizer; the records below spell it "1" "2", as a model may sample
    extra = ["model.extra_tokens=[12]", f"model.model_path={tmp_path / 'student'}"]
    teacher_dir = build_tiny_model(tmp_path / "teacher", seed=1, extra_tokens=["12"])
    cfg, trainer = _trainer(teacher_dir, extra)
    tok = load_tokenizer(cfg.model)
    one, two, merged = (tok.convert_tokens_to_ids(t) for t in ("1", "2", "12"))
    prompt = list(tok.apply_chat_template([{"role": "user", "content": "5+7"}], add_generation_prompt=True,
                                          return_dict=True)["input_ids"])
    exps = [Experience(prompt + [one, two, tok.eos_token_id], len(prompt), [0.0] * 3, group_id="a"),
            Experience(prompt + [merged, tok.eos_token_id], len(prompt), [0.0] * 2, group_id="b")]
    assert tok.encode(tok.decode([one, two]), add_special_tokens=False) == [merged]  # the text re-tokenises
    step = trainer._prepare(exps)

    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    for i, e in enumerate(exps):
        with torch.no_grad():
            logp = torch.log_softmax(teacher(torch.tensor([e.tokens])).logits[0].float(), -1)
        want = [logp[t - 1, e.tokens[t]].item() for t in range(e.prompt_length, len(e.tokens))]
        got = step.teacher_logp[i, e.prompt_length - 1: len(e.tokens) - 1].tolist()
        assert got == pytest.approx(want, abs=1e-5)
        # advantage_fn none gives 0: the advantage is the distillation term alone
        adv = step.adv[i, e.prompt_length - 1: len(e.tokens) - 1]
        old = step.old_logp[i, e.prompt_length - 1: len(e.tokens) - 1]
        assert adv.tolist() == pytest.approx([w - o for w, o in zip(want, old.tolist())], abs=1e-5)
    # the first record's first response token is "1", not "12": its teacher log-prob is the one of "1"
    assert abs(step.teacher_logp[0, len(prompt) - 1].item() - step.teacher_logp[1, len(prompt) - 1].item()) > 1e-4
    metrics = trainer.train_step(exps)
    assert metrics["distill/reverse_kl"] == pytest.approx(reverse_kl(step.teacher_logp, step.old_logp, step.mask))
    assert all(not p.requires_grad for p in trainer.teacher_model.parameters())


@pytest.mark.slow  # a tiny model built and a trainer started
def test_a_teacher_with_another_tokenizer_is_a_config_error(tmp_path):
    teacher_dir = build_tiny_model(tmp_path / "teacher", seed=1, extra_tokens=["12"])
    with pytest.raises(ConfigError) as e:
        _trainer(teacher_dir)
    msg = str(e.value)
    assert msg.startswith(f"algorithm.teacher_model_path='{teacher_dir}' has another tokenizer than the policy")
    assert "the teacher has 1 more tokens" in msg and "must share its tokenizer" in msg
