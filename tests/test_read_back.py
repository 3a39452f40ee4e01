"""Files a run reads back, attacked: a crafted file must run no code, and a damaged one (another
tool's, nested a thousand deep, a "billion laughs") gives a message naming it, never a raw
traceback, a hang, or a run that trains on it as something else."""

import json
import shutil
import sqlite3
import time

import pytest
from omegaconf import OmegaConf
from test_buffers import buf_cfg, exps

from rft.data.buffer import make_buffer
from rft.errors import ConfigError, RunError

DEEP = "[" * 5000 + "]" * 5000  # json (C) and PyYAML (Python) recurse once per level: ~1000 is the limit


def billion_laughs() -> str:
    """Nine aliases of nine, nine deep: 9^9 = 387,420,489 'lol' strings once expanded."""
    text, prev = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n', "a"
    for name in "bcdefghi":
        text += f"{name}: &{name} [{', '.join(['*' + prev] * 9)}]\n"
        prev = name
    return text


def test_a_metrics_line_nested_a_thousand_deep_is_left_out_as_a_cut_line_is(tmp_path, capsys):
    """metrics.jsonl is read back on resume (rft.reporting.monitor), by the report and the studio:
    json.loads raises RecursionError there, not JSONDecodeError, and each read was a traceback."""
    from rft.reporting import monitor, report
    from rft.studio.index import CachedFiles

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "x": 1}\n' + DEEP + '\n{"step": 2, "x": 2}\n')
    assert [r["step"] for r in monitor.read_metrics(path)] == [1, 2]
    assert "line 2 is not a JSON record" in capsys.readouterr().err
    assert [r["step"] for r in report.read_jsonl(path)] == [1, 2]
    assert [r["step"] for r in CachedFiles().jsonl(path)] == [1, 2]


@pytest.mark.parametrize("kind", ["sql", "file"])
@pytest.mark.parametrize("column, value, why", [
    ("tokens", DEEP, "RecursionError: maximum recursion depth exceeded"),
    ("tokens", "[1, 2", "JSONDecodeError: Expecting ',' delimiter"),
    ("tokens", '["a", "b", "c", "d"]', "ValueError: tokens is not a non-empty list of token ids (whole numbers)"),
    ("prompt_length", 9, "ValueError: prompt_length 9 is not a whole number from 1 to the 4 tokens"),
    # another tool's file: a log-prob for every token, the prompt's included. Placed from the
    # prompt's end, they were the response's, or an IndexError past the longest row
    ("logprobs", "[-0.1, -0.2, -0.3, -0.4]",
     "ValueError: logprobs has 4 entries for the 2 response tokens (tokens after prompt_length 2): one per "
     "response token, or none"),
])
def test_a_stored_experience_that_is_not_one_stops_the_trainer_naming_its_row(tmp_path, kind, column, value, why):
    path = tmp_path / ("b.db" if kind == "sql" else "b.jsonl")
    buf = make_buffer(buf_cfg(kind, path=str(path)))
    buf.put(exps(2))  # tokens [0, 1, 2, 3] then [1, 2, 3, 4], prompt_length 2, two log-probs
    buf.close()
    if kind == "sql":
        with sqlite3.connect(path) as c:
            c.execute(f"UPDATE experiences SET {column} = ? WHERE id = 2", (value,))
        where = f"the buffer {path}: row id 2 of table experiences is not a stored experience ({why}"
    else:
        lines = path.read_text().splitlines()
        row = json.loads(lines[1])
        lines[1] = (json.dumps({**row, column: "@"}).replace('"@"', value if isinstance(value, str) else str(value))
                    if column != "tokens" or value != DEEP else DEEP)
        path.write_text("\n".join(lines) + "\n")
        where = f"the buffer {path}: line 2 is not a stored experience ({why}"
    reader = make_buffer(buf_cfg(kind, path=str(path)))
    with pytest.raises(RunError) as e:
        reader.get(2, timeout=0.1)
    assert str(e.value).startswith(where)
    reader.close()


@pytest.mark.parametrize("text, why", [
    (billion_laughs(), "does not parse as a config"),
    ("a: " + DEEP + "\n", "does not parse as a config"),
])
def test_a_stage_config_that_rft_never_writes_is_damage_at_once_not_a_hang(tmp_path, text, why):
    """A resumed stage compares its saved config.yaml's fingerprint (rft.runtime.rundir): the
    billion laughs loaded in a millisecond, then hashing its 387 million strings took minutes
    and GBs; nesting a thousand deep was a RecursionError. OmegaConf writes neither."""
    from rft.runtime import rundir

    (tmp_path / "config.yaml").write_text(text)
    start = time.monotonic()
    assert rundir.saved_config(tmp_path) is None
    assert rundir.record_problem(tmp_path) == why
    assert time.monotonic() - start < 1


def test_the_report_and_the_studio_refuse_an_alias_in_a_runs_hydra_files(tmp_path, capsys):
    from rft.reporting import report
    from rft.studio.runs import Runs

    for name in ("a", "b"):
        (tmp_path / name / ".hydra").mkdir(parents=True)
        (tmp_path / name / ".hydra" / "config.yaml").write_text("seed: 1\n")
    (tmp_path / "b" / ".hydra" / "config.yaml").write_text(billion_laughs())
    (tmp_path / "b" / ".hydra" / "overrides.yaml").write_text("- &x seed=1\n- *x\n")
    assert report.parse_overrides(tmp_path / "b", "b") is None
    assert ("b/.hydra/overrides.yaml does not parse as YAML (an alias (*x) at line 2, which rft and Hydra never "
            "write)") in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"^b: its config \(config.yaml\) does not read: an alias \(\*a\) at line 2"):
        Runs(tmp_path).diff("a", "b")


@pytest.mark.slow  # ~3 s: builds the tiny model and loads it
def test_a_model_folder_runs_none_of_its_code_when_loaded(tmp_path):
    """A model folder (a download, a checkpoint's hf/) whose config.json and tokenizer_config.json
    name their own classes (auto_map) and whose chat template reaches for os: with
    trust_remote_code false (the default) no file of it runs, and the template's reach is
    transformers' sandbox's error, in one paragraph naming the folder."""
    from rft.models import build_tiny_model, load_model, load_tokenizer

    marker = tmp_path / "ran"
    d = build_tiny_model(tmp_path / "model")
    (d / "evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
                               f"from transformers import Qwen2Config as C, Qwen2ForCausalLM as M, "
                               f"PreTrainedTokenizerFast as T\n")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoConfig": "evil.C",
                                                                      "AutoModelForCausalLM": "evil.M"}}))
    tok_config = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**tok_config, "auto_map": {"AutoTokenizer": ["evil.T", None]}}))
    (d / "chat_template.jinja").write_text("{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}")
    cfg = OmegaConf.create({"model_path": str(d), "trust_remote_code": False, "custom_chat_template": None,
                            "dtype": "float32", "stop_token_ids": None})
    load_model(cfg)
    with pytest.raises(ConfigError) as e:
        load_tokenizer(cfg)
    assert str(e.value) == (f"the chat template of model.model_path={str(d)!r} fails on a one-message conversation "
                            f"(SecurityError: access to attribute '__init__' of 'type' object is unsafe.). Fix the "
                            f"template (or set model.custom_chat_template to one that renders).")
    assert not marker.exists()
    shutil.rmtree(d)
