"""run.py's checks of a study's own files when the study is kept outside the repository and comes in
through Hydra's search path (`python run.py 'hydra.searchpath=[file://<study>]' experiment=mine`):
the checks were skipped, so a misspelt key was Hydra's "Key 'lrr' not in 'OptimizerConfig'" with no
line, and `_self_` before the extended file lost its values silently. Each case here is run.py's own
call (exit_on_config_mistakes) on the shipped conf/ and a study folder in tmp_path."""

import pytest
from conftest import CONF

from rft.plan.overlays import exit_on_config_mistakes, search_dirs

MINE = "# @package _global_\n# python run.py experiment=mine\n"


def said(args: list[str], capsys) -> str | None:
    """run.py's check on `args`: its paragraph (without the prefix), or None when it lets Hydra go on."""
    try:
        exit_on_config_mistakes(args, CONF)
    except SystemExit as e:
        assert e.code == 2
        return capsys.readouterr().err.strip().removeprefix("rft: configuration error: ")
    return None


def shipped(group: str) -> str:
    """The options of `group` that conf/ has and the study's `mine`, sorted, as the message lists them."""
    return ", ".join(sorted({p.stem for p in (CONF / group).glob("*.yaml")} | {"mine"}))


@pytest.fixture
def study(tmp_path, monkeypatch):
    """A study folder beside the current directory: experiment/mine.yaml and a task of its own."""
    (tmp_path / "study" / "experiment").mkdir(parents=True)
    (tmp_path / "study" / "task").mkdir()
    monkeypatch.chdir(tmp_path)  # a search folder's files are named relative to where run.py runs
    return tmp_path / "study"


def test_a_misspelt_key_in_a_study_outside_the_repository_is_named_with_its_file_and_line(study, capsys):
    (study / "experiment" / "mine.yaml").write_text(MINE + "algorithm:\n  optimizer:\n    lrr: 1.0e-5\n")
    message = said([f"hydra.searchpath=[file://{study}]", "experiment=mine"], capsys)
    # line 5: the two header lines, algorithm, optimizer, then lrr
    assert message == ("study/experiment/mine.yaml, line 5: algorithm.optimizer.lrr: Key 'lrr' not in "
                       "'OptimizerConfig'. Did you mean algorithm.optimizer.lr or algorithm.optimizer.min_lr_ratio? The "
                       "keys, each with a comment, are in rft/config.py; `python run.py --cfg job` prints the composed config.")
    # a file of the study that is not YAML: its name and line, not Hydra's traceback (bad_yaml reads conf/ only)
    (study / "experiment" / "mine.yaml").write_text(MINE + "name: a\n  seed: 1\n")
    assert said([f"hydra.searchpath=[file://{study}]", "experiment=mine"], capsys).startswith(
        "study/experiment/mine.yaml is not valid YAML: mapping values are not allowed in this context at line 4, column 7.")


def test_self_before_the_shipped_file_a_study_task_extends_names_both_files(study, capsys):
    # the study's task/mine.yaml extends conf/task/gsm8k.yaml (a bare name: its own group, found in conf/)
    (study / "task" / "mine.yaml").write_text(
        "# @package buffer.explorer_input\ndefaults:\n  - _self_\n  - gsm8k\ntaskset:\n  split: test\n")
    message = said([f"hydra.searchpath=[file://{study}]", "task=mine"], capsys)
    assert message == ("study/task/mine.yaml, line 3: `_self_` comes before 'gsm8k' in its defaults list, so the "
                       "values of conf/task/gsm8k.yaml replace this file's own (buffer.explorer_input.taskset.split): "
                       "Hydra merges the list in order. Put `_self_` last.")


def test_a_missing_option_in_a_study_defaults_list_names_the_folders_searched(study, capsys):
    (study / "task" / "mine.yaml").write_text("# @package buffer.explorer_input\ntaskset:\n  split: test\n")
    (study / "experiment" / "mine.yaml").write_text(MINE + "defaults:\n  - override /task: mien\n  - _self_\n")
    message = said([f"hydra.searchpath=[file://{study}]", "experiment=mine"], capsys)
    # the options are both folders' (conf/task/*.yaml and the study's mine), as Hydra lists them, sorted
    # (read from conf/ here, so that a copy of the template with a task of its own passes too)
    assert message == ("study/experiment/mine.yaml, line 4: its defaults list names 'task/mien', but there is no "
                       f"task/mien.yaml in conf/ or study/ (the options of 'task' are {shipped('task')}). "
                       "Fix the name in that file.")
    assert shipped("task").startswith("arithmetic, calculator, countdown, gsm8k") and ", mine, " in message
    # the command line's choice of a study's option: the same folders
    assert said([f"hydra.searchpath=[file://{study}]", "experiment=mien"], capsys) == (
        f"experiment=mien: there is no experiment/mien.yaml in conf/ or study/ (the options of 'experiment' are "
        f"{shipped('experiment')}). Did you mean experiment=mine?")


def test_a_correct_study_passes_the_checks_and_composes_with_its_own_task(study, capsys):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    (study / "task" / "mine.yaml").write_text(
        "# @package buffer.explorer_input\ndefaults:\n  - arithmetic\n  - _self_\ntaskset:\n  split: test\n")
    (study / "experiment" / "mine.yaml").write_text(
        MINE + "defaults:\n  - override /task: mine\n  - _self_\nname: kept_outside\nseed: 7\n")
    args = [f"hydra.searchpath=[file://{study}]", "experiment=mine"]
    assert said(args, capsys) is None
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose("config", overrides=args)
    finally:
        GlobalHydra.instance().clear()
    assert (cfg.name, cfg.seed, cfg.buffer.explorer_input.taskset.split) == ("kept_outside", 7, "test")
    # the rest of the task is conf/task/arithmetic.yaml's, which mine.yaml extends
    assert cfg.buffer.explorer_input.taskset.name == "arithmetic_train"


def test_the_file_hydra_composes_is_the_one_checked_conf_first_then_the_search_path_in_order(tmp_path, capsys):
    # Hydra 1.3 looks in conf/ first, then each search-path folder as listed (tried: the same
    # experiment in conf/ and in a folder composes conf/'s; in two folders, the first listed's)
    a, b = tmp_path / "a" / "experiment", tmp_path / "b" / "experiment"
    a.mkdir(parents=True)
    b.mkdir(parents=True)
    (a / "tiny_arithmetic.yaml").write_text(MINE + "namee: shadowed\n")  # conf/'s file wins: never composed
    (a / "mine.yaml").write_text(MINE + "seed: 1\n")
    (b / "mine.yaml").write_text(MINE + "seedd: 1\n")  # a's wins
    assert said([f"hydra.searchpath=[file://{tmp_path}/a,file://{tmp_path}/b]", "experiment=tiny_arithmetic"], capsys) is None
    assert said([f"hydra.searchpath=[file://{tmp_path}/a,file://{tmp_path}/b]", "experiment=mine"], capsys) is None
    message = said([f"hydra.searchpath=[file://{tmp_path}/b,file://{tmp_path}/a]", "experiment=mine"], capsys)
    assert message.startswith(f"{tmp_path}/b/experiment/mine.yaml, line 3: seedd: Key 'seedd' not in 'Config'.")


def test_the_command_line_search_path_replaces_conf_config_yaml_s_as_in_hydra(tmp_path):
    (tmp_path / "config.yaml").write_text("hydra:\n  searchpath:\n    - file:///kept/a\n    - pkg://my_studies.conf\n")
    roots = search_dirs(["experiment=mine"], tmp_path)
    assert [str(p) for p in roots.extra] == ["/kept/a"] and roots.opaque  # a package's options: Hydra's to list
    roots = search_dirs(["hydra.searchpath=[file://b,c]", "experiment=mine"], tmp_path)
    assert [str(p) for p in roots.extra] == ["b", "c"] and not roots.opaque  # relative: to the current directory
    # `+hydra.searchpath=` is not Hydra's search path (it reads the key without a prefix): conf/'s holds
    assert [str(p) for p in search_dirs(["+hydra.searchpath=[file://b]"], tmp_path).extra] == ["/kept/a"]
