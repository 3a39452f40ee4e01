"""On-policy distillation (algorithm=opd, algorithm.distill_coef): the per-token advantage, the
teacher reading the student's own token ids, and the config's errors."""

import pytest
import torch
from conftest import compose_cfg

from rft.algorithms.distill import distill_advantage, generalized_jsd, reverse_kl
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
    with pytest.raises(ConfigError) as e:
        _plan(["algorithm=opd", "algorithm.teacher_model_path=t", "algorithm.distill_jsd_beta=1.5"])
    assert str(e.value) == (
        "algorithm.distill_jsd_beta=1.5 must be in [0, 1] (0: the forward KL to the teacher, 1: the reverse KL, 0.5: "
        "the symmetric JSD).")
    with pytest.raises(ConfigError) as e:
        _plan(["algorithm=opd", "algorithm.teacher_model_path=t", "algorithm.distill_top_k=0"])
    assert str(e.value) == ("algorithm.distill_top_k=0 must be >= 1 (the teacher's top tokens the loss compares; 20 "
                            "is common).")
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


def _jsd_full(p_logits, q_logits, beta):
    """JSD_beta over the whole vocabulary, written out on probabilities (float64)."""
    p, q = torch.softmax(p_logits, -1), torch.softmax(q_logits, -1)
    m = beta * p + (1 - beta) * q
    return beta * (p * (p / m).log()).sum(-1) + (1 - beta) * (q * (q / m).log()).sum(-1)


def test_the_generalised_jsd_on_the_teachers_top_tokens_by_hand():
    # vocabulary of 3; the teacher's top 2 tokens and a bucket for the rest:
    # teacher P = [0.5, 0.3 | 0.2], student Q on the same tokens = [0.25, 0.25 | 0.5]
    p = torch.tensor([0.5, 0.3], dtype=torch.float64).log()
    q = torch.tensor([0.25, 0.25], dtype=torch.float64).log()
    # beta 0.5: M = [0.375, 0.275, 0.35]
    # KL(P||M) = 0.5 ln(0.5/0.375) + 0.3 ln(0.3/0.275) + 0.2 ln(0.2/0.35) = 0.143841 + 0.026103 - 0.111923 = 0.058021
    # KL(Q||M) = 0.25 ln(0.25/0.375) + 0.25 ln(0.25/0.275) + 0.5 ln(0.5/0.35) = -0.101366 - 0.023828 + 0.178337 = 0.053143
    # JSD = 0.5 x 0.058021 + 0.5 x 0.053143 = 0.055582
    assert generalized_jsd(p, q, 0.5).item() == pytest.approx(0.055582, abs=2e-6)
    # beta 0: the forward KL(P||Q) = 0.5 ln 2 + 0.3 ln 1.2 + 0.2 ln 0.4 = 0.346574 + 0.054696 - 0.183258 = 0.218012
    assert generalized_jsd(p, q, 0.0).item() == pytest.approx(0.218012, abs=2e-6)
    # beta 1: the reverse KL(Q||P) = 0.25 ln 0.5 + 0.25 ln(0.25/0.3) + 0.5 ln 2.5 = -0.173287 - 0.045580 + 0.458145 = 0.239278
    assert generalized_jsd(p, q, 1.0).item() == pytest.approx(0.239278, abs=2e-6)
    # the ends are the limits of JSD_beta / beta and JSD_beta / (1 - beta)
    assert generalized_jsd(p, q, 1e-6).item() / 1e-6 == pytest.approx(0.218012, abs=1e-5)
    assert generalized_jsd(p, q, 1 - 1e-6).item() / 1e-6 == pytest.approx(0.239278, abs=1e-5)
    # equal distributions: 0; in float32 the same value as in float64
    assert generalized_jsd(p, p, 0.5).item() == pytest.approx(0.0, abs=1e-12)
    assert generalized_jsd(p.float(), q.float(), 0.5).item() == pytest.approx(0.055582, abs=1e-5)


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_the_jsd_with_all_but_one_token_on_top_is_the_full_jsd_and_its_gradient(beta):
    # with k = V - 1 the rest bucket is the one token left out: the partition is the vocabulary
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(4, 6, generator=g, dtype=torch.float64) * 3
    logits = (torch.randn(4, 6, generator=g, dtype=torch.float64) * 3).requires_grad_()
    top_logp, top_ids = torch.log_softmax(teacher, -1).topk(5, -1)
    ours = generalized_jsd(top_logp, torch.log_softmax(logits, -1).gather(-1, top_ids), beta)
    if beta == 0.0:
        full = (torch.softmax(teacher, -1) * (torch.log_softmax(teacher, -1) - torch.log_softmax(logits, -1))).sum(-1)
    elif beta == 1.0:
        full = (torch.softmax(logits, -1) * (torch.log_softmax(logits, -1) - torch.log_softmax(teacher, -1))).sum(-1)
    else:
        full = _jsd_full(teacher, logits, beta)
    assert ours.tolist() == pytest.approx(full.tolist(), abs=1e-10)
    (grad_ours,) = torch.autograd.grad(ours.sum(), logits)
    (grad_full,) = torch.autograd.grad(full.sum(), logits)
    assert grad_ours.flatten().tolist() == pytest.approx(grad_full.flatten().tolist(), abs=1e-10)
    # fewer tokens on top: a coarser partition, never more than the full divergence
    top2 = torch.log_softmax(teacher, -1).topk(2, -1)
    coarse = generalized_jsd(top2[0], torch.log_softmax(logits, -1).gather(-1, top2[1]), beta)
    assert all(c <= f + 1e-12 for c, f in zip(coarse.tolist(), full.tolist()))


def test_the_jsd_stays_finite_where_the_student_gives_a_top_token_almost_nothing():
    # the student's log-prob -200 on the teacher's first token (exp underflows in float32) and
    # the teacher's top 2 holding all but 1e-9 of its mass (the bucket below float32's resolution)
    p = torch.tensor([[-1e-9 - 0.6931472, -0.6931472]])
    q = torch.tensor([[-200.0, -0.01]], requires_grad=True)
    for beta in (0.0, 0.5, 1.0):
        value = generalized_jsd(p, q, beta)
        (grad,) = torch.autograd.grad(value.sum(), q)
        assert torch.isfinite(value).all() and torch.isfinite(grad).all(), beta


def test_the_rest_bucket_of_a_student_collapsed_on_the_top_tokens_is_its_own_mass_not_rounding():
    # vocabulary of 4 in float32, as the trainer computes it. Teacher P = [0.5, 0.3, 0.1, 0.1], its
    # top 2 = tokens 0, 1 and a rest of 0.2; the student Q = [0.6, 0.4, 1e-9, 1e-9] has collapsed on
    # them: its rest is 2e-9, which 1 - (0.6 + 0.4) cannot tell from 0 in float32.
    # forward KL (beta 0) on the partition {0}, {1}, rest:
    #   0.5 ln(0.5/0.6) + 0.3 ln(0.3/0.4) + 0.2 ln(0.2/2e-9) = -0.091161 - 0.086305 + 3.684136 = 3.506671
    # (the student's rest floored at 1e-7 gave 0.2 ln(0.2/1e-7) = 2.901732 for the last term: 2.724266)
    from rft.trainer.logprobs import _from_logits

    teacher = torch.tensor([[0.5, 0.3, 0.1, 0.1]]).log()
    student = torch.tensor([[0.6, 0.4, 1e-9, 1e-9]]).log().requires_grad_()
    one, target = torch.ones(1), torch.tensor([0])
    _, _, top_logp, top_ids, top_rest = _from_logits(teacher, target, one, None, None, True, top=2)
    _, _, at_logp, at_rest = _from_logits(student, target, one, None, None, True, at=top_ids)
    assert top_ids.tolist() == [[0, 1]] and top_rest.exp().item() == pytest.approx(0.2, rel=1e-6)
    assert at_rest.exp().item() == pytest.approx(2e-9, rel=1e-5)
    value = generalized_jsd(top_logp, at_logp, 0.0, rest=(top_rest, at_rest))
    assert value.item() == pytest.approx(3.506671, abs=1e-5)
    # its gradient on a rest token's logit z_j: q_j - p_rest q_j / q_rest = 1e-9 - 0.2 x 0.5 = -0.1
    # (a push up, back towards the teacher's spread); the floored bucket gave ~ +1e-9, a push down
    (grad,) = torch.autograd.grad(value.sum(), student)
    assert grad[0, 2].item() == pytest.approx(-0.1, abs=1e-5)
    # the same partition with the rest given is the full-vocabulary value where the rest is one token
    p, q = torch.tensor([[0.5, 0.3, 0.2]]).log(), torch.tensor([[0.6, 0.4 - 2e-9, 2e-9]], dtype=torch.float64).log()
    exact = generalized_jsd(p[:, :2].double(), q[:, :2], 0.0, rest=(p[:, 2:].double(), q[:, 2:]))
    assert exact.item() == pytest.approx(3.506671, abs=1e-6)


@pytest.mark.parametrize("beta,expected", [(0.0, 0.0201355), (0.5, 0.0050594), (1.0, 0.0204110)])
def test_a_token_of_probability_zero_on_both_sides_adds_nothing_to_the_jsd(beta, expected):
    # P = [0.6, 0 | rest 0.4], Q = [0.5, 0 | rest 0.5]: the second top token has log-prob -inf on
    # both sides (a masked logit; or fewer tokens than k). It adds 0 log 0 = 0, where e^-inf x (-inf
    # - -inf) was NaN. beta 0.5: M = [0.55, 0, 0.45],
    #   KL(P||M) = 0.6 ln(0.6/0.55) + 0.4 ln(0.4/0.45) = 0.052207 - 0.047113 = 0.005094
    #   KL(Q||M) = 0.5 ln(0.5/0.55) + 0.5 ln(0.5/0.45) = -0.047655 + 0.052680 = 0.005025
    #   JSD = 0.5 x 0.005094 + 0.5 x 0.005025 = 0.005059
    # beta 0: KL(P||Q) = 0.6 ln 1.2 + 0.4 ln 0.8 = 0.109393 - 0.089257 = 0.020136
    # beta 1: KL(Q||P) = 0.5 ln(0.5/0.6) + 0.5 ln(0.5/0.4) = -0.091161 + 0.111572 = 0.020411
    ninf = float("-inf")
    p, p_rest = torch.tensor([[0.6, 0.0]]).log(), torch.tensor([[0.4]]).log()
    q = torch.tensor([[0.5, 0.0]]).log().requires_grad_()
    q_rest = torch.tensor([[0.5]]).log().requires_grad_()
    assert p[0, 1].item() == ninf and q[0, 1].item() == ninf
    value = generalized_jsd(p, q, beta, rest=(p_rest, q_rest))
    assert value.item() == pytest.approx(expected, abs=2e-6)
    grads = torch.autograd.grad(value.sum(), (q, q_rest))
    assert all(torch.isfinite(g).all() for g in grads)
    # without the rest given (the bucket from the top's mass): the same
    assert generalized_jsd(p, q.detach(), beta).item() == pytest.approx(expected, abs=2e-6)
    # a NaN log-prob is not a zero-probability token: it shows in the value
    assert generalized_jsd(torch.tensor([[float("nan"), -1.0]]), q.detach(), beta).isnan().all()


@pytest.mark.slow  # a tiny model built (~2 s)
@pytest.mark.parametrize("how", [{}, {"packed": True}, {"packed": True, "chunk_size": 3}])
def test_token_logprobs_gives_the_top_tokens_and_the_log_probs_at_given_ids(tmp_path, how):
    from transformers import AutoModelForCausalLM

    from rft.trainer.logprobs import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m"), dtype=torch.float32)
    ids = torch.tensor([[5, 9, 14, 20, 7, 3], [8, 11, 4, 6, 0, 0]])
    attn = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    first = torch.tensor([2, 1])  # row 0's positions 2..4 predict a token of its own, row 1's 1..2
    temperature, top_p = torch.tensor([0.7, 1.3]), torch.tensor([0.5, 0.5])
    with torch.no_grad():
        # the reference: the whole logits, each row at its temperature, before the top-p cut
        want = torch.log_softmax(model(ids, attention_mask=attn).logits[:, :-1].float() / temperature[:, None, None], -1)
    top = {"top": 4}
    with torch.no_grad():
        token_logprobs(model, ids, attn, temperature, top_p, first=first, also=top, **how)
    at_ids = torch.randint(0, want.shape[-1], (2, 5, 3), generator=torch.Generator().manual_seed(0))
    at = {"at_ids": at_ids}
    logp, _ = token_logprobs(model, ids, attn, temperature, top_p, first=first, also=at, **how)
    for row, positions in ((0, range(2, 5)), (1, range(1, 3))):
        for t in positions:
            values, indices = want[row, t].topk(4)
            assert top["top_ids"][row, t].tolist() == indices.tolist()
            assert top["top_logp"][row, t].tolist() == pytest.approx(values.tolist(), abs=1e-5)
            assert at["at_logp"][row, t].tolist() == pytest.approx(want[row, t, at_ids[row, t]].tolist(), abs=1e-5)
            # the log of the mass outside them: a logsumexp over the other tokens
            outside = torch.ones_like(want[row, t], dtype=torch.bool)
            outside[indices] = False
            assert top["top_rest"][row, t].item() == pytest.approx(want[row, t][outside].logsumexp(-1).item(), abs=1e-5)
            outside = torch.ones_like(outside)
            outside[at_ids[row, t]] = False
            assert at["at_rest"][row, t].item() == pytest.approx(want[row, t][outside].logsumexp(-1).item(), abs=1e-5)
    # positions not computed hold 0: before `first`, and past row 1's last token
    assert top["top_logp"][0, :2].abs().sum() == 0 and at["at_logp"][1, 3:].abs().sum() == 0
    # the log-probs at given ids carry a gradient to the weights (the student's side of the JSD)
    at["at_logp"].sum().backward()
    assert model.lm_head.weight.grad.abs().sum() > 0


@pytest.mark.slow  # two tiny models built and a trainer (~5 s)
def test_a_jsd_step_trains_on_the_divergence_over_the_teachers_top_tokens(tmp_path):
    from transformers import AutoModelForCausalLM

    from rft.data.experience import Experience

    teacher_dir = build_tiny_model(tmp_path / "teacher", seed=1)
    cfg, trainer = _trainer(teacher_dir, ["algorithm.distill_divergence=jsd", "algorithm.distill_top_k=5",
                                          "algorithm.distill_jsd_beta=0.3", f"model.model_path={tmp_path / 'student'}"])
    tok = load_tokenizer(cfg.model)
    prompt = list(tok.apply_chat_template([{"role": "user", "content": "5+7"}], add_generation_prompt=True,
                                          return_dict=True)["input_ids"])
    answers = [tok.encode(a, add_special_tokens=False) + [tok.eos_token_id] for a in ("12", "13", "2")]
    exps = [Experience(prompt + a, len(prompt), [0.0] * len(a), group_id="a") for a in answers]
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    total, tokens = 0.0, 0
    for e in exps:  # the divergence by hand: both models' whole distributions at the response positions
        with torch.no_grad():
            t = torch.log_softmax(teacher(torch.tensor([e.tokens])).logits[0].float(), -1)
            s = torch.log_softmax(trainer.model(torch.tensor([e.tokens])).logits[0].float(), -1)
        span = slice(e.prompt_length - 1, len(e.tokens) - 1)
        top_logp, top_ids = t[span].topk(5, -1)
        total += generalized_jsd(top_logp, s[span].gather(-1, top_ids), 0.3).sum().item()
        tokens += len(e.tokens) - e.prompt_length
    step = trainer._prepare(exps)
    # the teacher's signal is a loss term now, not an advantage (algorithm=opd's advantage_fn is none)
    assert step.adv.abs().sum() == 0
    before = [p.detach().clone() for p in trainer.model.parameters()]
    metrics = trainer.train_step(exps)
    assert metrics["distill/jsd"] == pytest.approx(total / tokens, rel=1e-4)
    # two differently seeded random models: near-uniform distributions, a small but nonzero divergence
    assert metrics["distill/jsd"] > 1e-4
    assert any((p.detach() != b).any() for p, b in zip(trainer.model.parameters(), before))


@pytest.mark.slow  # two tiny models built and a trainer (~5 s)
def test_a_teacher_with_a_larger_padded_vocabulary_distils_with_the_jsd_over_the_tokenizers_tokens(tmp_path):
    """A teacher whose embedding has more rows than the tokenizer has tokens (Qwen2.5-7B's 152,064
    over 0.5B's 151,936): its top tokens were taken over every row, and a padding id among them
    (103..119 here) indexed past the student's 103 logits: a RuntimeError in the first step. They
    are taken among the tokenizer's tokens; the padding rows' mass goes to the bucket of the rest."""
    from transformers import AutoModelForCausalLM

    from rft.data.experience import Experience

    teacher_dir = build_tiny_model(tmp_path / "teacher", seed=1, arch={"vocab_size": 120})
    cfg, trainer = _trainer(teacher_dir, ["algorithm.distill_divergence=jsd", "algorithm.distill_top_k=5",
                                          f"model.model_path={tmp_path / 'student'}"])
    tok = load_tokenizer(cfg.model)
    assert len(tok) == 103
    prompt = list(tok.apply_chat_template([{"role": "user", "content": "5+7"}], add_generation_prompt=True,
                                          return_dict=True)["input_ids"])
    exps = [Experience(prompt + tok.encode(a, add_special_tokens=False) + [tok.eos_token_id], len(prompt), [0.0] * 3,
                       group_id="a") for a in ("12", "13")]
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    total, tokens, padded = 0.0, 0, 0
    for e in exps:  # by hand: the teacher's log-softmax over its 120 rows, its top 5 among ids 0..102
        with torch.no_grad():
            t = torch.log_softmax(teacher(torch.tensor([e.tokens])).logits[0].float(), -1)
            s = torch.log_softmax(trainer.model(torch.tensor([e.tokens])).logits[0].float(), -1)
        span = slice(e.prompt_length - 1, len(e.tokens) - 1)
        padded += int((t[span].topk(5, -1).indices >= 103).any(-1).sum())
        top_logp, top_ids = t[span, :103].topk(5, -1)
        total += generalized_jsd(top_logp, s[span].gather(-1, top_ids), 0.5).sum().item()
        tokens += len(e.tokens) - e.prompt_length
    assert padded > 0  # a padding row is among the teacher's top 5 over all its rows somewhere
    metrics = trainer.train_step(exps)
    assert metrics["distill/jsd"] == pytest.approx(total / tokens, rel=1e-4)


@pytest.mark.slow  # a tiny model built and a trainer started
def test_a_teacher_with_fewer_embedding_rows_than_the_tokenizer_has_tokens_is_a_config_error(tmp_path):
    """Its tokenizer the student's, its embedding 96 rows: an IndexError in the first step's
    teacher forward (the student samples ids up to 102)."""
    teacher_dir = build_tiny_model(tmp_path / "teacher", seed=1, arch={"vocab_size": 96})
    with pytest.raises(ConfigError) as e:
        _trainer(teacher_dir)
    assert str(e.value) == (
        f"algorithm.teacher_model_path='{teacher_dir}' has 96 rows in its input embedding, fewer than the 103 tokens "
        f"of its tokenizer (the policy's): it cannot read the ids 96 to 102, which the policy may sample. Give a "
        f"teacher whose embedding covers its tokenizer (a model saved after resize_token_embeddings).")
