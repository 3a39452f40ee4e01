"""A checkpoint of the study used outside rft: its export loaded with transformers (the merged
model) and its adapter/ with peft (on the base model its adapter_config.json names), each
generating greedily on the held-out words; every answer compared with the one rft's own eval of
that step wrote (<stage>/eval_trajectories/step_N/rev3_test.jsonl).

    python experiments/lora_sweep/outside.py <exported folder> <stage>/checkpoints/step_N \
        <stage>/eval_trajectories/step_N/rev3_test.jsonl experiments/lora_sweep/data/test.jsonl
"""
import json
import sys

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer


def answers(model, tok, rows) -> list[str]:
    out = []
    for r in rows:
        ids = tok.apply_chat_template([{"role": "user", "content": r["question"]}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        with torch.no_grad():
            g = model.generate(**ids, max_new_tokens=6, do_sample=False)
        out.append(tok.decode(g[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
    return out


def main(export: str, ckpt: str, trajectories: str, data: str) -> None:
    tok = AutoTokenizer.from_pretrained(export)
    rows = [json.loads(line) for line in open(data)]
    said = {json.loads(line)["task_id"]: json.loads(line) for line in open(trajectories)}
    rft = [said[f"rev3_test/{i}"]["messages"][-1]["content"] for i in range(len(rows))]
    merged = answers(AutoModelForCausalLM.from_pretrained(export).eval(), tok, rows)
    base = json.load(open(f"{ckpt}/adapter/adapter_config.json"))["base_model_name_or_path"]
    adapted = answers(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), f"{ckpt}/adapter").eval(),
                      tok, rows)
    right = sum(a == r["question"].split()[-1][::-1] for a, r in zip(merged, rows))
    print(f"{len(rows)} prompts: merged == rft's eval {sum(a == b for a, b in zip(merged, rft))}, "
          f"adapter == rft's eval {sum(a == b for a, b in zip(adapted, rft))}; merged right {right} "
          f"({right / len(rows):.3f}), rft's eval accuracy {sum(v['reward'] for v in said.values()) / len(said):.3f}")
    for q, a, b, c in [(r["question"], a, b, c) for r, a, b, c in zip(rows, merged, adapted, rft) if not a == b == c][:10]:
        print(f"differs: {q}: merged {a!r}, adapter {b!r}, rft {c!r}")


if __name__ == "__main__":
    main(*sys.argv[1:5])
