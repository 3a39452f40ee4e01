"""The LLM judge (`fn: judge`, rft/rewards/judge.py) against a fake OpenAI-compatible chat-completions server."""

import threading
import time

import pytest
from conftest import compose_cfg
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from test_reward_server import serving_app

from rft.data.tasks import Task
from rft.errors import ConfigError
from rft.rewards.judge import DEFAULT_SCORE_TEMPLATE, JudgeReward, parse_number, parse_yes_no
from rft.rewards.remote import RewardRequestError
from rft.rewards.scoring import build, spec_of

# real HTTP servers and subprocesses: in `make test`, out of the fast tier
pytestmark = pytest.mark.slow

TASK = Task(task_id="t1", messages=[{"role": "system", "content": "Add."}, {"role": "user", "content": "042+315"}],
            answer="357", row={"question": "042+315", "answer": "357"})


class FakeOpenAI:
    """POST /v1/chat/completions: a chat.completion whose reply is `replies[<the response graded>]`;
    the first `fail_first` requests get a 500, every one a 401 with a wrong key; records each
    request (body and Authorization header) and the most requests in flight at once. With `hold`, each
    request waits (up to 10 s) until that many are in flight: a count of concurrency that no timing
    of a loaded machine changes."""

    def __init__(self, replies: dict, key: str = "sk-test", fail_first: int = 0, sleep: float = 0.0,
                 graded=lambda text: text.split("Response:\n")[1].split("\n\n")[0], hold: int = 0):
        self.replies, self.key, self.fail_first, self.sleep, self.graded = replies, key, fail_first, sleep, graded
        self.requests, self.lock, self.now, self.most, self.hold = [], threading.Condition(), 0, 0, hold
        self.app = FastAPI()
        self.app.post("/v1/chat/completions")(self.complete)

    def complete(self, body: dict, request: Request):  # sync: FastAPI runs it on a worker thread
        with self.lock:
            self.requests.append({"body": body, "auth": request.headers.get("authorization")})
            n = len(self.requests)
            self.now += 1
            self.most = max(self.most, self.now)
            self.lock.notify_all()
            self.lock.wait_for(lambda: self.now >= self.hold, timeout=10)
        try:
            time.sleep(self.sleep)
            if request.headers.get("authorization") != f"Bearer {self.key}":
                return JSONResponse({"error": {"message": "Incorrect API key provided", "type": "invalid_request_error"}},
                                    status_code=401)
            if n <= self.fail_first:
                return JSONResponse({"error": {"message": "the model is overloaded"}}, status_code=500)
            graded = self.graded(body["messages"][-1]["content"])
            return {"id": f"chatcmpl-{n}", "object": "chat.completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": self.replies[graded]}}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
        finally:
            with self.lock:
                self.now -= 1


@pytest.fixture(autouse=True)
def judge_key(monkeypatch):
    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-test")


def test_a_group_is_graded_one_request_per_response():
    fake = FakeOpenAI({"357": "The sum is right.\nScore: 7", "358": "Off by one. **Score:** 2/10",
                       "banana": "I cannot grade this."})
    with serving_app(fake.app) as url:
        judge = JudgeReward(base_url=url + "/v1", model="judge-model", api_key="JUDGE_TEST_KEY")
        assert judge("<chat template>042+315", ["357", "358", "banana"], TASK) == [0.7, 0.2, 0.0]  # 7/10, 2/10, none
        assert judge.take_counters() == {"requests": 3, "retries": 0, "timeouts": 0, "failures": 0, "unparsed": 1}
    bodies = sorted((r["body"] for r in fake.requests), key=lambda b: b["messages"][0]["content"])
    assert bodies[0] == {
        "model": "judge-model", "temperature": 0.0,
        "messages": [{"role": "user", "content": (
            "You are grading a response to a question.\n\n"
            "Question:\n042+315\n\n"  # the task's question, not the policy's templated prompt
            "Reference answer (may be empty):\n357\n\n"
            "Response:\n357\n\n"
            "How correct and complete is the response? Reason briefly if you need to, then end your reply with "
            "a last line of the form \"Score: N\", N an integer from 0 (wrong) to 10 (fully correct).")}],
    }
    assert bodies[0]["messages"][0]["content"] == DEFAULT_SCORE_TEMPLATE.format(
        question="042+315", answer="357", response="357", max_score="10")
    assert {r["auth"] for r in fake.requests} == {"Bearer sk-test"}


def test_a_judge_part_in_a_reward_config():
    """The documented override composes, and builds the judge by its registry name."""
    fake = FakeOpenAI({"357": "yes", "358": "No."}, graded=lambda text: text.split(" = ")[1].rstrip("?"))
    with serving_app(fake.app) as url:
        cfg = compose_cfg([f'buffer.explorer_input.taskset.reward_fn=[{{fn: exact_match}}, {{fn: judge, weight: 0.5, '
                           f'args: {{base_url: "{url}/v1", model: m, api_key: sk-test, parse: yes_no, '
                           f'system: "You grade sums.", template: "{{prompt}} = {{response}}?"}}}}]'])
        scorer = build(spec_of(cfg.buffer.explorer_input.taskset.reward_fn), "reward_fn")
        rewards = scorer("042+315", ["357", "358"], TASK)
        assert [float(r) for r in rewards] == [1.5, 0.0]
        assert rewards[0].parts == {"exact_match": 1.0, "judge": 1.0}
        assert scorer.take_counters()["reward/judge/requests"] == 2
    assert sorted(r["body"]["messages"][1]["content"] for r in fake.requests) == ["042+315 = 357?", "042+315 = 358?"]
    assert all(r["body"]["messages"][0] == {"role": "system", "content": "You grade sums."} for r in fake.requests)


def test_the_documented_client_defaults_of_the_remote_reward_and_the_judge():
    """README "Rewards served by a model or a server": the remote reward's client waits `timeout` 30 s,
    retries 3 times with backoff 0.5 s doubling to at most 8 s, 8 requests at once; the judge the same
    but a 60 s timeout (a model's reply takes longer than a rule's)."""
    from rft.rewards.remote import RemoteReward

    remote = RemoteReward("http://127.0.0.1:9", token="t0ken", check=False).http
    judge = JudgeReward("http://127.0.0.1:9/v1", "m", api_key="sk-test").http
    for http, timeout in ((remote, 30.0), (judge, 60.0)):
        assert (http.client.timeout.read, http.retries, http.backoff, http.max_backoff) == (timeout, 3, 0.5, 8.0)
        assert http.slots._initial_value == 8  # the semaphore each request takes a slot of


def test_requests_go_out_concurrently_up_to_the_limit():
    replies = {str(i): f"Score: {i}" for i in range(6)}
    for limit, most in [(2, 2), (6, 6)]:
        # each request held until `limit` are in flight: one more than the limit would show as most
        fake = FakeOpenAI(replies, sleep=0.05, hold=limit)
        with serving_app(fake.app) as url:
            judge = JudgeReward(base_url=url + "/v1", model="m", api_key="JUDGE_TEST_KEY", max_concurrency=limit)
            assert judge("p", list(replies), TASK) == [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]
        assert fake.most == most, (limit, fake.most)


def test_a_500_is_retried_and_a_refusal_is_not():
    fake = FakeOpenAI({"357": "Score: 10"}, fail_first=2)
    with serving_app(fake.app) as url:
        judge = JudgeReward(base_url=url + "/v1/", model="m", api_key="JUDGE_TEST_KEY", backoff=0.01)
        assert judge("p", ["357"], TASK) == [1.0]
        assert judge.take_counters() == {"requests": 1, "retries": 2, "timeouts": 0, "failures": 0, "unparsed": 0}
        fake.fail_first = 100
        judge = JudgeReward(base_url=url + "/v1/chat/completions", model="m", api_key="JUDGE_TEST_KEY",
                            retries=1, backoff=0.01)
        with pytest.raises(RewardRequestError, match=r"failed after 2 tries; the last answered 500: the model is overloaded"):
            judge("p", ["357", "357"], TASK)
        assert judge.take_counters() == {"requests": 2, "retries": 2, "timeouts": 0, "failures": 2, "unparsed": 0}
        n = len(fake.requests)
        judge = JudgeReward(base_url=url + "/v1", model="m", api_key="sk-wrong", backoff=1.0)
        with pytest.raises(RewardRequestError, match=r"was refused \(401\): Incorrect API key provided. Check the "
                                                     r"API key: api_key names an environment variable"):
            judge("p", ["357"], TASK)
        assert len(fake.requests) == n + 1  # not retried


def test_the_parsers():
    assert parse_number("Score: 7") == 0.7
    assert parse_number("Score: 7/10") == 0.7  # the score, not the scale
    assert parse_number("In 3 steps... the answer deserves 8") == 0.8  # no "Score:": the last number
    assert parse_number("Score: 12") == 1.0 and parse_number("Score: -3") == 0.0  # clamped
    assert parse_number("Score: 4", max_score=5) == 0.8
    assert parse_number("<think>Score: 2? no, 9</think>\nScore: 9") == 0.9
    assert parse_number("<think>maybe 3</think> I will not say.") is None
    assert parse_number("no number here") is None
    # a scale without "Score:" was the last number: 7/10 read 10, a 1.0; U+2212 was dropped, .5 read 5
    assert parse_number("I rate it 7/10.") == 0.7 and parse_number("Rating: 3 out of 10") == 0.3
    assert parse_number("Score: \u22123") == 0.0 and parse_number("Score: .5") == 0.05
    assert parse_yes_no("Yes.") == 1.0 and parse_yes_no("no") == 0.0
    assert parse_yes_no("Is it right? No, it is not... yes, it is.") == 1.0  # the last one
    assert parse_yes_no("the sum is 357") is None  # "no" only inside a word does not count: "not", "know"


def test_bad_args_fail_when_built():
    with pytest.raises(ConfigError, match=r"template='\{question\}' has no \{response\}"):
        JudgeReward(base_url="http://127.0.0.1:1/v1", model="m", template="{question}")
    with pytest.raises(ConfigError, match=r"has \['score'\]; it may use \{answer\}, \{max_score\}, \{prompt\}"):
        JudgeReward(base_url="http://127.0.0.1:1/v1", model="m", template="{response} {score}")
    with pytest.raises(ConfigError, match=r"parse='stars': choose one of \['number', 'yes_no'\]"):
        JudgeReward(base_url="http://127.0.0.1:1/v1", model="m", parse="stars")
    with pytest.raises(ConfigError, match=r"base_url='127.0.0.1:8001'"):
        JudgeReward(base_url="127.0.0.1:8001", model="m")
    with pytest.raises(ConfigError, match=r"args has \['temprature'\], which judge does not take"):
        build([{"fn": "judge", "args": {"base_url": "http://x/v1", "model": "m", "temprature": 0}}], "reward_fn")


def test_a_reply_without_text_fails_the_task_instead_of_scoring_0():
    """A reasoning judge out of max_tokens before its answer replies with content null (OpenAI,
    vLLM's reasoning parser), a tool-calling one with content null and tool_calls: each was an
    "unparsed" 0, so a judge cut short on every reply gave every response 0, trained on as real
    rewards. Now the task fails (retried, then counted), saying why; a text without a score is
    still an unparsed 0, as documented."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    def complete(body: dict):
        return {"choices": [{"index": 0, "finish_reason": "length",
                             "message": {"role": "assistant", "content": None, "reasoning_content": "Let me"}}]}

    with serving_app(app) as url:
        judge = JudgeReward(base_url=url + "/v1", model="m", api_key="JUDGE_TEST_KEY", max_tokens=8)
        with pytest.raises(ValueError) as e:
            judge("p", ["357", "358"], TASK)
        assert judge.take_counters() == {"requests": 2, "retries": 0, "timeouts": 0, "failures": 2, "unparsed": 0}
    assert str(e.value) == (f"POST {url}/v1/chat/completions: the judge's reply has no text (content None, "
                            f"finish_reason 'length': it ran out of max_tokens=8 before its answer; raise max_tokens)")
