"""Rollout engines: `generate(prompts, n, args, seed) -> samples` and weight updates.

`hf` (transformers `generate`, batched with a KV cache) is the CPU default. Every engine returns,
for each prompt, `n` samples of response token ids, the log-prob of each token under the
sampling distribution (after temperature/top-p/top-k), and a finish reason.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import torch

from rft.models import load_model


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (end of sequence) or "length" (hit max_tokens)


def fingerprint(state_dict: dict[str, torch.Tensor]) -> str:
    """A short hash of the weights, identical on both sides of a sync iff the weights are.

    It hashes each tensor's float64 sum and sum of squares: cheap for large models, and any
    realistic corruption (a missing, stale or garbled tensor) changes it.
    """
    h = hashlib.sha1()
    for name in sorted(state_dict):
        t = state_dict[name].detach().to(torch.float64)
        h.update(f"{name}:{t.sum().item():.17g}:{(t * t).sum().item():.17g}".encode())
    return h.hexdigest()[:16]


class HFEngine:
    """transformers `generate` on the local device."""

    def __init__(self, model_cfg, rollout_cfg, tokenizer, path: str | None = None):
        self.model = load_model(model_cfg, path)
        self.tokenizer = tokenizer
        self.batch_size = rollout_cfg.generate_batch_size
        self.max_response_tokens = model_cfg.max_response_tokens
        self.busy_s = 0.0  # seconds spent generating (the runtime benchmark's "model compute")

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, args, seed: int) -> list[list[Sample]]:
        t0 = time.perf_counter()
        try:
            return self._generate(prompts, n, args, seed)
        finally:
            self.busy_s += time.perf_counter() - t0

    def _generate(self, prompts: list[list[int]], n: int, args, seed: int) -> list[list[Sample]]:
        flat = [p for p in prompts for _ in range(n)]
        samples: list[Sample] = []
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            for start in range(0, len(flat), self.batch_size):
                samples += self._generate_chunk(flat[start : start + self.batch_size], args)
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _generate_chunk(self, prompts: list[list[int]], args) -> list[Sample]:
        tok = self.tokenizer
        L = max(len(p) for p in prompts)
        # left padding: every prompt ends at the same position, where generation starts
        input_ids = torch.full((len(prompts), L), tok.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), L), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, L - len(p) :] = torch.tensor(p)
            attention_mask[i, L - len(p) :] = 1
        greedy = args.temperature == 0
        sampling = {} if greedy else dict(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k if args.top_k > 0 else None,
        )
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=not greedy,
            max_new_tokens=args.max_tokens or self.max_response_tokens,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            output_scores=True,
            return_dict_in_generate=True,
            **sampling,
        )
        # scores are the processed logits the sampler drew from: their log-softmax is the
        # sampling distribution's log-prob
        logprobs = self.model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
        new_tokens = out.sequences[:, L:]
        result = []
        for i in range(len(prompts)):
            ids = new_tokens[i].tolist()
            if tok.eos_token_id in ids:
                end, reason = ids.index(tok.eos_token_id) + 1, "stop"
            else:
                end, reason = len(ids), "length"
            result.append(Sample(ids[:end], logprobs[i, :end].tolist(), reason))
        return result

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state_dict, strict=True)

    def fingerprint(self) -> str:
        return fingerprint(self.model.state_dict())


ENGINES = {"hf": HFEngine}
