"""Metrics: a progress bar on the console, metrics.jsonl always, TensorBoard and wandb on request."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tqdm import tqdm


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Monitor:
    def __init__(self, cfg, run_dir: Path, total_steps: int, start_step: int, stage: str):
        self.keys = list(cfg.monitor.console_keys)
        self.path = run_dir / "metrics.jsonl"
        # a resumed run rewrites the steps after its checkpoint: drop what the killed run logged
        self.file = _reopen(self.path, start_step)
        # what each step trained on: group ids, policy versions and a digest of the tokens
        self.batches = _reopen(run_dir / "batches.jsonl", start_step)
        self.bar = tqdm(total=total_steps, initial=start_step, desc=stage, dynamic_ncols=True, leave=True)
        self.shown: dict[str, float] = {}
        self.tb = None
        if "tensorboard" in cfg.monitor.monitor_type:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step + 1)
        self.wandb = None
        if "wandb" in cfg.monitor.monitor_type:
            import wandb

            self.wandb = wandb.init(
                project=cfg.project, name=f"{cfg.name}/{stage}", dir=str(run_dir),
                config={"stage": stage}, resume="allow", id=_wandb_id(run_dir),
            )

    def log(self, step: int, metrics: dict, advance: bool = True) -> None:
        record = {"step": step, **metrics}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        self.shown.update({k: metrics[k] for k in self.keys if k in metrics})
        self.bar.set_postfix({k.replace("/", "."): f"{v:.3g}" for k, v in self.shown.items()}, refresh=False)
        if advance:
            self.bar.update(step - self.bar.n)

    def record_batch(self, step: int, exps: list) -> None:
        import hashlib

        digest = hashlib.sha1(json.dumps([[e.tokens, e.reward] for e in exps]).encode()).hexdigest()[:16]
        record = {"step": step, "groups": sorted({e.group_id for e in exps}),
                  "versions": sorted(e.policy_version for e in exps), "digest": digest}
        self.batches.write(json.dumps(record) + "\n")
        self.batches.flush()

    def histogram(self, step: int, name: str, values: list) -> None:
        if self.tb is not None and values:
            import torch

            self.tb.add_histogram(name, torch.tensor(values, dtype=torch.float32), step)

    def print(self, text: str) -> None:
        self.bar.write(text)

    def close(self) -> None:
        self.bar.close()
        self.file.close()
        self.batches.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _reopen(path: Path, start_step: int):
    """Open a per-step JSONL log for appending; a resumed run drops what the killed run logged
    after its checkpoint (those steps are run again)."""
    kept = [m for m in read_metrics(path) if m["step"] <= start_step]
    path.write_text("".join(json.dumps(m) + "\n" for m in kept))
    return open(path, "a")


def _wandb_id(run_dir: Path) -> str:
    import hashlib

    return hashlib.sha1(os.fspath(run_dir.resolve()).encode()).hexdigest()[:12]
