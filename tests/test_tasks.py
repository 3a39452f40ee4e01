"""Tasksets and offline data: the format keys, messages prompts, preference pairs, the generator."""

import json

import pytest
from omegaconf import OmegaConf

from rft.config import ExperienceBufferConfig, TasksetConfig
from rft.data.readers import DatasetReader
from rft.data.tasks import generate_arithmetic, load_tasks


def test_arithmetic_rows_are_correct_and_test_is_held_out(tmp_path):
    path = generate_arithmetic(tmp_path / "arith")
    rows = {s: [json.loads(l) for l in (path / f"{s}.jsonl").read_text().splitlines()] for s in ("train", "test")}
    assert (len(rows["train"]), len(rows["test"])) == (2000, 200)
    assert not {r["question"] for r in rows["train"]} & {r["question"] for r in rows["test"]}
    for r in rows["train"][:50]:
        a, b = r["question"].split("+")
        assert int(a) + int(b) == int(r["answer"]) and len(r["answer"]) == 3
        assert r["rejected"] != r["answer"] and r["teacher_answer"] in (r["answer"], r["rejected"])
    wrong = sum(r["teacher_answer"] != r["answer"] for r in rows["train"]) / 2000
    assert 0.55 < wrong < 0.65  # teacher_error_rate 0.6



def test_long_tail_rows_are_mostly_short_and_a_few_long(tmp_path):
    """task=long_tail: ~15% of the answers write the working out (63..143 characters), the others
    are the sum alone; last_number checks the sum at the end of either."""
    import string
    from types import SimpleNamespace

    from rft.data.tasks import generate_long_tail
    from rft.rewards.verifiers import last_number

    path = generate_long_tail(tmp_path / "long-tail-v1")
    rows = {s: [json.loads(l) for l in (path / f"{s}.jsonl").read_text().splitlines()] for s in ("train", "test")}
    assert (len(rows["train"]), len(rows["test"])) == (2000, 200)
    # seed 0's first test rows, checked by hand: 7+1, 6+3, 0+6; and 5+4, 7+0, 5+4 written 4 times
    assert rows["test"][0] == {"question": "760+136", "answer": "896", "long": False, "teacher_answer": "897",
                               "rejected": "897"}
    assert rows["test"][1]["question"] == "575+404?w4"
    assert rows["test"][1]["answer"] == ("1:5+4=9;7+0=7;5+4=9|2:5+4=9;7+0=7;5+4=9|3:5+4=9;7+0=7;5+4=9|"
                                         "4:5+4=9;7+0=7;5+4=9|979")
    operands = {s: {r["question"].split("?")[0] for r in rows[s]} for s in rows}
    assert not operands["train"] & operands["test"]
    train = rows["train"]
    assert 0.12 < sum(r["long"] for r in train) / len(train) < 0.18  # long_fraction 0.15
    assert {len(r["answer"]) for r in train if not r["long"]} == {3}
    assert {len(r["answer"]) for r in train if r["long"]} == {63, 83, 103, 123, 143}  # 3..7 passes of 20, the sum
    # every character is one the tiny model's tokenizer has (rft/models.py), and fits its 19 of question
    assert set("".join(r["question"] + r["answer"] for r in train)) <= set(string.digits + string.punctuation + "w")
    assert max(len(r["question"]) for r in train) <= 19
    for r in train[:100]:
        a, b = r["question"].split("?")[0].split("+")
        assert r["answer"].endswith("|" + str(int(a) + int(b))) if r["long"] else r["answer"] == str(int(a) + int(b))

    # the reward: the sum at the end, whether after the working or alone
    def reward(response):
        return last_number("", response, SimpleNamespace(answer=rows["test"][1]["answer"]))
    assert reward(rows["test"][1]["answer"]) == 1.0 and reward("979") == 1.0
    assert reward(rows["test"][1]["rejected"]) == 0.0 and reward("978") == 0.0
    assert reward("1:5+4=9;7+0=7;5+4=9|2:5+4=9;7+0=7;5+4=9") == 0.0  # cut before the sum
    assert last_number("", "896", SimpleNamespace(answer="896")) == 1.0
    assert last_number("", "897", SimpleNamespace(answer="896")) == 0.0

def test_messages_prompts(tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "1+1"}], "answer": "2"}) + "\n")
    ts = OmegaConf.structured(TasksetConfig(path=str(data)))
    ts.format.prompt_type = "messages"
    (task,) = load_tasks(ts, "buffer.explorer_input.taskset")
    assert task.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1"}]
    assert task.answer == "2"


def test_plaintext_prompt_gets_the_system_prompt(tmp_path):
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"q": "2+2", "a": "4"}) + "\n")
    ts = OmegaConf.structured(TasksetConfig(path=str(data)))
    ts.format.prompt_key, ts.format.response_key, ts.format.system_prompt = "q", "a", "Answer only."
    (task,) = load_tasks(ts, "buffer.explorer_input.taskset")
    assert task.messages == [{"role": "system", "content": "Answer only."}, {"role": "user", "content": "2+2"}]
    assert task.answer == "4"


class CharTokenizer:
    """Enough of a tokenizer for the reader: one id per character, eos 0."""

    eos_token_id = 0

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return [ord(c) for c in messages[-1]["content"]]

    def encode(self, text, add_special_tokens):
        return [ord(c) for c in text]


def test_preference_pairs_stay_together(tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}", "good": "y", "bad": "n"}) + "\n" for i in range(6)))
    buf = OmegaConf.structured(ExperienceBufferConfig(storage_type="file", path=str(data)))
    buf.format.chosen_key, buf.format.rejected_key = "good", "bad"
    reader = DatasetReader(buf, CharTokenizer(), 8, 4, seed=0)
    batch = reader.batch(0, 4)  # 4 experiences = 2 pairs
    assert len(batch) == 4
    for chosen, rejected in zip(batch[0::2], batch[1::2]):
        assert chosen.group_id == rejected.group_id
        assert chosen.tokens[chosen.prompt_length:] == [ord("y"), 0]
        assert rejected.tokens[rejected.prompt_length:] == [ord("n"), 0]


def test_a_mistyped_local_path_fails_at_once_instead_of_trying_the_hub(tmp_path, monkeypatch):
    import pytest

    from rft.data.tasks import load_rows
    from rft.errors import ConfigError

    # data/ is here, data/vowel is not: a local path mistyped, not a hub id to download
    (tmp_path / "data").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    with pytest.raises(ConfigError) as e:
        load_rows("data/vowel", key="buffer.explorer_input.taskset.path")
    assert str(e.value).startswith(
        f"buffer.explorer_input.taskset.path='data/vowel': no such file or directory (relative to {tmp_path}); it is "
        f"read as a local path because data/ is a directory here.")


def test_the_generator_writes_only_its_own_directory(tmp_path):
    import pytest

    from rft.data.tasks import ensure_task_data
    from rft.errors import ConfigError

    def inp(path):
        return OmegaConf.create({"generator": "arithmetic", "taskset": {"path": str(path)}})

    # a mistyped path: an error naming it, not a directory of generated problems to train on
    with pytest.raises(ConfigError, match=r"taskset.path='.*my_taks': no such file or directory\. The task's "
                                          r"generator \(arithmetic\) writes its data only into a directory named "
                                          r"'arithmetic-v4'"):
        ensure_task_data(inp(tmp_path / "my_taks"))
    assert not (tmp_path / "my_taks").exists()
    # the user's own data under another name: left as it is (nothing written beside it)
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"question": "1+1", "answer": "2"}\n')
    ensure_task_data(inp(mine))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.jsonl"]
    # its own directory: generated there
    ensure_task_data(inp(tmp_path / "arithmetic-v4"))
    assert (tmp_path / "arithmetic-v4" / "train.jsonl").exists() and (tmp_path / "arithmetic-v4" / "test.jsonl").exists()


def list_prompt_error(tmp_path, first_question) -> tuple:
    """The ConfigError of a taskset whose second row's question is a list, and the file."""
    import pytest

    from rft.errors import ConfigError

    data = tmp_path / "t.jsonl"
    data.write_text(json.dumps({"question": first_question, "answer": "2"}) + '\n{"question": ["1", "2"], "answer": "3"}\n')
    ts = OmegaConf.structured(TasksetConfig(name="t", path=str(data)))
    with pytest.raises(ConfigError) as e:
        load_tasks(ts, "buffer.explorer_input.taskset")
    return str(e.value), data


def test_a_prompt_that_is_a_list_is_an_error_naming_the_row(tmp_path):
    message, data = list_prompt_error(tmp_path, "1+1")
    # a list among texts: the datasets library reads the column as JSON (rft/data/tasks.py mixed_kinds)
    assert message == (
        f"buffer.explorer_input.taskset: row 1 (line 2 of its JSONL file) of '{data}' holds a list in 'question' "
        f"(format.prompt_key), where the other row holds text. With two kinds of value in one column, the datasets "
        f"library reads every value of it as JSON, so the text '58' would arrive as the number 58 and '007' as 7. "
        f"Write that row's value as text (\"[\\\"1\\\",\\\"2\\\"]\", quoted) or give every row of the column the same "
        f"kind. For chat messages set buffer.explorer_input.taskset.format.prompt_type=messages (and "
        f"format.messages_key).")
    # every row a list: one kind, so datasets keeps the lists; the first row is named when read
    message, data = list_prompt_error(tmp_path, ["1"])
    assert message.startswith(f"buffer.explorer_input.taskset: row 0 (line 1 of its JSONL file) of '{data}' has "
                              f"a list in 'question' (format.prompt_key), not a text.")


def test_a_reward_sees_the_prompt_as_the_model_saw_it():
    """README "Rewards and tasks": the prompt text handed to a reward is the chat template's text with
    its special tokens left out; the question as written is task.row[prompt_key]."""
    from types import SimpleNamespace

    from conftest import compose_cfg

    from rft.data.tasks import Task
    from rft.models import ensure_model, load_tokenizer
    from rft.rollout.engines.hf import Sample
    from rft.rollout.workflows.single_turn import WorkflowContext, single_turn

    cfg = compose_cfg()
    ensure_model(cfg.model)
    tok = load_tokenizer(cfg.model)
    seen = []

    def score(jobs):
        seen.extend(jobs)
        return [[0.0] * len(responses) for _, responses, _ in jobs]

    engine = SimpleNamespace(generate=lambda prompts, n, args, seed=None: [
        [Sample(tok.encode("357", add_special_tokens=False), [-0.1] * 3, "stop")] for _ in prompts])
    args = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=None, stop=[])
    ctx = WorkflowContext(tokenizer=tok, n=1, rollout_args=args, max_prompt_tokens=24, policy_version=0, seed=0,
                          step=1, score=score)
    row = {"question": "042+315", "answer": "357"}
    single_turn([Task("t/0", [{"role": "user", "content": row["question"]}], row["answer"], row)], engine, ctx)
    (prompt, responses, task), = seen
    assert (prompt, responses, task.row["question"]) == ("user042+315assistant", ["357"], "042+315")


def test_characters_the_tokenizer_does_not_know_are_warned_about(tmp_path):
    """The tiny model's tokenizer knows ASCII letters, digits and punctuation and drops the rest:
    'Σ数 1+1 🙂' was '1+1' to the model, and the run said nothing."""
    import json

    from conftest import compose_cfg

    from rft.data.readers import budget_report
    from rft.models import ensure_model, load_tokenizer

    data = tmp_path / "t.jsonl"
    rows = [{"question": "Σ数 1+1\t🙂", "answer": "2"}, {"question": "1+2", "answer": "3"}, {"question": "2+2", "answer": "四"}]
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    cfg = compose_cfg(["stages=[]", f"buffer.explorer_input.taskset.path={data}"])
    ensure_model(cfg.model)
    tok = load_tokenizer(cfg.model)
    where = "buffer.explorer_input.taskset"
    text = budget_report(cfg.buffer.explorer_input.taskset, tok, cfg.model, False, where)
    assert text == (f"1 of the first 3 prompts of {where} ({data}) hold characters the tokenizer has no token for "
                    f"('Σ', '数', '🙂'): the model does not see them (each is dropped or read as the one unknown "
                    f"token). Use a model whose tokenizer has them, or data without them. 1 of the first 3 prompts "
                    f"of {where} ({data}) hold whitespace between two characters that the tokenizer drops ('Σ数 1+1\\t🙂' "
                    f"reaches the model as 'Σ数 1+1🙂'): the model cannot see where a word ends, nor write an answer "
                    f"that holds a space. Join the parts with a character it keeps (a comma, as task=countdown does), "
                    f"or use a model whose tokenizer keeps spaces.")
    # a training dataset's responses too
    text = budget_report(cfg.buffer.explorer_input.taskset, tok, cfg.model, True, where)
    assert ("; 1 of its first 3 responses ('四'): the model does not see them (each is dropped or read as the one "
            "unknown token). Use a model whose tokenizer has them, or data without them. 1 of the first 6 prompts and "
            "answers") in text


def test_spaces_the_tokenizer_drops_between_words_are_warned_about():
    """A tokenizer that drops whitespace between words: the tiny model's v1 dropped spaces and
    newlines (transformers loads its character vocabulary into Qwen2's byte-level pre-tokenizer,
    whose space was a byte the vocabulary lacked): a study's "sort gadf" reached the model as
    "sortgadf", its answer "12 34" could never be written, and the run said nothing. v2 keeps
    spaces and newlines, and still drops a tab. A space at a prompt's end joins nothing: no sentence."""
    from conftest import compose_cfg

    from rft.data.readers import dropped_spaces
    from rft.models import ensure_model, load_tokenizer

    cfg = compose_cfg(["stages=[]"])
    ensure_model(cfg.model)
    tok = load_tokenizer(cfg.model)

    def enc(text):
        return tok.encode(text, add_special_tokens=False)

    # a token a character, the space and the newline included (101 and 102: v1's ids for them)
    assert enc("sort gadf")[4] == 101 and enc("a b\nc") == [17, 101, 18, 102, 19]
    assert enc("sort\tgadf") == enc("sortgadf")
    assert dropped_spaces(tok, [["sort gadf"], ["a\nb"]], ["12 34"], "of X (x.jsonl)") is None
    prompts = [["sort\tgadf"], ["1+2"], ["Add.", "3+4\t"]]  # a system prompt and a trailing tab: kept apart
    assert dropped_spaces(tok, prompts[1:], ["3", "7"], "of X (x.jsonl)") is None
    assert dropped_spaces(tok, prompts, ["12 \t34", "3", "7"], "of X (x.jsonl)") == (
        # 2 of 6: "sort\tgadf" and the answer "12 \t34", whose tab goes and space stays (3 prompts + 3 answers)
        "2 of the first 6 prompts and answers of X (x.jsonl) hold whitespace between two characters that the "
        "tokenizer drops ('sort\\tgadf' reaches the model as 'sortgadf'): the model cannot see where a word ends, "
        "nor write an answer that holds a space. Join the parts with a character it keeps (a comma, as "
        "task=countdown does), or use a model whose tokenizer keeps spaces.")
    assert dropped_spaces(tok, prompts, [], "of X (x.jsonl)").startswith("1 of the first 3 prompts of X")
    assert "('12 \\t34' reaches the model as '12 34')" in dropped_spaces(tok, [], ["12 \t34"], "of X")

    class KeepsSpaces:  # a tokenizer with a token for every character, whitespace included
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    assert dropped_spaces(KeepsSpaces(), prompts, ["12 34"], "of X (x.jsonl)") is None


@pytest.mark.slow  # builds the tiny model where the session has not yet (~10 s)
def test_the_tiny_models_budget_holds_a_19_character_question_and_a_5_character_answer():
    """README "Starting a new study": with the tiny model, keep questions within 19 characters and
    answers within 5 (or raise model.max_prompt_tokens / max_response_tokens). One token a
    character: the chat template's 5 tokens (<|im_start|>, user ... <|im_end|>, the assistant's
    header: <|im_start|>, assistant) + 19 = 24 = max_prompt_tokens; 5 + the end token = 6 = max_response_tokens."""
    from conftest import compose_cfg

    from rft.data.readers import prompt_ids
    from rft.models import ensure_model, load_tokenizer

    cfg = compose_cfg()
    ensure_model(cfg.model)
    tok = load_tokenizer(cfg.model)
    lengths = [len(ids) for ids in prompt_ids(tok, [[{"role": "user", "content": "1" * n}] for n in (19, 20)])]
    assert lengths == [cfg.model.max_prompt_tokens, cfg.model.max_prompt_tokens + 1] == [24, 25]
    answer = tok.encode("12345", add_special_tokens=False) + [tok.eos_token_id]
    assert len(answer) == cfg.model.max_response_tokens == 6


def test_an_eval_set_grouped_by_a_column_its_data_lacks_is_one_paragraph(tmp_path):
    """group_by names a column of the rows: one the data lacks put every task in one group
    'level=None' (its per-group metrics equal the set's, read as a result); now one paragraph."""
    from rft.errors import ConfigError

    data = tmp_path / "e.jsonl"
    data.write_text('{"question": "1+1", "answer": "2", "difficulty": 1}\n')
    ts = OmegaConf.structured(TasksetConfig(name="e", path=str(data), group_by="level"))
    with pytest.raises(ConfigError) as e:
        load_tasks(ts, "buffer.explorer_input.eval_tasksets[0]")
    assert str(e.value) == (
        f"buffer.explorer_input.eval_tasksets[0].group_by='level': buffer.explorer_input.eval_tasksets[0].path="
        f"'{data}' has no column 'level', so every task would fall in one group 'level=None'; its columns are "
        f"['answer', 'difficulty', 'question']. Set buffer.explorer_input.eval_tasksets[0].group_by to one of "
        f"them, or to null for the set's metrics alone.")
    ts.group_by = "difficulty"  # a column it has: loads
    assert [t.row["difficulty"] for t in load_tasks(ts, "buffer.explorer_input.eval_tasksets[0]")] == [1]
