"""Reward models served on a worker of their own: the served reward `fn: reward_model`.

    buffer.explorer_input.taskset.reward_fn:
      - {fn: exact_match, weight: 1.0}
      - {fn: reward_model, weight: 0.5, args: {model_path: <local dir or hub id>, kind: classifier}}

`args` (every one but model_path has a default; `worker_args` checks them):
    model_path     a Hugging Face model: a local directory or a hub id
    kind           classifier: AutoModelForSequenceClassification. With num_labels 1 the score is
                   its logit (a Bradley-Terry reward model's scalar); with num_labels 2 it is the
                   probability of label 1 (softmax over the two logits), in [0, 1]; any other
                   number of labels is a ConfigError.
                   yes_no: AutoModelForCausalLM as a judge. The score is p(yes) / (p(yes) + p(no)),
                   from the next-token logits after the filled-in template, of the tokens of
                   `yes_token` and `no_token` (each must be a single token: a ConfigError otherwise).
    template       the text the model reads, a format string of {prompt} {response} {answer}
                   (`task.answer`; "" without one). classifier: "{prompt}{response}" (the policy's
                   prompt as decoded, then the response); yes_no: DEFAULT_JUDGE_TEMPLATE.
    chat_template  true: the reward model's own chat template, on the task's question (the last
                   user message of the task, not the policy's templated prompt) as {prompt}.
                   classifier: [user: question, assistant: response] (no `template` then);
                   yes_no: [user: the filled-in template] plus the generation prompt.
    yes_token, no_token   default " yes" / " no" (the token after "...yes or no:"), or "Yes" / "No"
                   with chat_template (the first token of the assistant's answer)
    batch_size     responses per forward pass (default 8)
    max_length     tokens the model reads at most; a longer text keeps its end (null: all)
    dtype          null: float32 on CPU, the checkpoint's own dtype on GPU; or a model.dtype name
    num_cpus, colocate    where the worker runs (below)

Where it runs. With Ray (cluster=local|ray) the runner starts, before the explorers, one Ray actor
per distinct `args` among the reward configs the stage's explorers use (`rft.plan.placement.reward_models`).
Its name is `worker_name(args)` (reward_model_<model dir name>_<hash of the args>), in the run's Ray
namespace (`rft.runtime.main.ray_namespace`, which every actor of the run shares), so each explorer's
`RewardModelReward`, built from the same args, finds it. It is placed like an engine: a bundle of
its own in the stage's placement group (CPU: `num_cpus`, default 1; GPU: one GPU, taken from those
the trainer would get), or, with `colocate: true`, a share of bundle 0 (the trainer's, or the
first explorer's): the actors there split it evenly; with cluster.colocate=true it is one more actor
sharing the one bundle. It computes on the GPU Ray gives it (cuda:0), else on CPU. A worker that
does not load is a ConfigError naming the key and the path; the runner kills the workers when the
stage ends.

Batching. The explorer scores a group (one task's n responses) per call, from several runner
threads at once; each call is one `score` on the worker, the group's responses as one batch (in
chunks of `batch_size`). The actor runs one call at a time (max_concurrency 1: one model, one
device), so concurrent groups queue there. Groups are not merged into larger batches on purpose:
a score depends, in its last float bits, on what it was padded and batched with, so merging
whatever groups happen to arrive together would make rewards depend on thread timing, and a
resumed run would no longer repeat an uninterrupted one exactly. A group's batch depends only on
the group. Padding: a classifier's batch is padded on the right, and the model pools at the last
token that is not its config's pad_token_id (set to the id it is padded with); a judge's on the
left, with position ids that count real tokens only, and reads the logits of the last position.
Either way a text scores as it would alone, to float rounding (tests/test_reward_model.py).

Without Ray (cluster=inline, mode=bench) the client builds the worker in its own process, once per
process for the same args, shared by the explorer's threads one call at a time (a lock).
"""

from __future__ import annotations

import logging
import os
import sys
import threading

from rft.errors import ConfigError

# a part's args are checked when planning, without torch: rft/rewards/scoring.py
from rft.rewards.scoring import PLACEMENT_ARGS, worker_args, worker_name

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- the worker

def _load_dtype(dtype: str | None, device):
    """The dtype to load in: `dtype` (a model.dtype name) when given, else float32 on CPU and the
    checkpoint's own on GPU (the module docstring's `dtype`)."""
    import torch

    if dtype is not None:
        from rft.models import torch_dtype

        return torch_dtype(dtype)
    return torch.float32 if device.type == "cpu" else "auto"


def _load_model(model_path: str, kind: str, load_dtype):
    """(tokenizer, model) of a reward model; a ConfigError naming the path and the kind when it
    does not load (the bare error would not say which reward part's args to fix)."""
    from rft.models import _quiet_transformers

    _quiet_transformers()
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    path = os.path.expanduser(model_path)
    Auto = AutoModelForSequenceClassification if kind == "classifier" else AutoModelForCausalLM
    try:
        return AutoTokenizer.from_pretrained(path), Auto.from_pretrained(path, dtype=load_dtype)
    except Exception as e:  # OSError (no such dir or hub id), ValueError (not that kind of model), ...
        first = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError(
            f"reward model model_path={model_path!r} could not be loaded as kind={kind} ({Auto.__name__}: "
            f"{type(e).__name__}: {first}). Give a local directory in Hugging Face format (relative paths "
            f"are relative to {os.getcwd()}) or a hub id this machine can reach."
        ) from e


def _check_tokenizer(tok, model_path: str, chat_template: bool) -> None:
    """The tokenizer can pad a batch and cut a long text at its start; with chat_template, it has one."""
    if tok.pad_token_id is None:
        if tok.eos_token is None:
            raise ConfigError(f"reward model {model_path!r}: its tokenizer has neither a pad nor an eos token to pad with.")
        tok.pad_token = tok.eos_token
    tok.truncation_side = "left"  # a long text keeps its end: the response, the question to the judge
    if chat_template and not tok.chat_template:
        raise ConfigError(f"chat_template=true, but the reward model {model_path!r} has no chat template.")


def _pad_classifier(tok, model, model_path: str) -> int:
    """A classifier's number of labels (1 or 2, else a ConfigError), its batches padded on the right."""
    num_labels = model.config.num_labels
    if num_labels not in (1, 2):
        raise ConfigError(
            f"reward model {model_path!r} has num_labels={num_labels}; kind=classifier takes 1 (the score "
            f"is the logit) or 2 (the score is the probability of label 1)."
        )
    # right padding; the model pools at the last token that is not pad_token_id, so the
    # model must know the id it is padded with
    tok.padding_side = "right"
    model.config.pad_token_id = tok.pad_token_id
    text_config = model.config.get_text_config()
    if text_config is not model.config:
        text_config.pad_token_id = tok.pad_token_id
    return num_labels


class RewardModelWorker:
    """A reward model in eval mode on one device; `score(prompts, responses, answers)` in batches.

    `device`: null takes cuda:0 when this process sees a GPU (a Ray actor sees only the GPUs it
    was given), else the CPU.
    """

    def __init__(self, model_path: str, kind: str = "classifier", batch_size: int = 8, template: str | None = None,
                 yes_token: str | None = None, no_token: str | None = None, chat_template: bool = False,
                 max_length: int | None = None, dtype: str | None = None, device: str | None = None):
        import torch

        a = worker_args(model_path, kind, batch_size, template, yes_token, no_token, chat_template, max_length, dtype)
        self.args = a
        self.kind, self.batch_size, self.template = kind, a["batch_size"], a["template"]
        self.chat_template, self.max_length = chat_template, max_length
        self.device = torch.device(device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
        self.tokenizer, self.model = _load_model(model_path, kind, _load_dtype(dtype, self.device))
        tok = self.tokenizer
        _check_tokenizer(tok, model_path, chat_template)
        if kind == "classifier":
            self.num_labels = _pad_classifier(tok, self.model, model_path)
        else:
            tok.padding_side = "left"  # the last real token is the last position of every row
            self.yes_id = self._single_token("yes_token", a["yes_token"])
            self.no_id = self._single_token("no_token", a["no_token"])
        self.model.to(self.device)
        self.model.eval()
        log.info("reward model %s (%s) on %s, process %d", model_path, kind, self.device, os.getpid())

    def _single_token(self, key: str, text: str) -> int:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1:
            return ids[0]
        word = "yes" if key == "yes_token" else "no"
        single = [s for s in (f" {word}", word, f" {word.title()}", word.title())
                  if len(self.tokenizer.encode(s, add_special_tokens=False)) == 1]
        pieces = [self.tokenizer.decode([i]) for i in ids]  # the text of each: a byte-level vocabulary's 'Ġ' is ' '
        raise ConfigError(
            f"{key}={text!r} is {len(ids)} tokens {pieces} for the reward model "
            f"{self.args['model_path']!r}; kind=yes_no reads the probability of one next token, so give a "
            f"string that is a single token of its tokenizer"
            + (f" (single tokens here: {single})." if single else ".")
        )

    def info(self) -> dict:
        return {"pid": os.getpid(), "device": str(self.device), "kind": self.kind, "model_path": self.args["model_path"]}

    def ping(self) -> int:
        return os.getpid()

    def texts(self, prompts: list[str], responses: list[str], answers: list[str]) -> list[str]:
        """What the model reads for each response."""
        tok, out = self.tokenizer, []
        for p, r, a in zip(prompts, responses, answers):
            if self.kind == "classifier" and self.chat_template:
                text = tok.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": r}],
                                               tokenize=False)
            else:
                text = self.template.format(prompt=p, response=r, answer=a)
                if self.chat_template:  # yes_no
                    text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                   add_generation_prompt=True)
            out.append(text)
        return out

    def score(self, prompts: list[str], responses: list[str], answers: list[str] | None = None) -> list[float]:
        """One score per response, in chunks of batch_size."""
        import torch

        if not (len(prompts) == len(responses) and (answers is None or len(answers) == len(responses))):
            raise ValueError(f"score: {len(prompts)} prompts, {len(responses)} responses, "
                             f"{len(answers) if answers is not None else 'no'} answers")
        answers = [""] * len(responses) if answers is None else ["" if a is None else str(a) for a in answers]
        texts = self.texts(prompts, responses, answers)
        out: list[float] = []
        with torch.no_grad():
            for i in range(0, len(texts), self.batch_size):
                out += self._forward(texts[i : i + self.batch_size])
        return out

    def _forward(self, texts: list[str]) -> list[float]:
        import torch

        enc = self.tokenizer(texts, padding=True, truncation=self.max_length is not None, max_length=self.max_length,
                             add_special_tokens=not self.chat_template, return_tensors="pt")
        ids, mask = enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)
        if self.kind == "classifier":
            logits = self.model(input_ids=ids, attention_mask=mask).logits.float()  # [n, num_labels]
            scores = logits[:, 0] if self.num_labels == 1 else torch.softmax(logits, dim=-1)[:, 1]
            return scores.tolist()
        # left padded: positions count real tokens only, so a row reads as it would alone
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        try:
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids, logits_to_keep=1).logits
        except TypeError:  # a model without logits_to_keep
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits
        last = logits[:, -1].float()
        pair = torch.stack([last[:, self.yes_id], last[:, self.no_id]], dim=-1)
        return torch.softmax(pair, dim=-1)[:, 0].tolist()  # p(yes) / (p(yes) + p(no))


def start_worker(args: dict, device: str | None = None) -> RewardModelWorker:
    """The worker for filled-in `args` (what the runner's Ray actor builds)."""
    return RewardModelWorker(device=device, **{k: v for k, v in args.items() if k not in PLACEMENT_ARGS})


_LOCAL: dict[str, tuple[RewardModelWorker, threading.Lock]] = {}
_LOCAL_LOCK = threading.Lock()


def local_worker(args: dict) -> tuple[RewardModelWorker, threading.Lock]:
    """This process's worker for `args` (built on first use) and the lock its callers take."""
    name = worker_name(args)
    with _LOCAL_LOCK:
        if name not in _LOCAL:
            _LOCAL[name] = (start_worker(args), threading.Lock())
        return _LOCAL[name]


def _in_ray_actor() -> bool:
    """True inside a Ray actor (an explorer of cluster=local|ray), where the runner started the worker."""
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


# ---------------------------------------------------------------- the client (rft.rewards.scoring.REWARD_CLIENTS)

class RewardModelReward:
    """The served reward `reward_model`: built once per explorer from the part's args (see the
    module docstring); `client(prompt, responses, task)` scores one group."""

    def __init__(self, model_path: str, kind: str = "classifier", batch_size: int = 8, template: str | None = None,
                 yes_token: str | None = None, no_token: str | None = None, chat_template: bool = False,
                 max_length: int | None = None, dtype: str | None = None, num_cpus: int | None = None,
                 colocate: bool = False):
        self.args = worker_args(model_path, kind, batch_size, template, yes_token, no_token, chat_template,
                                max_length, dtype, num_cpus, colocate)
        self.name = worker_name(self.args)
        self._lock = threading.Lock()
        self._failures = 0
        self._actor = None
        # in this process: built now, so a model that does not load stops the run before it starts
        self._local = None if _in_ray_actor() else local_worker(self.args)

    def _remote(self):
        """The runner's Ray actor for these args, found by name in this run's namespace."""
        with self._lock:
            if self._actor is None:
                import ray

                namespace = ray.get_runtime_context().namespace
                try:
                    self._actor = ray.get_actor(self.name, namespace=namespace)
                except ValueError:
                    raise RuntimeError(
                        f"no reward model worker {self.name!r} in the Ray namespace {namespace!r}. The runner "
                        f"(rft/runtime/runner.py) starts one for each reward_model part of the reward configs its "
                        f"explorers use; a scorer built in some other Ray actor has none."
                    ) from None
            return self._actor

    def __call__(self, prompt: str, responses: list[str], task) -> list[float]:
        if not responses:
            return []
        n = len(responses)
        question = _question(task, prompt) if self.args["chat_template"] else prompt
        answer = getattr(task, "answer", None)
        args = ([question] * n, list(responses), ["" if answer is None else str(answer)] * n)
        try:
            if self._local is not None:
                worker, lock = self._local
                with lock:
                    return worker.score(*args)
            import ray

            return ray.get(self._remote().run.remote("score", *args))
        except Exception as e:
            with self._lock:
                self._failures += 1
            if self._local is None and _actor_died(e):
                raise self._died(e) from None
            raise

    def _died(self, e: Exception) -> RuntimeError:
        """The worker's process died: one line naming it, its model and its log (Ray's own error is a
        dozen lines naming neither the reward part nor where to look)."""
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
        return WorkerDied(
            self.name, self.args["model_path"],
            f"the reward model worker {self.name} (model_path {self.args['model_path']!r}) died: "
            f"{type(e).__name__}: {first} Ray restarts it up to cluster.max_actor_restarts times (the task is "
            f"retried meanwhile, explorer.max_retry_times); why it died is in its log, <stage>/log/{self.name}.log "
            f"(or the system's, for the OOM killer)."
        )

    def take_counters(self) -> dict:
        """Calls that raised since the last take (each is retried, then its task fails)."""
        with self._lock:
            n, self._failures = self._failures, 0
        return {"failures": n}


class WorkerDied(RuntimeError):
    """A reward model's worker process died. Its `failure_source` tells the run's last message
    (rft.runtime.faults.culprit, when every task failed) that the reward model failed, not the
    reward function: ("reward_model", the worker's name, its model_path)."""

    def __init__(self, name: str, model_path: str, text: str):
        super().__init__(text)
        self.failure_source = ("reward_model", name, model_path)

    def __reduce__(self):  # its three arguments, not RuntimeError's one
        return type(self), (*self.failure_source[1:], str(self))


def _actor_died(e: Exception) -> bool:
    """Ray's error for an actor whose process died (or is being restarted); ray is imported already
    where one can be raised."""
    exceptions = sys.modules.get("ray.exceptions")
    return exceptions is not None and isinstance(e, exceptions.RayActorError)


def _question(task, prompt: str) -> str:
    """The task's question: its last user message (the policy's prompt without its chat template)."""
    for m in reversed(getattr(task, "messages", None) or []):
        if m.get("role") == "user":
            return m.get("content", "")
    return prompt
