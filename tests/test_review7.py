"""A long run's sealed state.json over the bound on records still resumes, a damaged or unsealed
one over it is still refused."""
import json

import pytest
from test_checkpoints_manifest import OWNER, said

from rft import manifest
from rft.runtime import checkpoint
from rft.runtime.checkpoint import read_checkpoint, usable_checkpoint

WINDOW = 4096  # data_processor.online_curriculum.window (no upper bound): long outcome strings, few objects


def long_state(d, tasks=17_000):
    """Checkpoint step_2 of stage `d` whose state.json holds an online curriculum's outcomes for
    `tasks` tasks, written as the run writes it and sealed: each entry '"<row>": "<4096 digits>", '
    is ~4,100 bytes, 17,000 of them ~69.8 MB (66.6 MiB), over the 64 MiB bound."""
    outcomes = {str(r): ("01" if r % 2 else "10") * (WINDOW // 2) for r in range(tasks)}
    checkpoint.write(d, 1, {"version": 1}, owner=OWNER)
    return checkpoint.write(d, 2, {"version": 2, "curriculum": {"outcomes": outcomes}}, owner=OWNER)


def test_a_sealed_state_json_over_the_record_bound_resumes(tmp_path):
    d = tmp_path / "grpo"
    step2 = long_state(d)
    size = (step2 / "state.json").stat().st_size
    assert size > manifest.MAX_RECORD  # 67 MiB > 64 MiB
    assert json.loads((step2 / manifest.MANIFEST).read_text())["files"]["state.json"][0] == size
    lines, say = said()
    ckpt = usable_checkpoint(d, OWNER, "grpo", say)
    assert ckpt.step == 2 and ckpt.problem is None and lines == []  # nothing moved aside
    assert len(ckpt.state["curriculum"]["outcomes"]) == 17_000
    assert ckpt.state["curriculum"]["outcomes"]["3"] == "01" * 2048
    assert sorted(p.name for p in (d / "checkpoints").iterdir()) == ["step_1", "step_2"]


def test_a_long_state_json_grown_past_its_listed_size_is_damaged(tmp_path):
    d = tmp_path / "grpo"
    step2 = long_state(d)
    size = (step2 / "state.json").stat().st_size
    with open(step2 / "state.json", "ab") as f:
        f.write(b" ")  # one byte more than the manifest lists: not read, damage
    assert read_checkpoint(step2).problem == (f"{step2 / 'state.json'}: does not read (larger than {size} bytes, "
                                              f"which no record rft writes is)")
    lines, say = said()
    assert usable_checkpoint(d, OWNER, "grpo", say).step == 1  # the one before
    assert len(lines) == 1 and "checkpoint step 2 is damaged" in lines[0]


def test_an_unsealed_state_json_over_the_bound_is_still_refused(tmp_path):
    """No manifest (a legacy checkpoint): nothing vouches for its size, so the bound holds."""
    d = tmp_path / "grpo"
    step2 = long_state(d)
    (step2 / manifest.MANIFEST).unlink()
    state = json.loads((step2 / "state.json").read_text())
    del state["manifest"]  # written before manifests: no mark of one
    (step2 / "state.json").write_text(json.dumps(state))
    assert read_checkpoint(step2).problem == (f"{step2 / 'state.json'}: does not read (larger than "
                                              f"{manifest.MAX_RECORD} bytes, which no record rft writes is)")


def test_a_conversation_budget_over_the_context_is_refused_at_planning():
    """vLLM's engine holds model.max_model_len (else max_prompt_tokens + max_response_tokens) and
    refused a longer conversation mid-run, where the plan had taken it (KV cache sized 56 tokens)."""
    from conftest import compose_cfg

    from rft.errors import ConfigError
    from rft.plan.batch import make_plan, stage_configs

    def plan(*overrides):
        return make_plan(stage_configs(compose_cfg(["model=tiny_tools", "task=calculator", *overrides]))[-1], 2000)

    ts, ev = "buffer.explorer_input.taskset", "buffer.explorer_input.eval_tasksets.0"
    with pytest.raises(ConfigError) as e:
        plan(f"+{ts}.workflow_args.max_total_tokens=100")  # tiny_tools: 24 + 32 = 56
    assert str(e.value) == (
        f"{ts}.workflow_args.max_total_tokens=100 is over the context the run is sized for, model.max_prompt_tokens "
        "+ model.max_response_tokens = 56: explorer=vllm's engine holds only that context and would stop the run at "
        "the first conversation longer than it ('longer than the maximum model length'), and the memory plan does not "
        "size for the longer one. Raise model.max_model_len to 100 (or model.max_response_tokens to 76), or lower "
        "max_total_tokens to 56 or less.")  # 76 = 100 - 24
    with pytest.raises(ConfigError) as e:
        plan(f"+{ev}.workflow_args.max_total_tokens=81", "model.max_model_len=80")
    assert str(e.value).startswith("buffer.explorer_input.eval_tasksets[0].workflow_args.max_total_tokens=81 is over "
                                   "the context the run is sized for, model.max_model_len=80: ")
    assert str(e.value).endswith("Raise model.max_model_len to 81, or lower max_total_tokens to 80 or less.")
    # within the context: planned as before
    plan(f"+{ts}.workflow_args.max_total_tokens=56")
    plan(f"+{ts}.workflow_args.max_total_tokens=80", "model.max_model_len=80")


def test_an_unknown_loss_arg_gets_no_hint_rather_than_a_wrong_one(tmp_path):
    """TRL's delta (its two-sided clip) given to GRPO's loss was told 'Did you mean algorithm.dpo_beta
    (not delta)? ... set algorithm.dpo_beta=<value>': a key GRPO never reads, so the run went on as
    if the clip were set. The message now lists the loss's own arguments and stops there."""
    import rft.runtime.main
    from conftest import compose_cfg

    from rft.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        rft.runtime.main._main(compose_cfg(["stages=[]", "+algorithm.args.delta=1.5", "dry_run=true",
                                            f"checkpoint_root_dir={tmp_path}"]))
    assert str(e.value) == ("algorithm.args has ['delta'], which algorithm.policy_loss_fn=ppo_clip does not take; its "
                            "own arguments are [] (the rest of its settings are the algorithm.* keys it reads from cfg).")


@pytest.mark.parametrize("name", ["delta", "kl_target", "kl_beta", "clip_ratio_dual", "optim", "args"])
def test_a_key_near_in_spelling_only_is_not_named(name):
    # before: delta and kl_beta -> algorithm.dpo_beta, kl_target -> algorithm.args ('set
    # algorithm.args=<value>'), clip_ratio_dual -> algorithm.clip_ratio_low (the dual clip is
    # clip_ratio_c), optim -> algorithm.optimizer, a section, not a setting
    from rft.config import near_args

    assert near_args([name], ["epsilon"], section="algorithm") == ""


@pytest.mark.parametrize("name, key", [
    ("lamda", "lam"), ("lambda", "lam"), ("gae_lambda", "lam"),  # a word cut short, another system's prefix
    ("entropy_coeff", "entropy_coef"), ("kl_loss_coefficient", "kl_loss_coef"), ("clip_ratio_lower", "clip_ratio_low"),
    ("rollout_is_capp", "rollout_is_cap"), ("actor_entropy_coef", "entropy_coef"),
])
def test_a_misspelt_setting_is_still_named(name, key):
    from rft.config import near_args

    assert near_args([name], ["epsilon"], section="algorithm") == (
        f" Did you mean algorithm.{key} (not {name})? That is a key of algorithm itself, which the function reads "
        f"from cfg, not an argument: set algorithm.{key}=<value>, and drop {name} from the args.")
