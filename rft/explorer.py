"""The explorer: a rollout engine plus workflows, turning tasks into experiences.

It holds no state that is not derived from the step number and the weights it was last given:
the tasks of step k and the sampling seed of step k are functions of (seed, k). That is what
makes a resumed run sample exactly what an uninterrupted one would.
"""

from __future__ import annotations

import logging
import random
import time

import torch
from rft.buffer import epoch_batch
from rft.engine import ENGINES
from rft.errors import ConfigError
from rft.models import load_tokenizer
from rft.rewards import REWARD_FNS, overlong_penalty
from rft.tasks import load_tasks
from rft.workflows import WORKFLOWS, WorkflowContext

log = logging.getLogger(__name__)


def _flat(group) -> bool:
    """All rollouts of the group got the same reward: no signal for a group baseline."""
    return len({e.reward for e in group}) == 1


def step_seed(seed: int, step: int, salt: int = 0) -> int:
    return (seed * 1_000_003 + step * 7919 + salt) % (2**31)


class Explorer:
    def __init__(self, cfg, weights_path: str | None = None, version: int = 0):
        self.cfg = cfg
        torch.set_num_threads(cfg.cluster.cpus_per_actor)
        # denormal floats (tiny Adam moments, decayed weights) make CPU math many times slower
        torch.set_flush_denormal(True)
        self.tokenizer = load_tokenizer(cfg.model)
        rollout = cfg.explorer.rollout_model
        self.engine = ENGINES[rollout.engine_type](cfg.model, rollout, self.tokenizer, weights_path)
        inp = cfg.buffer.explorer_input
        self.taskset = load_tasks(inp.taskset, "buffer.explorer_input.taskset")
        self.eval_tasksets = [
            (ts, load_tasks(ts, f"buffer.explorer_input.eval_tasksets[{i}]"))
            for i, ts in enumerate(inp.eval_tasksets)
        ]
        self.version = version  # the trainer step whose weights this explorer serves
        self.workflow = WORKFLOWS["single_turn"]
        log.info("explorer ready: %d tasks, %d eval tasksets", len(self.taskset), len(self.eval_tasksets))

    def tasks_for_step(self, step: int):
        """The batch of tasks for `step`: epoch-wise shuffles of the taskset, seeded by (seed, epoch)."""
        rows = epoch_batch(len(self.taskset), self.cfg.buffer.batch_size, step,
                           lambda epoch: step_seed(self.cfg.seed, epoch, salt=1))
        return [self.taskset[i] for i in rows]

    def _run(self, ts_cfg, tasks, n: int, step: int, salt: int):
        """Run the workflow on `tasks` with the taskset's rollout args and reward function."""
        name = ts_cfg.reward_fn or self.cfg.buffer.explorer_input.default_reward_fn_type
        if name not in REWARD_FNS:
            raise ConfigError(f"reward function {name!r} of taskset {ts_cfg.name!r} is not one of {sorted(REWARD_FNS)}.")
        ctx = WorkflowContext(
            tokenizer=self.tokenizer,
            n=n,
            rollout_args=ts_cfg.rollout_args,
            max_prompt_tokens=self.cfg.model.max_prompt_tokens,
            policy_version=self.version,
            seed=step_seed(self.cfg.seed, step, salt),
            step=step,
            reward_name=name,
        )
        return self.workflow(tasks, self.engine, REWARD_FNS[name], ctx)

    def _rollouts(self, tasks, n: int, step: int, salt: int) -> list[list]:
        """Training rollouts, reward-shaped, as one list per task (a group)."""
        ts, algo = self.cfg.buffer.explorer_input.taskset, self.cfg.algorithm
        exps = self._run(ts, tasks, n, step, salt)
        if algo.overlong_buffer_frac > 0:
            max_len = ts.rollout_args.max_tokens or self.cfg.model.max_response_tokens
            buffer_len = max(1, round(algo.overlong_buffer_frac * max_len))
            for e in exps:
                e.reward += overlong_penalty(e.response_length, max_len, buffer_len, algo.overlong_penalty_factor)
        return [exps[i : i + n] for i in range(0, len(exps), n)]

    def explore(self, step: int):
        t0 = time.perf_counter()
        ts = self.cfg.buffer.explorer_input.taskset
        n = ts.repeat_times or self.cfg.algorithm.repeat_times
        groups = self._rollouts(self.tasks_for_step(step), n, step, salt=0)
        tries = 1
        max_tries = self.cfg.algorithm.dynamic_sampling_max_tries
        if max_tries > 1:
            # DAPO dynamic sampling: groups whose rewards are all equal carry no signal; draw more
            # tasks until the batch is full of groups that do, or the tries run out (then the
            # batch is topped up with flat groups, so its size never changes)
            keep = [g for g in groups if not _flat(g)]
            flat = [g for g in groups if _flat(g)]
            while len(keep) < len(groups) and tries < max_tries:
                extra = random.Random(step_seed(self.cfg.seed, step, salt=100 + tries)).sample(self.taskset, len(groups))
                more = self._rollouts(extra, n, step, salt=100 + tries)
                keep += [g for g in more if not _flat(g)]
                flat += [g for g in more if _flat(g)]
                tries += 1
            groups = (keep + flat)[: len(groups)]
        exps = [e for g in groups for e in g]
        elapsed = time.perf_counter() - t0
        rewards = torch.tensor([e.reward for e in exps])
        lengths = torch.tensor([e.response_length for e in exps], dtype=torch.float32)
        metrics = {
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std().item() if len(exps) > 1 else 0.0,
            "response_length/mean": lengths.mean().item(),
            "response_length/max": lengths.max().item(),
            "rollout/truncated_frac": sum(e.info["finish_reason"] == "length" for e in exps) / len(exps),
            "rollout/tokens_per_s": lengths.sum().item() / max(elapsed, 1e-9),
            "rollout/sampling_tries": tries,
            "rollout/zero_variance_group_frac": sum(map(_flat, groups)) / len(groups),
        }
        return exps, metrics

    def evaluate(self, step: int) -> dict:
        """Mean reward on each eval taskset (`eval/<name>/accuracy`; the first one also as `eval/accuracy`)."""
        metrics = {}
        for i, (ts, tasks) in enumerate(self.eval_tasksets):
            exps = self._run(ts, tasks, ts.repeat_times or 1, step, salt=2)
            acc = sum(e.reward for e in exps) / len(exps)
            metrics[f"eval/{ts.name}/accuracy"] = acc
            if i == 0:
                metrics["eval/accuracy"] = acc
        return metrics

    def update_weights(self, state_dict, version: int, expected_fingerprint: str) -> str:
        self.engine.update_weights(state_dict)
        return self._check(version, expected_fingerprint)

    def load_weights(self, path: str, version: int, expected_fingerprint: str) -> str:
        from safetensors.torch import load_file

        self.engine.update_weights(load_file(path))
        return self._check(version, expected_fingerprint)

    def _check(self, version: int, expected: str) -> str:
        got = self.engine.fingerprint()
        if got != expected:
            raise RuntimeError(
                f"weight sync to version {version} failed: the explorer now serves weights with "
                f"fingerprint {got}, the trainer sent {expected}"
            )
        self.version = version
        return got
