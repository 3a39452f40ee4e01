"""README.md's promises that tests/test_readme_promises.py and the other test files do not show: every
default the README gives in parentheses beside a key, flag or argument (read from the README's own
words, so a number changed on one side only fails here), and the commands beside its figures and
those of experiments/*/README.md taking the flags they are given with. All fast: composing the
config, reading signatures and argument parsers, no run."""

import argparse
import inspect
import re
import shlex
import sys

import pytest
from conftest import CONF, ROOT, compose_cfg
from omegaconf import OmegaConf

README = (ROOT / "README.md").read_text()


def said(pattern: str) -> float:
    """The one number the README gives where `pattern` (a regex with one group) matches, exactly once."""
    found = re.findall(pattern, README)
    assert len(found) == 1, (pattern, found)
    return float(found[0])


def default(fn, name: str):
    return inspect.signature(fn).parameters[name].default


def parser_defaults(module) -> dict:
    """The defaults of the command-line parser that `module.main` parses with."""
    return {a.dest: a.default for a in module._parser()._actions}


CONFIG_DEFAULTS = [
    # (the README's words around the number, the composed default config's key)
    (r"`algorithm\.distill_top_k` \((\d+)\)", "algorithm.distill_top_k"),
    (r"`algorithm\.distill_jsd_beta` \(([\d.]+);", "algorithm.distill_jsd_beta"),
    (r"`explorer\.max_failed_steps` \((\d+)\) steps in a row", "explorer.max_failed_steps"),
    (r"`size` \((\d+) training rows\)", "buffer.explorer_input.reasoning_gym.size"),
    (r"`eval_size` \((\d+) held-out rows", "buffer.explorer_input.reasoning_gym.eval_size"),
    (r"`seed` \((\d+): the data's, not the run's\)", "buffer.explorer_input.reasoning_gym.seed"),
    (r"`teacher_error_rate` \(([\d.]+): the share", "buffer.explorer_input.reasoning_gym.teacher_error_rate"),
    (r"`explorer\.partial_chunk_tokens` \((\d+)\)", "explorer.partial_chunk_tokens"),
    (r"`explorer\.partial_in_flight` \(([\d.]+)\)", "explorer.partial_in_flight"),
    (r"`algorithm\.rollout_is_cap` \((\d+); `inf` is plain IS\)", "algorithm.rollout_is_cap"),
    (r"`pass_threshold`, default (\d+)\)", "buffer.explorer_input.eval_tasksets.0.pass_threshold"),
]


@pytest.mark.parametrize("pattern, key", CONFIG_DEFAULTS, ids=[k for _, k in CONFIG_DEFAULTS])
def test_each_config_default_the_readme_gives_is_the_configs(pattern, key):
    """"`algorithm.distill_top_k` (20)", "`explorer.max_failed_steps` (3)", ...: the composed default
    config holds the number the README gives."""
    assert OmegaConf.select(compose_cfg(), key) == said(pattern)


def test_the_defaults_the_readme_gives_as_words():
    """Defaults given as words: "`rollout_is` ... `tis` (the default)", "`trainer.use_remove_padding`
    (default true)", "`trainer.share_prompts` (default true)", "`synchronizer.sync_offset` is null",
    "`trainer.max_ckpt_to_keep`, null: all", "`cluster.gpu_memory_gb` (null: this machine's",
    "`objective` (default `eval/accuracy`", "`stage_cache_dir` (default
    `<checkpoint_root_dir>/<project>/stage_cache`", "`model.lora.sync=adapter` ... Default `merged`",
    "`algorithm.dynamic_sampling_max_tries`, 4 in `algorithm=dapo`; 0 and 1 are off" and DAPO's
    "clip-higher (0.2/0.28)"."""
    cfg = compose_cfg()
    assert cfg.algorithm.rollout_is == "tis" and "`tis` (the\ndefault)" in README
    assert (cfg.trainer.use_remove_padding, cfg.trainer.share_prompts) == (True, True)
    assert "`trainer.use_remove_padding` (default true)" in README and "`trainer.share_prompts` (default true)" in README
    assert (cfg.synchronizer.sync_offset, cfg.trainer.max_ckpt_to_keep, cfg.cluster.gpu_memory_gb) == (None, None, None)
    assert cfg.objective == "eval/accuracy" and "`objective` (default\n  `eval/accuracy`" in README
    assert cfg.stage_cache_dir == f"{cfg.checkpoint_root_dir}/{cfg.project}/stage_cache"
    assert cfg.model.lora.sync == "merged"
    assert cfg.algorithm.dynamic_sampling_max_tries in (0, 1)  # off in grpo, the default
    dapo = compose_cfg(["algorithm=dapo"]).algorithm
    tries, low, high = said(r"`algorithm\.dynamic_sampling_max_tries`, (\d) in `algorithm=dapo`"), *map(
        float, re.search(r"clip-higher \(([\d.]+)/([\d.]+)\)", README).groups())
    assert (dapo.dynamic_sampling_max_tries, dapo.clip_ratio_low, dapo.clip_ratio_high) == (tries, low, high) == (4, 0.2, 0.28)


def test_the_reward_server_and_the_studio_flags_default_as_the_readme_says(monkeypatch):
    """The reward server: "`--max-body-mb` (32)", "`--request-timeout` seconds (10; ...)",
    "`--max-connections` (256)", "`--max-responses` (1024)", "127.0.0.1 by default", port 8000 in the
    README's command; the studio: "[--port 8765] [--root ./checkpoints] [--host 127.0.0.1]", "As the
    reward server, a request has `--request-timeout` seconds (10) ... at most `--max-connections`
    (256)", a token "16 characters at least"."""
    from rft.serving import reward_server
    from rft.studio import __main__ as studio

    monkeypatch.delenv("RFT_CHECKPOINT_ROOT_DIR", raising=False)  # --root's default is the variable where set
    server = parser_defaults(reward_server)
    assert server["max_body_mb"] == said(r"`--max-body-mb` \((\d+)\)") == 32
    assert server["request_timeout"] == said(r"within `--request-timeout` seconds \((\d+);") == 10
    assert server["max_responses"] == said(r"`--max-responses` \((\d+)\)") == 1024
    assert server["max_connections"] == 256 and README.count("`--max-connections` (256)") == 2
    assert (server["host"], server["port"]) == ("127.0.0.1", 8000)
    app = parser_defaults(studio)
    assert (app["port"], app["host"], app["root"]) == (8765, "127.0.0.1", "./checkpoints")
    assert "[--port 8765] [--root ./checkpoints] [--host 127.0.0.1]" in README
    assert app["request_timeout"] == said(r"has `--request-timeout` seconds \((\d+)\)") == 10
    assert app["max_connections"] == 256
    assert studio.MIN_TOKEN == said(r"\((\d+) characters at\s+least;")


def test_the_served_rewards_defaults_are_the_readmes():
    """`remote`'s client: "a `timeout` (30 s), `retries` (3) with doubling `backoff` (0.5 s, at most
    `max_backoff` 8 s) ..., at most `max_concurrency` (8) requests at once"; `judge`: "a `timeout` of
    60 s and otherwise the same retries and limits", its key "default OPENAI_API_KEY"."""
    from rft.rewards.judge import JudgeReward
    from rft.rewards.remote import RetryingHTTP

    client = {k: default(RetryingHTTP, k) for k in ("timeout", "retries", "backoff", "max_backoff", "max_concurrency")}
    assert client == {"timeout": said(r"with a `timeout` \((\d+) s\)"), "retries": said(r"`retries` \((\d+)\) with"),
                      "backoff": said(r"doubling `backoff` \(([\d.]+) s"), "max_backoff": said(r"`max_backoff` (\d+) s\)"),
                      "max_concurrency": said(r"`max_concurrency` \((\d+)\) requests")}
    assert client == {"timeout": 30, "retries": 3, "backoff": 0.5, "max_backoff": 8, "max_concurrency": 8}
    judge = {k: default(JudgeReward, k) for k in ("timeout", "retries", "api_key")}
    assert judge == {"timeout": said(r"a `timeout` of (\d+) s and otherwise"), "retries": 3, "api_key": "OPENAI_API_KEY"}


def test_the_verifiers_workflows_and_limits_defaults_are_the_readmes():
    """"A comparison that runs out of time (`args.timeout_seconds`, 10 s a response) scores 0";
    reasoning_gym's scorer "killed and 0 past `args.timeout_seconds`, 10 s"; `workflow_args`'
    "`max_turns` (4; ...)"; "when more than 64 are, in one explorer" (hung reward calls); what rewards
    print "capped at about 1 MB"; a reasoning_gym dataset's "`{name, weight (1.0), config}`"."""
    from rft.config import ReasoningGymDataset
    from rft.rewards import reasoning_gym, stdout_cap, verifiers
    from rft.rollout import explorer
    from rft.rollout.workflows import multi_turn

    assert default(verifiers.math, "timeout_seconds") == said(r"\(`args\.timeout_seconds`, (\d+) s a response\)")
    assert default(reasoning_gym.reasoning_gym, "timeout_seconds") == said(r"past `args\.timeout_seconds`, (\d+) s:")
    # the plan's check of workflow_args fills max_turns with its default, the one the workflow uses
    assert re.search(r'\("max_turns", (\d+), 1\)', inspect.getsource(multi_turn)).group(1) == "4"
    assert said(r"`max_turns` \((\d+); a conversation") == 4
    assert explorer.MAX_HUNG_CALLS == said(r"and when more than (\d+) are, in one explorer")
    assert stdout_cap.CAP_CHARS == 2**20 and "capped at about 1 MB" in README
    assert ReasoningGymDataset.__dataclass_fields__["weight"].default == 1.0 and "weight (1.0)" in README


def test_the_slurm_launchers_defaults_are_the_readmes():
    """"Slurm sends SIGUSR2 `signal_delay_s` (120) before the limit"; "a time limit `max_num_timeout`
    times (3: up to 4 x `timeout_min` in all"; "the default `requeue: true` stays"."""
    slurm = OmegaConf.load(CONF / "hydra" / "launcher" / "slurm.yaml")
    assert slurm.signal_delay_s == said(r"`signal_delay_s` \((\d+)\) before the limit")
    assert slurm.max_num_timeout == said(r"`max_num_timeout` times \((\d+): up to")
    assert slurm.additional_parameters.requeue is True


class _Parser(Exception):
    """Raised in place of parsing, carrying the parser a script built."""


def commands(prefix: str) -> list[tuple[str, str, list[str]]]:
    """Each `python <prefix>...` command of README.md, experiments/*/README.md and launchers/README.md,
    as (the README, the script or module, its arguments): an inline one whole (its line breaks are
    spaces), one in a code block to its line's end or comment (a continuation, `\\`, joined); each
    placeholder (`<a scratch dir>`, `<date_time>`) a plain word and an optional part's brackets
    (`[--seeds 1,3]`) dropped. An inline mention without arguments (`python -m rft.reporting.report`
    on the sweep) names the tool, and is left out."""
    found = []
    for readme in [ROOT / "README.md", *sorted(ROOT.glob("experiments/*/README.md")), ROOT / "launchers" / "README.md"]:
        text = re.sub(r"\\\n\s*", " ", readme.read_text())
        python = r"(?:[\w./]*/)?python "  # `.venv/bin/python ` too
        inline = re.findall(rf"`{python}({re.escape(prefix)}[^`]*)`", text)
        text = re.sub(rf"`{python}{re.escape(prefix)}[^`]*`", "", text)
        blocks = re.findall(rf"^\s*{python}({re.escape(prefix)}[^#\n]*)", text, re.M)
        for line in [*inline, *blocks]:
            words = shlex.split(re.sub(r"<[^<>]*>", "x", line).replace("[", "").replace("]", ""))
            if words[0] == "-m":  # `-m rft.x`: the module is the script
                words = [f"-m {words[1]}", *words[2:]]
            if len(words) > 1 or line not in inline:
                found.append((readme.relative_to(ROOT).as_posix(), words[0], words[1:]))
    return found


def script_parser(monkeypatch, where: str, argv: list[str]):
    """The argparse parser a script (`experiments/<study>/<file>.py`) or module (`-m rft.x`) builds,
    taken where it would parse `argv` (run as `__main__`, it stops there); None for one that reads
    sys.argv itself, or these arguments before its parser (`harness.py --summary <dir>`)."""
    import importlib
    import runpy

    source = (ROOT / (where[3:].replace(".", "/") + ".py" if where.startswith("-m ") else where)).read_text()
    if "add_argument" not in source:
        return None

    def capture(self, args=None, namespace=None):
        raise _Parser(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    monkeypatch.setattr(sys, "argv", [where, *argv])
    try:
        if where.startswith("-m "):  # each module's `main(argv=None)`, as `python -m` calls it
            importlib.import_module(where[3:]).main()
        else:
            runpy.run_path(str(ROOT / where), run_name="__main__")
    except _Parser as got:
        return got.args[0]
    except BaseException:
        if "sys.argv[" in source:  # it took these arguments before any parser did
            return None
        raise
    finally:
        monkeypatch.undo()
    return None


FIGURE_COMMANDS = commands("experiments/") + commands("-m rft.")


@pytest.mark.parametrize("readme, where, argv", FIGURE_COMMANDS,
                         ids=[f"{r}:{w} {' '.join(a)}"[:90] for r, w, a in FIGURE_COMMANDS])
def test_each_command_beside_a_figure_takes_the_arguments_it_is_given(readme, where, argv, monkeypatch, capsys):
    """"Every figure the command that reproduces it": each `python experiments/<study>/<script>.py ...`
    and `python -m rft....` command that README.md and the studies' READMEs give (`--shapes 0.5b
    --arms sampled --lengths 128 1024`, `--dir <a scratch dir> --repeats 5`) is parsed by its script's
    own parser as written: a flag renamed or a choice dropped since fails here, not for the reader."""
    parser = script_parser(monkeypatch, where, argv)
    if parser is None:
        pytest.skip(f"{where} reads these arguments without argparse")
    try:
        parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"{readme}: python {where} {' '.join(argv)}\n{capsys.readouterr().err}")
    assert parser.prog


def test_a_vllm_older_than_the_extras_floor_is_refused_when_the_engine_starts():
    """"That `reload_weights(weights_iterator=...)` needs vLLM 0.18 or later (the `vllm` extra's floor);
    an older vLLM is refused when the engine starts, rather than failing at the first sync": the floor
    is pyproject's, an older release is one paragraph naming both versions and the fix, and 0.18 itself,
    a later one and a development build (a checkout without tags calls itself 0.1.dev) pass."""
    import tomllib

    from rft.errors import ConfigError
    from rft.rollout.engines.vllm import MIN_VLLM, check_version

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["vllm"] == ["vllm>=0.18"] and MIN_VLLM == (0, 18)
    assert re.search(r"needs vLLM (\d+\.\d+) or later \(the `vllm` extra's floor\)", README).group(1) == "0.18"
    with pytest.raises(ConfigError) as e:
        check_version("0.11.2")
    assert str(e.value) == (
        "explorer=vllm needs vLLM >= 0.18, but 0.11.2 is installed: the weight syncs load the trainer's weights in "
        "place through vLLM's reload_weights(weights_iterator=...), which older vLLM lacks. pip install -U -e "
        "'.[vllm]' (or use explorer=hf).")
    for version in ("0.17.9", "0.9.1"):  # compared as numbers, not text: "0.9" > "0.18" as strings
        with pytest.raises(ConfigError):
            check_version(version)
    for version in ("0.18.0", "0.32.0+cpu", "1.0.0", "0.1.dev5+g1234"):
        assert check_version(version) is None


@pytest.mark.slow
def test_a_run_under_a_path_with_a_space_and_a_non_ascii_letter_trains_and_resumes(tmp_path):
    """"Paths with spaces or non-ASCII letters work (quote them for Hydra:
    `'checkpoint_root_dir="/Users/me/my runs"'`)": the default's two stages, on a budget, written under
    `my runs/ünï`: both stages train (the RL stage from the warm-up's checkpoint under that path), save
    sealed checkpoints, and the same command again finds both finished."""
    root = tmp_path / "my runs" / "ünï"
    quoted = f'checkpoint_root_dir="{root}"'
    assert 'checkpoint_root_dir="/Users/me/my runs"' in README
    budget = ["cluster=inline", "monitor=console", "stages.0.buffer.total_steps=4",
              "stages.0.algorithm.optimizer.warmup_steps=0", "buffer.total_steps=2", "buffer.batch_size=4",
              "algorithm.repeat_times=2", "explorer.eval_interval=2", "explorer.eval_on_startup=false", "name=spaced"]
    import os

    from resume_support import forked_to_end

    # each command a run.py process forked from one that imported torch (resume_support: the same argv,
    # quoted path included, without a fresh interpreter's imports, ~4 s a run)
    r = forked_to_end([*budget, quoted], dict(os.environ), tmp_path / "first_run")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    run = root / "rft" / "spaced"
    for stage, steps in (("sft_warmup", 4), ("grpo", 2)):
        rows = (run / stage / "metrics.jsonl").read_text().splitlines()
        assert len(rows) == steps, (stage, rows)
        assert (run / stage / "checkpoints" / f"step_{steps}" / "manifest.json").is_file()
    assert f"starts from sft_warmup's final model: {run}/sft_warmup/checkpoints/step_4/hf" in " ".join(
        r.stdout.split())
    again = forked_to_end([*budget, quoted], dict(os.environ), tmp_path / "again_run")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already finished" in again.stdout + again.stderr
