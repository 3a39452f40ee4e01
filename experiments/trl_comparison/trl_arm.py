"""The TRL arm of the comparison: TRL's GRPOTrainer on rft's warm start, with rft's GRPO settings.

    .venv-trl/bin/python experiments/trl_comparison/trl_arm.py --model DIR --data DIR --out FILE.json \
        [--seed 1] [--steps 30] [--eval-interval 2] [--threads 1] [--prompts 16] [--max-new-tokens 6] \
        [--dtype float32]

Runs in its own venv (benchmark.py makes it): TRL is never a dependency of rft. It imports rft
only for the same data (`rft.data.tasks.load_rows`) and the same reward (`rft.rewards.verifiers.exact_match`).
What is matched with rft's default GRPO stage (conf/algorithm/grpo.yaml, conf/model/tiny.yaml):
16 prompts x 8 completions a step, up to 6 new tokens, temperature 1, one optimizer step per RL
step (so TRL, like rft, skips the "old" log-prob forward), PPO clip 0.2/0.2, no KL, token-mean
loss over the step's 128 completions (TRL's loss_type="dapo" with one process and no
accumulation), group-normalised advantages (unbiased std; TRL adds 1e-4 to the std, rft 1e-6),
AdamW lr 2e-4, betas (0.9, 0.999), weight decay 0.01, constant schedule, grad clip 1.0.
Eval: greedy, up to 6 new tokens, exact match on the 200 held-out problems (what rft's eval does);
--eval-interval 0: none. benchmark.py --shape 0.5b gives --prompts 4 --max-new-tokens 128 --dtype
bfloat16 (the weights, gradients and AdamW states in bfloat16, as rft's trainer holds them with
model.dtype=bfloat16: no autocast, no float32 master copy).

Writes JSON: per step {step, step_s, generate_s, score_s, eval_accuracy (on eval steps)}; eval
time is measured apart and left out of step_s, as rft's timing/step_s leaves it out.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the warm start (an HF directory)")
    ap.add_argument("--data", required=True, help="the arithmetic task's dataset directory")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--eval-interval", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=16, help="prompts a step (8 completions each)")
    ap.add_argument("--max-new-tokens", type=int, default=6)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # as rft's actors do: tiny Adam moments are denormal on CPU
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rft.rewards.verifiers import exact_match
    from rft.data.tasks import load_rows

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))

    def prompts(split):
        rows = load_rows(args.data, split)
        return [{"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"]} for r in rows]

    train = Dataset.from_list(prompts("train"))
    test = prompts("test")

    class _Task:  # what rft's reward functions read
        def __init__(self, answer):
            self.answer = answer

    def reward(completions, answer, **kw):
        return [exact_match("", c[0]["content"], _Task(a)) for c, a in zip(completions, answer)]

    @torch.no_grad()
    def evaluate() -> float:
        was_training = model.training
        model.eval()
        ids = [tok.apply_chat_template(t["prompt"], tokenize=True, add_generation_prompt=True) for t in test]
        ids = [i["input_ids"] if hasattr(i, "keys") else i for i in ids]
        L = max(len(i) for i in ids)
        x = torch.full((len(ids), L), tok.pad_token_id)
        mask = torch.zeros((len(ids), L), dtype=torch.long)
        for r, i in enumerate(ids):  # left padding, as rft's engine does
            x[r, L - len(i):], mask[r, L - len(i):] = torch.tensor(i), 1
        out = model.generate(input_ids=x, attention_mask=mask, do_sample=False, max_new_tokens=6,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        texts = tok.batch_decode(out[:, L:], skip_special_tokens=True)
        model.train(was_training)
        return sum(exact_match("", s, _Task(t["answer"])) for s, t in zip(texts, test)) / len(test)

    config = GRPOConfig(
        output_dir=os.path.join(os.path.dirname(os.path.abspath(args.out)), "trl_out"),
        use_cpu=True, bf16=False, fp16=False, seed=args.seed, data_seed=args.seed,
        max_steps=args.steps, per_device_train_batch_size=8 * args.prompts, gradient_accumulation_steps=1,
        num_generations=8, steps_per_generation=1, num_iterations=1, max_completion_length=args.max_new_tokens,
        temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=2e-4, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.01,
        adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0,
        beta=0.0, epsilon=0.2, epsilon_high=0.2, loss_type="dapo", scale_rewards="group",
        mask_truncated_completions=False, gradient_checkpointing=False, disable_dropout=True,
        logging_steps=1, report_to="none", save_strategy="no", dataloader_num_workers=0,
        log_completions=False,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=train, processing_class=tok)

    records: list[dict] = []
    clock = {"generate_s": 0.0, "score_s": 0.0}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                clock[name] += time.perf_counter() - t0
        return wrapper

    # generate: the engine call; score: generation plus rewards, advantages and tokenising
    trainer._generate_single_turn = timed("generate_s", trainer._generate_single_turn)
    trainer._generate_and_score_completions = timed("score_s", trainer._generate_and_score_completions)

    class Timing(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            clock.update(generate_s=0.0, score_s=0.0, t0=time.perf_counter())

        def on_step_end(self, a, state, control, **kw):
            rec = {"step": state.global_step, "step_s": time.perf_counter() - clock["t0"],
                   "generate_s": clock["generate_s"], "score_s": clock["score_s"]}
            if args.eval_interval and (state.global_step % args.eval_interval == 0 or state.global_step == args.steps):
                rec["eval_accuracy"] = evaluate()
            records.append(rec)

    trainer.add_callback(Timing())
    start = evaluate() if args.eval_interval else None
    trainer.train()
    with open(args.out, "w") as f:
        json.dump({"start_accuracy": start, "steps": records}, f)


if __name__ == "__main__":
    main()
