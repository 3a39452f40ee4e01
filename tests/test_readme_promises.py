"""README.md's promises that no other test file shows: the groups a newcomer changes first and what
they default to, what differs from Trinity-RFT, the Trinity keys rft lacks, the Layout and the
extension tables, the documented defaults of the multi-turn sandbox, and an empty stop set. Each
test quotes the README line it holds to; all but the last are fast (composing the config, reading
files, no run)."""

import importlib
import inspect
import re
import sys

import pytest
from conftest import CONF, ROOT, compose_cfg
from omegaconf import OmegaConf

README = (ROOT / "README.md").read_text()


def section(title: str) -> str:
    """The README's text from the heading `title` to the next heading of the same or a higher level."""
    start = README.index(title)
    level = title.split()[0]
    rest = README[start + len(title):]
    ends = [m.start() for m in re.finditer(rf"^#{{1,{len(level)}}} ", rest, re.M)]
    return rest[:ends[0]] if ends else rest


def options(group: str) -> set[str]:
    return {p.stem for p in (CONF / group).glob("*.yaml")}


def test_the_groups_table_names_every_option_of_its_groups():
    """"The five config groups a newcomer changes first": the `model`, `task`, `cluster` and `sync` rows
    name every file under conf/<group>/ and no other (the `task` row lacked calculator and
    reasoning_gym, `model` tiny_tools, `sync` collective); `algorithm` names a few (its table is
    below); the sentence after the table names `trainer` and `monitor`'s options."""
    table = section("## Running your own job")
    for group in ("model", "task", "cluster", "sync", "algorithm"):
        row = re.search(rf"^\| `{group}` \| (.*?) \|", table, re.M).group(1)
        named = set(re.findall(r"`([\w.-]+)`", re.sub(r"\([^)]*\)", "", row)))
        if group == "algorithm":
            assert named < options(group), named
        else:
            assert named == options(group), (f"README's `{group}` row and conf/{group}/ differ by "
                                              f"{sorted(named ^ options(group))}: a new option is named in the row")
    # "`trainer` (`torch`: one process; `fsdp2`: ...), `monitor` (`console`, `tensorboard`, `wandb`, `mlflow`..."
    assert {"torch", "fsdp2"} == options("trainer")
    assert {"console", "tensorboard", "wandb", "mlflow"} == options("monitor")


def test_the_defaults_list_comments_name_every_option_of_their_groups():
    """conf/config.yaml's defaults list says each group's options beside its choice (`- monitor:
    tensorboard   # console | tensorboard | wandb | mlflow`): every file under conf/<group>/ is named
    there (monitor lacked mlflow, algorithm rm and reinforce_pp_baseline, model tiny_tools and the
    1.5b shape, task long_tail and calculator)."""
    text = (CONF / "config.yaml").read_text()
    checked = 0
    for group, comment in re.findall(r"^  - (\w+): \S+ +# (.*)$", text, re.M):
        if (CONF / group).is_dir() and group != "experiment":  # studies: experiments/ lists them
            named = set(re.findall(r"[\w.-]+", comment))
            assert options(group) <= named, (f"conf/config.yaml's comment beside `- {group}:` lacks "
                                             f"{sorted(options(group) - named)}: name every option of conf/{group}/ there")
            checked += 1
    assert checked == 9  # buffer, algorithm, task, explorer, trainer, sync, monitor, cluster, model


def test_the_algorithm_table_lists_every_algorithm_file_and_only_those():
    """"### Algorithms": one row per `conf/algorithm/<name>.yaml`, so a new algorithm is documented
    where a user picks it, and no row names one that `algorithm=<name>` cannot load."""
    rows = re.findall(r"^\| `([a-z_]+)` \|", section("### Algorithms"), re.M)
    assert sorted(rows) == sorted(options("algorithm"))
    assert len(rows) == len(set(rows)) == 16


def test_python_run_py_with_no_arguments(monkeypatch):
    """"`python run.py` with no arguments runs two stages on a ~0.5M-parameter Qwen2-architecture model
    that the project builds itself (`model=tiny`, cached in `~/.cache/rft`)", with "the defaults
    (`explorer=hf`, `trainer=torch`, `sync=memory`, no GPU)", and its outputs in "default
    ./checkpoints/rft/grpo-tiny-arithmetic/" ("## Outputs")."""
    monkeypatch.delenv("RFT_CACHE_DIR")  # the session's cache (conftest): the user's own default here
    monkeypatch.delenv("RFT_CHECKPOINT_ROOT_DIR", raising=False)
    cfg = compose_cfg(keep_hydra=True)
    choices = cfg.hydra.runtime.choices
    assert {g: choices[g] for g in ("algorithm", "model", "task", "cluster", "sync", "buffer", "explorer", "trainer",
                                    "monitor")} == {
        "algorithm": "grpo", "model": "tiny", "task": "arithmetic", "cluster": "local", "sync": "memory",
        "buffer": "queue", "explorer": "hf", "trainer": "torch", "monitor": "tensorboard"}
    assert (cfg.cache_dir, cfg.model.model_path) == ("~/.cache/rft", "~/.cache/rft/models/tiny-qwen2-v2")
    assert cfg.hydra.run.dir == "./checkpoints/rft/grpo-tiny-arithmetic"
    # "A sweep (`-m`) puts each job in `<checkpoint_root_dir>/<project>/multirun/<date_time>/<job number>/`"
    assert re.fullmatch(r"\./checkpoints/rft/multirun/\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d", cfg.hydra.sweep.dir)
    assert OmegaConf.to_container(cfg.hydra.sweep)["subdir"] == "${hydra.job.num}"
    assert [s.stage_name for s in cfg.stages] == ["sft_warmup", "grpo"]
    assert (cfg.seed, cfg.cluster.gpu_per_node) == (42, 0)  # "(seed 42)"; CPU
    # "Set `RFT_CHECKPOINT_ROOT_DIR` and `RFT_CACHE_DIR` to move outputs and the cache."
    monkeypatch.setenv("RFT_CHECKPOINT_ROOT_DIR", "/data/runs")
    monkeypatch.setenv("RFT_CACHE_DIR", "/data/cache")
    cfg = compose_cfg(keep_hydra=True)
    assert cfg.hydra.run.dir == "/data/runs/rft/grpo-tiny-arithmetic"
    assert cfg.model.model_path == "/data/cache/models/tiny-qwen2-v2"


def test_what_a_gpu_model_brings_beyond_what_test_memory_plan_checks():
    """The model table: `qwen7b` "4 engines of 1 GPU, prefix caching, CUDA graphs | fsdp2 on the 4 GPUs
    left | 1 node x 8 GPUs | prompt 1,024 + response 3,072"; `qwen2.5-0.5b` "vllm, 1 engine | torch
    (one GPU) | collective | 1 node x 2 GPUs | prompt 512 + response 1,024" (the rest of each row:
    tests/test_memory_plan.py)."""
    from rft.plan.placement import trainer_ranks

    cfg = compose_cfg(["model=qwen7b"])
    rm = cfg.explorer.rollout_model
    assert (rm.engine_num, rm.tensor_parallel_size, rm.enable_prefix_caching, rm.enforce_eager) == (4, 1, True, False)
    assert (cfg.cluster.node_num, cfg.cluster.gpu_per_node, trainer_ranks(cfg)) == (1, 8, 4)  # 8 - 4 x 1
    assert (cfg.model.max_prompt_tokens, cfg.model.max_response_tokens) == (1024, 3072)
    cfg = compose_cfg(["model=qwen2.5-0.5b"])
    rm = cfg.explorer.rollout_model
    assert (rm.engine_type, rm.engine_num, rm.tensor_parallel_size) == ("vllm", 1, 1)
    assert (cfg.trainer.trainer_strategy, cfg.synchronizer.sync_method) == ("torch", "collective")
    assert (cfg.cluster.node_num, cfg.cluster.gpu_per_node) == (1, 2)
    assert (cfg.model.max_prompt_tokens, cfg.model.max_response_tokens) == (512, 1024)
    # "The tiny models and `qwen2.5-0.5b-shape` run on CPU with the defaults"
    for model in ("tiny", "tiny_tools", "qwen2.5-0.5b-shape", "qwen2.5-1.5b-shape"):
        cfg = compose_cfg([f"model={model}"])
        assert (cfg.explorer.rollout_model.engine_type, cfg.trainer.trainer_strategy, cfg.synchronizer.sync_method,
                cfg.cluster.gpu_per_node) == ("hf", "torch", "memory", 0), model


def test_what_differs_from_trinity_rft():
    """"Same name, different meaning or default, to know when coming from Trinity-RFT": each value as
    the README gives it."""
    cfg = compose_cfg()
    # "`synchronizer.sync_offset` is null ..., the guide's 0 (on-policy) is `synchronizer.sync_offset=0`"
    assert cfg.synchronizer.sync_offset is None
    assert compose_cfg(["synchronizer.sync_offset=0"]).synchronizer.sync_offset == 0
    # "`monitor.monitor_type` is a list (`monitor=wandb`: TensorBoard and wandb, or
    # `'monitor.monitor_type=[wandb]'`: wandb alone)"
    assert list(compose_cfg(["monitor=wandb"]).monitor.monitor_type) == ["tensorboard", "wandb"]
    assert list(compose_cfg(["monitor.monitor_type=[wandb]"]).monitor.monitor_type) == ["wandb"]
    # "`explorer.rollout_model.engine_type` is `hf` (the CPU default)"; "`enable_history` is true
    # (Trinity: false)"; "`trainer.save_hf_checkpoint` is `always` (Trinity: `last`...)";
    # "`trainer.use_dynamic_bsz` is false; `cluster.gpu_per_node` is 0 (CPU)"
    assert cfg.explorer.rollout_model.engine_type == "hf" and cfg.explorer.rollout_model.enable_history is True
    assert (cfg.trainer.save_hf_checkpoint, cfg.trainer.use_dynamic_bsz, cfg.cluster.gpu_per_node) == ("always", False, 0)
    # "`algorithm.algorithm_type` is only a label": the default's stage is named by it
    assert cfg.algorithm.algorithm_type == "grpo" and cfg.name == "grpo-tiny-arithmetic"


@pytest.mark.parametrize("override, where", [
    ("ray_namespace=rft", "Config"),
    ("trainer.save_strategy=whole", "TrainerConfig"),
    ("log.group_by_node=true", "LogConfig"),
    # the rest are rft/foreign_keys.py's: one paragraph naming rft's key, or that there is none
    ("algorithm.sample_strategy=warmup", None),
    ("buffer.explorer_input.taskset.storage_type=file", None),
    ("algorithm.entropy_loss_fn=default", None),
    ("model.chat_template_path=t.jinja", None),
    ("model.min_response_tokens=1", None),
    ("model.enable_prompt_truncation=true", None),
    ("explorer.env_vars={}", None),
    ("explorer.dynamic_timeout={}", None),
    ("trainer.ulysses_sequence_parallel_size=2", None),
    ("service={}", None),
    ("trainer.trainer_config={}", None),
])
def test_trinity_keys_rft_lacks_stop_the_run_as_a_misspelt_key_does(override, where):
    """"Not every key of the guide exists here (`ray_namespace`, ... the verl `trainer_config`): such a
    key stops the run as a misspelt one does, or with rft's key for it": the paragraph, before Hydra composes."""
    from rft.plan.overlays import misspelt_override

    key = override.split("=")[0]
    message = misspelt_override([override], {p.name for p in CONF.iterdir() if p.is_dir()})
    if where is None:
        assert message.startswith(f"Could not override '{key}': that is Trinity-RFT's key, not rft's")
        return
    assert message.startswith(f"Could not override '{key}': Key '{key.split('.')[-1]}' not in '{where}'.")
    assert message.endswith("The keys, each with a comment, are in rft/config.py; `python run.py --cfg job` prints "
                            "the composed config.")


@pytest.mark.parametrize("key, value, choices", [
    # "`synchronizer.sync_method` takes `memory`, `checkpoint` or `collective` (Trinity's `nccl`)"
    ("synchronizer.sync_method", "nccl", "[memory, checkpoint, collective]"),
])
def test_trinity_values_rft_names_otherwise_are_refused(key, value, choices):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as e:
        compose_cfg([f"{key}={value}"])
    assert f"Invalid value '{value}', expected one of {choices}" in str(e.value.__cause__ or e.value)


@pytest.mark.parametrize("override, message", [
    # "`trainer.trainer_strategy` is `torch` or `fsdp2` (no `fsdp`, `megatron`)"
    ("trainer.trainer_strategy=megatron", "trainer.trainer_strategy='megatron' is not one of ['fsdp2', 'torch']"),
    ("trainer.trainer_strategy=fsdp", "trainer.trainer_strategy='fsdp' is not one of ['fsdp2', 'torch']"),
    # "`explorer.rollout_model.engine_type` is `hf` ... or `vllm` (no `vllm_async`)"
    ("explorer.rollout_model.engine_type=vllm_async",
     "explorer.rollout_model.engine_type='vllm_async' is not one of ['hf', 'vllm']"),
    # "`trainer.save_hf_checkpoint` is `always` (Trinity: `last`, which only a LoRA run may take)"
    ("trainer.save_hf_checkpoint=last", "trainer.save_hf_checkpoint=last: only a LoRA run (model.lora.rank > 0) can "
                                        "leave out hf/"),
])
def test_trinity_choices_rft_lacks_fail_the_plan(override, message):
    from rft.errors import ConfigError
    from rft.plan.batch import make_plan, stage_configs

    [stage] = stage_configs(compose_cfg(["stages=[]", override]))
    with pytest.raises(ConfigError) as e:
        make_plan(stage, 2000)  # what the dry run and the run plan, before any dataset is read
    assert str(e.value).startswith(message)


def test_the_registered_rewards_are_those_the_readme_names():
    """"Name it by its key in `rft.rewards.verifiers.REWARD_FNS` (`exact_match`, `last_number`, `math`,
    `countdown`, `format`, `reasoning_gym`)"; the served ones (`reward_model`, `remote`, `judge`) are
    REWARD_CLIENTS ("Everything else ... served reward clients `REWARD_CLIENTS`")."""
    from rft.rewards.scoring import REWARD_CLIENTS
    from rft.rewards.verifiers import REWARD_FNS

    named = re.search(r"by its key in\s+`([\w./]+)`\s+\(([^)]*)\)", README)
    assert named.group(1) == "rft.rewards.verifiers.REWARD_FNS"
    assert sorted(re.findall(r"`(\w+)`", named.group(2))) == sorted(REWARD_FNS)
    assert {"reward_model", "remote", "judge"} <= set(REWARD_CLIENTS)


LAYOUT_FILE = re.compile(r"\b([\w/]+\.(?:py|sh|sbatch))\b")


def test_every_file_the_layout_names_exists_and_every_module_is_named():
    """"## Layout": `rft/` is its parts, one folder each; each file named there exists, and each
    module of rft/ is named (by its file name, or by its name in the folder's list: `rft/algorithms/`'s
    "advantages, losses, KL, ...")."""
    layout = section("## Layout")
    folder, missing = None, []
    for line in layout.splitlines():
        start = re.match(r"    ([\w/]+/)\s", line)
        if start:
            folder = start.group(1)
        for name in LAYOUT_FILE.findall(line):
            under = ROOT / (folder or "") if not name.startswith(("rft/", "conf/", "launchers/", "tests/")) else ROOT
            if not ((ROOT / name).exists() or (under / name).exists() or any(under.rglob(name))):
                missing.append((folder, name))
    assert missing == []
    modules = [p for p in (ROOT / "rft").rglob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    unnamed = [str(p.relative_to(ROOT)) for p in modules
               if p.name not in layout and not re.search(rf"\b{p.stem}\b", layout, re.I)]
    assert unnamed == []


@pytest.mark.parametrize("table, module", [
    ("ADVANTAGE_FNS", "rft.algorithms"), ("POLICY_LOSS_FNS", "rft.algorithms"),
    ("REWARD_FNS", "rft.rewards.verifiers"), ("WORKFLOWS", "rft.rollout.workflows.single_turn"),
    ("ENVIRONMENTS", "rft.rollout.environments.tools"), ("ENGINES", "rft.registry"),
    ("TRAINER_BACKENDS", "rft.registry"), ("MONITORS", "rft.reporting.monitor"), ("SYNC_METHODS", "rft.sync.weights"),
    ("TASK_OPERATORS", "rft.data.pipeline"), ("EXPERIENCE_OPERATORS", "rft.data.pipeline"),
    ("BUFFERS", "rft.data.buffer"), ("GENERATORS", "rft.data.tasks"), ("BUILDERS", "rft.models"),
    ("PRIORITY_FNS", "rft.data.experience"), ("REWARD_CLIENTS", "rft.rewards.scoring"),
    ("ACTOR_BACKENDS", "rft.runtime.actors"),
])
def test_each_extension_table_is_a_registry_where_the_readme_says(table, module):
    """"## Extension points": "Each seam is a name table (a `Registry` in `rft/registry.py`'s sense)",
    in the file the table names (a module of rft.algorithms: `rft/algorithms/__init__.py`)."""
    from rft.registry import Registry

    assert re.search(rf"\b{table}\b", section("## Extension points"))
    assert isinstance(getattr(importlib.import_module(module), table), Registry)


def test_the_protocols_the_extension_table_counts():
    """"rollout engine | the `Engine` Protocol, `rft/rollout/engines/base.py` (8 methods)"; a tracker
    "a class `(cfg, run_dir, stage, start_step)` with `log(step, metrics)`, `close()`"."""
    from rft.reporting.monitor import TensorBoard
    from rft.rollout.engines.base import Engine

    methods = [n for n, v in vars(Engine).items() if callable(v) and not n.startswith("_")]
    assert sorted(methods) == sorted(["generate", "update_weights", "load_weights_file", "collective_init",
                                      "collective_receive", "fingerprint", "sleep", "wake_up"])
    assert list(inspect.signature(TensorBoard).parameters)[:4] == ["cfg", "run_dir", "stage", "start_step"]
    assert callable(TensorBoard.log) and callable(TensorBoard.close)


def test_the_sandbox_and_the_agent_endpoint_limits_the_readme_gives():
    """"Multi-turn agents and tools": the python environment's "`timeout_s` (5 s)", "`memory_mb` (512)",
    "more than 32 processes and threads", "more than 1 MiB of output (killed; the tool answers the
    first 4000 bytes)"; the endpoint's "`n` up to 128", "at most 1024 rollouts are recorded at once",
    "or 0.5 s pass with none new"; "`hermes` (the default)"."""
    from rft.rollout.environments.sandbox import run_python
    from rft.rollout.environments.tools import PythonEnv
    from rft.serving.batching import IDLE_S
    from rft.serving.openai_api import MAX_N, MAX_OPEN_ROLLOUTS

    p = inspect.signature(run_python).parameters
    assert (p["timeout_s"].default, p["memory_mb"].default, p["max_processes"].default,
            p["output_limit_bytes"].default, p["max_output_bytes"].default) == (5.0, 512, 32, 2**20, 4000)
    env = inspect.signature(PythonEnv).parameters  # what env_args: {} gives
    assert (env["timeout_s"].default, env["memory_mb"].default, env["allow_unisolated"].default) == (5.0, 512, False)
    assert (MAX_N, MAX_OPEN_ROLLOUTS, IDLE_S) == (128, 1024, 0.5)
    assert compose_cfg().model.tool_call_parser == "hermes"


def test_the_makefile_targets_the_readme_names():
    """"make run  # train the embedded default on CPU"; "`make test-fast` runs the tests of under a
    second each" (those not marked slow); both "create or refresh `.venv` first"."""
    make = (ROOT / "Makefile").read_text()
    rules = dict(re.findall(r"^([\w-]+): (.*)$", make, re.M))
    recipe = {t: re.search(rf"^{t}:.*\n((?:\t.*\n)+)", make, re.M).group(1) for t in ("run", "test", "test-fast")}
    assert recipe["run"].strip() == "$(PY) run.py"  # no arguments: the embedded default
    assert '-m "not slow"' in recipe["test-fast"] and "not slow" not in recipe["test"]
    assert all("$(STAMP)" in rules[t] or "$(VLLM_STAMP)" in rules[t] for t in ("run", "test", "test-fast"))
    # the help lines name each target the README gives
    helped = re.findall(r"^# make ([\w-]+)", make, re.M)
    assert {"run", "test", "test-fast", "studio"} <= set(helped)


@pytest.mark.slow  # an engine (make test-fast runs none): ~5 s with the tiny model's first build
def test_an_empty_stop_token_ids_lets_every_response_run_to_max_tokens(cache_dir):
    """"`model.stop_token_ids=[...]` replaces that set (`[]`: none, every response runs to
    `max_tokens`...)": with the tokenizer's eos made the likeliest token, the default set ends each
    response at its first token, `[]` at none (greedy and sampled alike)."""
    from types import SimpleNamespace

    from rft.data.readers import encode_prompt
    from rft.models import build_tiny_model, load_tokenizer
    from rft.rollout.engines.hf import HFEngine

    path = build_tiny_model(cache_dir / "models" / "tiny-qwen2-v2")
    ends = {}
    for stops in (None, []):
        cfg = OmegaConf.create(dict(model_path=str(path), dtype="float32", trust_remote_code=False,
                                    custom_chat_template=None, max_response_tokens=6, stop_token_ids=stops))
        tok = load_tokenizer(cfg)
        engine = HFEngine(cfg, SimpleNamespace(generate_batch_size=8), tok)

        def eos_first(module, inputs, logits, eos=tok.eos_token_id):
            logits = logits.clone()
            logits[..., eos] += 50.0  # the untrained model would never sample it
            return logits

        engine.model.lm_head.register_forward_hook(eos_first)
        prompts = [encode_prompt(tok, [{"role": "user", "content": q}], 24) for q in ("1+2", "33+44")]
        for temperature in (1.0, 0.0):
            out = engine.generate(prompts, n=2, seed=0, args=SimpleNamespace(
                temperature=temperature, top_p=1.0, top_k=-1, max_tokens=None, stop=[]))
            ends[str(stops), temperature] = {(len(s.token_ids), s.finish_reason) for g in out for s in g}
    assert ends == {("None", 1.0): {(1, "stop")}, ("None", 0.0): {(1, "stop")},
                    ("[]", 1.0): {(6, "length")}, ("[]", 0.0): {(6, "length")}}  # 6: model.max_response_tokens


# names of the standard library rft might use, with the Python that added them
NEWER_STDLIB = {
    (3, 11): [r"\bStrEnum\b", r"\bimport tomllib\b", r"from typing import[^\n]*\bSelf\b", r"\bdatetime\.UTC\b",
              r"\bTaskGroup\b", r"\bfile_digest\b", r"\bcontextlib\.chdir\b", r"\bExceptionGroup\b"],
    (3, 12): [r"\bitertools\.batched\b", r"from itertools import[^\n]*\bbatched\b", r"from typing import[^\n]*\boverride\b"],
}


def test_the_python_the_readme_and_pyproject_name_runs_rft():
    """"Python >= 3.x" (README, under the two make commands) is pyproject's `requires-python`, and no
    module of rft or run.py uses the standard library of a later Python (rft/config.py's closed sets
    of names are `enum.StrEnum`s, new in 3.11: on 3.10 `import rft.config` failed with an ImportError
    where both promised 3.10)."""
    import tomllib

    floor = re.search(r"\(Python >= 3\.(\d+);", README)
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert floor and declared == f">=3.{floor.group(1)}"
    sources = {p: p.read_text() for p in [ROOT / "run.py", *(ROOT / "rft").rglob("*.py")]}
    needed = max([version for version, names in NEWER_STDLIB.items()
                  if any(re.search(n, text) for n in names for text in sources.values())], default=(3, 10))
    assert (3, int(floor.group(1))) >= needed


def test_a_key_a_stage_entry_lacks_is_added_with_a_plus():
    """"### Stages": "A key the stage's entry does not hold yet is added with a `+`
    (`+stages.1.buffer.explorer_input.taskset.workflow_args.agent=my_study.agent.solve`; without it
    Hydra stops with "Key 'buffer' is not in struct")", and only that stage gets it."""
    from hydra.errors import ConfigCompositionException

    from rft.plan.batch import stage_configs

    key = "stages.1.buffer.explorer_input.taskset.workflow_args.agent=my_study.agent.solve"
    warm, rl = stage_configs(compose_cfg([f"+{key}"]))
    assert dict(rl.buffer.explorer_input.taskset.workflow_args) == {"agent": "my_study.agent.solve"}
    assert dict(warm.buffer.explorer_input.taskset.workflow_args) == {}
    with pytest.raises(ConfigCompositionException) as e:
        compose_cfg([key])
    assert str(e.value).endswith(f"To append to your config use +{key}")
    assert str(e.value.__cause__).startswith("Key 'buffer' is not in struct")


def run_py_commands(text: str) -> list[str]:
    """The overrides of each `python run.py ...` command in a markdown text (a line ending in `\\`
    continues it; a comment ends it)."""
    lines, found, i = text.splitlines(), [], 0
    while i < len(lines):
        m = re.search(r"(?:^|\s|`)python run\.py((?: [^`#]*)?)", lines[i])
        if m:
            command = m.group(1)
            while command.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                command = command.rstrip()[:-1] + " " + lines[i].split("#")[0]
            found.append(command.split("#")[0].strip())
        i += 1
    return found


def compose_error(command: str) -> str | None:
    """What composing `python run.py <command>` says is wrong (None: it composes); a sweep's first
    value of each list stands for the sweep. None too for a command with placeholders (`<dir>`,
    `$SFT`) or flags, and for one choosing a launcher (Hydra's plugins compose it)."""
    import shlex

    from rft.plan.overlays import misspelt_override

    if any(c in command for c in "$<>") or "..." in command:
        return None
    words = [w for w in shlex.split(command) if w not in ("-m", "--multirun")]
    if any(w.startswith(("-", "hydra/launcher")) for w in words):
        return None
    overrides = []
    for w in words:
        key, eq, value = w.partition("=")
        if "," in value and not value.startswith(("[", "{", "'", '"')):
            value = value.split(",")[0]
        overrides.append(f"{key}={value}" if eq else w)
    error = misspelt_override(overrides, {p.name for p in CONF.iterdir() if p.is_dir()})
    if error:
        return error
    try:
        compose_cfg(overrides)
    except Exception as e:  # noqa: BLE001 (Hydra's and OmegaConf's many kinds: each is the answer)
        return f"{type(e).__name__}: {e}"
    return None


@pytest.mark.slow  # ~8 s: some 55 commands composed
def test_every_run_py_command_of_the_readmes_composes():
    """Each `python run.py ...` command the README, experiments/*/README.md and launchers/README.md
    give composes as written (a renamed key or option fails here, not for the reader)."""
    readmes = [ROOT / "README.md", *sorted(ROOT.glob("experiments/*/README.md")), ROOT / "launchers" / "README.md"]
    commands = [(r.relative_to(ROOT), c) for r in readmes for c in run_py_commands(r.read_text())]
    assert len(commands) >= 60
    wrong = [(str(r), c, error) for r, c in commands if (error := compose_error(c))]
    assert wrong == []
    # what a renamed key would give
    assert compose_error("buffer.batchsize=8").startswith("Could not override 'buffer.batchsize': Key 'batchsize' "
                                                          "not in 'BufferConfig'.")
    assert compose_error("model=qwen8b").startswith("MissingConfigException: In 'config': Could not find 'model/qwen8b'")


# what the README names in backticks that is no key of rft's, on purpose: other systems' keys it
# says rft lacks or translates, and file names
NOT_RFT_KEYS = {"algorithm.adv_estimator", "algorithm.kl_ctrl.type", "algorithm.sample_strategy", "explorer.env_vars",
                "log.group_by_node", "model.chat_template_path", "trainer.save_strategy", "trainer.total_steps",
                "monitor.monitor_args", "trainer.trainer_type", "trainer.trainer_config",
                "buffer.explorer_input.default_workflow_type", "algorithm.kl_loss_fn_args.kl_coef",
                "trainer.val_only", "buffer.db", "buffer.py", "model.safetensors", "monitor.py"}


def test_every_key_the_readme_names_is_a_key_of_the_config():
    """The README names some 120 keys (`algorithm.kl_loss_coef`, `trainer.ranks`, ...); each is in the
    composed default config, so a renamed key cannot stay in the manual. The exceptions are those it
    names as Trinity-RFT's or verl's (the sentence "Not every key of the guide exists here") and file
    names."""
    cfg = compose_cfg()
    keys = {k.rstrip(".") for k in re.findall(r"`((?:algorithm|buffer|explorer|trainer|synchronizer|cluster|model|monitor|log|"
                          r"data_processor)\.[A-Za-z_][\w.]*)", README)}
    assert len(keys) > 100
    absent = {k for k in keys if OmegaConf.select(cfg, k, default="<absent>") == "<absent>"}
    assert absent == NOT_RFT_KEYS


@pytest.mark.slow  # wandb starts a service process (~2 s)
def test_wandb_holds_the_whole_config_and_a_resumed_stage_goes_on_in_its_run(tmp_path, monkeypatch, request):
    """"`monitor`: ... a resumed stage goes on in its run; wandb's run config holds the whole config
    too": the same run id for the same stage directory, the stage's composed config as its config."""
    import wandb

    from rft.plan.batch import stage_configs
    from rft.reporting.monitor import WandB

    # wandb keeps the settings it read from the environment for the life of the process: offline
    # stayed on after this test, and a later test's wandb.init with no key started instead of failing
    request.addfinalizer(wandb.teardown)
    monkeypatch.setenv("WANDB_MODE", "offline")  # no account, no network
    monkeypatch.setenv("WANDB_SILENT", "true")
    [stage] = stage_configs(compose_cfg(["stages=[]", "buffer.batch_size=12"]))
    first = WandB(stage, tmp_path, "grpo", 0)
    run_id, name, config = first.run.id, first.run.name, dict(first.run.config)
    first.close()
    resumed = WandB(stage, tmp_path, "grpo", 30)
    assert resumed.run.id == run_id and name == "grpo-tiny-arithmetic/grpo"
    resumed.close()
    assert (config["stage"], config["buffer"]["batch_size"], config["algorithm"]["algorithm_type"]) == ("grpo", 12, "grpo")
    assert set(config) >= {"model", "trainer", "explorer", "synchronizer", "cluster", "seed"}
    other = WandB(stage, tmp_path / "other", "grpo", 0)
    other.close()
    assert other.run.id != run_id  # another run directory, another run


def readme_code(first_line: str) -> str:
    """The README's ```python block that begins with `first_line`."""
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    [block] = [b for b in blocks if b.startswith(first_line)]
    return block


def test_the_readmes_reward_and_environment_examples_run_as_written(tmp_path, monkeypatch):
    """"Writing a reward"'s `my_study/rewards.py` and "Multi-turn agents and tools"' `my_study/envs.py`,
    copied from the README into a study's folder: the reward scores a wrapped answer 1 and a bare one
    0; the environment passes planning's check with the README's workflow_args, runs a Qwen-style
    tool call, answers a bad expression with the ToolError's reason, and scores the answer."""
    from types import SimpleNamespace

    from rft.rollout.workflows.multi_turn import check_args

    study = tmp_path / "my_study"
    study.mkdir()
    (study / "rewards.py").write_text(readme_code("# my_study/rewards.py"))
    (study / "envs.py").write_text(readme_code("# my_study/envs.py"))
    monkeypatch.syspath_prepend(str(tmp_path))
    # the study's package is this test's alone: removed from sys.modules after it (monkeypatch
    # restores the absent entries), so a later test of this process finds no my_study
    for name in ("my_study", "my_study.rewards", "my_study.envs"):
        monkeypatch.setitem(sys.modules, name, None)
        del sys.modules[name]
    from my_study.rewards import tagged

    task = SimpleNamespace(answer="1776", messages=[{"role": "user", "content": "37*48"}])
    assert (tagged("", " <answer>1776</answer>\n", task), tagged("", "1776", task)) == (1.0, 0.0)
    assert tagged("", "<sol>1</sol>", task, tag="sol") == 1.0
    # the parts example below it (conf/task/<yours>.yaml): countdown plus the tagged format part at
    # weight 0.1, "the experience's reward is the weighted sum", each part kept before weighting
    import yaml

    from rft.rewards.scoring import build

    example = re.search(r"```yaml\n# conf/task/<yours>\.yaml \(or the command line, as one quoted list\)\n(.*?)```",
                        README, re.S).group(1)
    scorer = build(yaml.safe_load(example)["taskset"]["reward_fn"], "buffer.explorer_input.taskset.reward_fn")
    row = SimpleNamespace(row={"numbers": [8, 2, 3], "target": 3}, task_id=0, answer=None)
    rewards = scorer("8,2,3->3", ["<answer>8-2-3</answer>", "8-2-3", "<answer>8+2+3</answer>"], row)
    assert [float(r) for r in rewards] == [1.1, 1.0, 0.1]  # 1 + 0.1 x 1; 1 + 0.1 x 0; 0 (8+2+3 = 13) + 0.1 x 1
    assert [r.parts for r in rewards] == [{"countdown": 1.0, "format": 1.0}, {"countdown": 1.0, "format": 0.0},
                                          {"countdown": 0.0, "format": 1.0}]
    flow = re.search(r"```yaml\n# conf/task/<yours>\.yaml\ntaskset:\n  workflow: multi_turn\n(.*?)```", README, re.S)
    args = yaml.safe_load(flow.group(1))["workflow_args"]
    assert args == {"env": "my_study.envs.Calculator", "env_args": {"max_tool_calls": 2}, "max_turns": 3}
    env_cls = check_args(args)
    env = env_cls(max_tool_calls=2)
    assert env.reset(task) == task.messages
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
    assert env.step(call % "37*48") == ({"role": "tool", "content": "1776"}, {}, False)
    assert env.step(call % "37/48")[0] == {"role": "tool", "content": "error: not arithmetic: '37/48'"}
    assert env.step(call % "1+1")[0]["content"] == "error: no more tool calls: 2 per conversation"
    assert env.step("1776") == (None, {"correct": 1.0}, True)
    assert env.info["tool_calls"] == 3 and env.info["tool_failures"] == 2


def test_every_repository_path_the_readmes_name_exists():
    """Each `rft/...`, `tests/...`, `experiments/...`, `conf/...` and `launchers/...` path that README.md
    and experiments/*/README.md name is in the repository (a moved or renamed file fails here; it
    failed for `rft/rewards.REWARD_FNS`). Paths with a placeholder (`conf/task/<name>.yaml`) and what
    the tests write (`tests/artifacts/`) are left out."""
    missing = []
    for readme in [ROOT / "README.md", *sorted(ROOT.glob("experiments/*/README.md"))]:
        for path in set(re.findall(r"(?<![\w/.])((?:rft|tests|experiments|conf|launchers)/[\w./<>-]*[\w/>])",
                                   readme.read_text())):
            if "<" not in path and not path.startswith("tests/artifacts/") and not (ROOT / path).exists():
                missing.append(f"{readme.relative_to(ROOT)}: {path}")
    assert missing == []


def test_every_dotted_name_of_rft_the_readme_gives_resolves():
    """`rft.rewards.verifiers.REWARD_FNS`, `rft.runtime.actors.long_lived`, `python -m rft.manifest`, ...:
    each dotted name of rft in the README is a module, or an attribute of one."""
    import importlib.util

    def is_module(dotted: str) -> bool:
        try:
            return importlib.util.find_spec(dotted) is not None
        except ModuleNotFoundError:  # a name inside a module that is no package (rft.registry.ENGINES)
            return False

    unresolved = []
    for name in sorted(set(re.findall(r"(?<![\w/.])(rft(?:\.\w+)+)", README))):
        parts = name.split(".")
        module = next(i for i in range(len(parts), 0, -1) if is_module(".".join(parts[:i])))
        obj = importlib.import_module(".".join(parts[:module]))
        for attr in parts[module:]:
            obj = getattr(obj, attr, None)
        if obj is None:
            unresolved.append(name)
    assert unresolved == []


@pytest.mark.slow  # 1.0 s alone, over the fast tier's second
def test_the_readmes_data_processor_example_plans():
    """"### Data pipelines": the `data_processor:` example, as written in the README, is a section of
    the config whose every operator is known and takes its args (planning's check), its operators in
    the order given and the curriculum on."""
    from rft.data.pipeline import check_operators, operators

    block = re.search(r"\n    data_processor:\n((?:      .*\n)+)", README).group(1)
    section_cfg = OmegaConf.create("\n".join(line[4:] for line in block.splitlines()))
    cfg = compose_cfg()
    cfg.data_processor = OmegaConf.merge(cfg.data_processor, section_cfg)  # the schema's types and defaults
    check_operators(cfg)
    dp = cfg.data_processor
    assert [name for name, _ in operators(dp.task_pipeline.operators)] == [
        "text_length_filter", "document_deduplicator", "document_minhash_deduplicator", "llm_difficulty_score_filter",
        "curriculum_order"]
    assert [name for name, _ in operators(dp.experience_pipeline.operators)] == [
        "reward_shaping_mapper", "group_diversity_filter"]
    assert (dp.online_curriculum.enable, dp.online_curriculum.window, dp.online_curriculum.eps) == (True, 8, 0.05)
    # "Both are empty by default"; the curriculum off
    default = compose_cfg().data_processor
    assert (list(default.task_pipeline.operators), list(default.experience_pipeline.operators),
            default.online_curriculum.enable) == ([], [], False)


def test_the_batch_plans_rows_are_those_the_readme_derives():
    """"### The batch plan": each quantity of its formula block is a row of the dry run's plan, with the
    value the formula gives for the default GRPO stage: 16 tasks x 8 rollouts = 128 experiences; 128
    / 128 (mini-batch) x 1 pass = 1 optimizer step; 128 / (128 rows a micro-batch x 1 rank) = 1."""
    from rft.plan.batch import format_plan, make_plan, stage_configs

    block = re.search(r"\n    tasks per step +=.*?\n\n", section("### The batch plan"), re.S).group(0)
    names = [line.split("=")[0].strip() for line in block.strip().splitlines()]
    assert names == ["tasks per step", "rollouts per task", "experiences per step", "optimizer steps per step",
                     "micro-batches per optimizer step"]
    table = format_plan(make_plan(stage_configs(compose_cfg())[-1], 2000))
    rows = {re.split(r"\s{2,}", line.strip())[0]: line.split()[-2] for line in table.splitlines() if re.search(r"\s\d+\s", line)}
    assert [rows[n] for n in names] == ["16", "8", "128", "1", "1"]
