"""Peak memory of the HF engine's generate for one explore step, against response length, before
and after it stopped keeping every step's scores, beside the theoretical floor.

    .venv/bin/python experiments/engine_memory/benchmark.py [--rows 32] [--lengths 32 128 512 1024]
        [--shapes tiny 0.5b] [--arms kept-scores untrimmed stock-cache sampled]

One explore step's generate: `rows` samples (rows / 8 prompts of the arithmetic task, 8 samples
each, as buffer.batch_size=4 algorithm.repeat_times=8), temperature 1, every row running the whole
`length` (the engine's tokenizer is handed an end-of-text id the model cannot sample). Shapes:
`tiny` (model=tiny, 0.5M parameters, vocabulary 100) and `0.5b` (model=qwen2.5-0.5b-shape:
Qwen2.5-0.5B's architecture, random weights, vocabulary 151,936, bfloat16). Arms:

    kept-scores  every step's processed [rows, vocabulary] float32 scores kept to the end and
                 normalised by compute_transition_scores (what generate(output_scores=True) did)
    untrimmed    the engine now without TrimHeap: the C heap never trimmed
    stock-cache  the engine now with transformers' own attention and cache: sdpa repeating each
                 key/value head for its query heads, DynamicLayer concatenating every step
    sampled      the engine now: each token drawn, and its log-prob recorded, one step at a
                 time and in place of the step's scores (DrawOne), grouped-query attention
                 without repeated heads (sdpa_grouped), the KV cache reserved in one block and
                 written in place (reserve, ReservedLayer), glibc's free pages handed back
                 every 16 decode steps (TrimHeap); all in rft.rollout.engines.hf

Each (shape, arm, length) runs in a fresh process: the engine is built and warmed up (a 2-token
generate), then the process's peak resident set is reset (/proc/self/clear_refs) and the step's
generate runs. `step MB` is the peak during it over the resident set just before (the weights and
the libraries are in both); `floor MB` is what the step must hold: the KV cache of rows x (prompt +
length) tokens. A kept-scores run whose scores alone would not fit in 60% of the memory available
is skipped, with its predicted size. No assertion on time: figures are printed, not tested.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MODELS = {"tiny": "model=tiny", "0.5b": "model=qwen2.5-0.5b-shape"}
SAMPLES = 8  # per prompt (algorithm.repeat_times)
ARMS = ["kept-scores", "untrimmed", "stock-cache", "sampled"]


def kv_bytes(config, rows: int, tokens: int, dtype_bytes: int) -> int:
    """The KV cache of `rows` x `tokens`: per layer a key and a value of kv_heads x head_dim."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * dtype_bytes * rows * tokens


def kept_scores_bytes(rows: int, length: int, vocab: int) -> int:
    """What the kept-scores engine holds at its end: every step's float32 scores, and
    compute_transition_scores' stacked copy and its log-softmax (three [rows, vocab, length])."""
    return 3 * rows * length * vocab * 4


def untrimmed_engine():
    """The engine now, without its TrimHeap (untrimmed arm): glibc keeps what freed tensors leave."""
    from rft.rollout.engines.hf import HFEngine

    class UntrimmedEngine(HFEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._trim = []

    return UntrimmedEngine


def stock_cache_engine():
    """The engine now with transformers' sdpa and DynamicLayer (stock-cache arm). Patches
    rft.rollout.engines.hf.reserve: for the benchmark's own process (--one) only."""
    from rft.rollout.engines import hf

    hf.reserve = lambda cache, capacity: None

    class StockCacheEngine(hf.HFEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.model.set_attn_implementation("sdpa")

    return StockCacheEngine


def kept_scores_engine():
    """The engine before (kept-scores arm): every step's processed scores kept until the end and
    normalised by compute_transition_scores, as generate's output_scores did. Its tokens are drawn
    as the engine draws them (hf.DrawOne, after the scores are kept), so the test compares the
    log-probs of the same tokens."""
    import torch
    from transformers import LogitsProcessorList

    from rft.rollout.engines.hf import DrawOne, StopStrings, cache_keyword, warpers

    class Keep:  # a logits processor holding on to each step's scores (what output_scores holds)
        def __init__(self):
            self.scores = []

        def __call__(self, input_ids, scores):
            # a copy: DrawOne overwrites the scores in place (output_scores kept a tensor per step too)
            self.scores.append(scores.clone())
            return scores

    class KeptScoresEngine(untrimmed_engine()):
        def _generate_chunk(self, groups, n, args):
            tok = self.tokenizer
            L = max(len(p) for p in groups)
            input_ids = torch.tensor([[tok.pad_token_id] * (L - len(p)) + p for p in groups])
            attention_mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in groups])
            max_new = args.max_tokens or self.max_response_tokens
            cache = self._prefill(input_ids, attention_mask, n, max_new)
            prompts = [p for p in groups for _ in range(n)]
            keep, greedy = Keep(), args.temperature == 0
            stops = StopStrings(tok, prompts, args.stop, L) if args.stop else None
            sequences = self.model.generate(
                input_ids=input_ids.repeat_interleave(n, 0), attention_mask=attention_mask.repeat_interleave(n, 0),
                **{cache_keyword(self.model): cache}, do_sample=False, max_new_tokens=max_new,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, stopping_criteria=[stops] if stops else None,
                logits_processor=LogitsProcessorList([keep] if greedy else warpers(args) + [keep, DrawOne()]))
            self.scores = (sequences, keep.scores)  # the test compares against them
            logprobs = self.model.compute_transition_scores(sequences, tuple(keep.scores), normalize_logits=True)
            return self._samples(prompts, sequences[:, L:], logprobs, stops)

    return KeptScoresEngine


class NeverEnds:
    """The tokenizer, with an end-of-text id past the vocabulary: every row runs its whole length."""

    def __init__(self, tokenizer, vocab: int):
        self._tok, self.eos_token_id = tokenizer, vocab

    def __getattr__(self, name):
        return getattr(self._tok, name)


def _rss_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(shape: str, arm: str, length: int, rows: int) -> dict:
    """One (shape, arm, length), in this fresh process."""
    import torch
    from hydra import compose, initialize_config_dir

    import rft.config  # noqa: F401  (registers the schema)
    from rft.data.readers import encode_prompt
    from rft.models import ensure_model, load_tokenizer
    from rft.rollout.engines.hf import HFEngine

    torch.set_num_threads(os.cpu_count() or 1)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        model_cfg = compose("config", overrides=[MODELS[shape]]).model
    ensure_model(model_cfg)
    tok = load_tokenizer(model_cfg)
    cls = {"sampled": lambda: HFEngine, "untrimmed": untrimmed_engine, "stock-cache": stock_cache_engine,
           "kept-scores": kept_scores_engine}[arm]()
    engine = cls(model_cfg, SimpleNamespace(generate_batch_size=rows), tok)
    config = engine.model.config
    engine.tokenizer = NeverEnds(tok, config.vocab_size)
    rng = random.Random(0)
    prompts = [encode_prompt(tok, [{"role": "user", "content": f"{rng.randrange(10**4)}+{rng.randrange(10**4)}"}], 64)
               for _ in range(rows // SAMPLES)]
    args = lambda m: SimpleNamespace(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=m, stop=[])  # noqa: E731
    engine.generate(prompts, SAMPLES, args(2), seed=0)  # warm-up: lazy initialisation, the allocator's pools
    gc.collect()
    before = _rss_mb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM, the peak resident set
    t0 = time.perf_counter()
    out = engine.generate(prompts, SAMPLES, args(length), seed=1)
    seconds = time.perf_counter() - t0
    peak = _rss_mb("VmHWM")
    tokens = [len(s.token_ids) for g in out for s in g]
    prompt = max(len(p) for p in prompts)
    dtype_bytes = next(engine.model.parameters()).element_size()
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    return dict(shape=shape, arm=arm, length=length, rows=rows, new_tokens=sum(tokens) / len(tokens),
                before_mb=before, peak_mb=peak, step_mb=peak - before, seconds=seconds,
                weights_mb=weights / 2**20, kv_mb=kv_bytes(config, rows, prompt + length, dtype_bytes) / 2**20,
                kept_mb=kept_scores_bytes(rows, length, config.vocab_size) / 2**20)


def _available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("inf")


VOCAB = {"tiny": 100, "0.5b": 151936}


def run(shape: str, arm: str, length: int, rows: int) -> dict:
    predicted = kept_scores_bytes(rows, length, VOCAB[shape]) / 2**20
    if arm == "kept-scores" and predicted > 0.6 * _available_mb():
        return dict(shape=shape, arm=arm, length=length, rows=rows, skipped=f"scores alone ~{predicted / 1024:.0f} GB")
    cmd = [sys.executable, __file__, "--one", shape, arm, str(length), str(rows)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        return dict(shape=shape, arm=arm, length=length, rows=rows, skipped=f"exit {done.returncode}: {done.stderr[-300:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: list[dict]) -> str:
    lines = ["| shape | arm | response tokens | step MB (peak over before) | floor: KV cache MB | step / floor | "
             "weights MB | peak RSS MB | s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['shape']} | {r['arm']} | {r['length']} | skipped: {r['skipped']} | | | | | |")
            continue
        lines.append(f"| {r['shape']} | {r['arm']} | {r['length']} | {r['step_mb']:.0f} | {r['kv_mb']:.0f} | "
                     f"{r['step_mb'] / r['kv_mb']:.2f} | {r['weights_mb']:.0f} | {r['peak_mb']:.0f} | {r['seconds']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 512, 1024])
    ap.add_argument("--shapes", nargs="+", default=["tiny", "0.5b"], choices=sorted(MODELS))
    ap.add_argument("--arms", nargs="+", default=ARMS, choices=ARMS)
    ap.add_argument("--one", nargs=4, metavar=("SHAPE", "ARM", "LENGTH", "ROWS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        shape, arm, length, rows = a.one
        print(json.dumps(measure(shape, arm, int(length), int(rows))))
        return
    results = []
    for shape in a.shapes:
        for length in a.lengths:
            for arm in a.arms:
                results.append(run(shape, arm, length, a.rows))
                print(json.dumps(results[-1]), flush=True)
    print(table(results))


if __name__ == "__main__":
    main()
