"""Run one RL fine-tuning job: `python run.py [group=option ...] [key=value ...]`.

    python run.py                                  # the embedded default (tiny model, CPU)
    python run.py dry_run=true                     # print the batch plan and exit
    python run.py -m algorithm.optimizer.lr=1e-3,3e-3 seed=1,2    # a sweep
    python run.py -m hydra/launcher=slurm seed=1,2,3               # a sweep on Slurm
"""

import sys
from pathlib import Path

import rft.plan.search_path  # first: a study's random.py or code.py, named before Hydra's imports load it
rft.plan.search_path.exit_on_shadowing(sys.path[0])
import hydra  # noqa: E402
from omegaconf import DictConfig

import rft.config  # registers the typed schema with Hydra's ConfigStore
import rft.plan.overlays
import rft.reporting.sweep

rft.plan.overlays.exit_on_config_mistakes(sys.argv[1:], Path(__file__).parent / "conf")  # bad YAML, misspelt keys
rft.reporting.sweep.install()  # a sweep job that died under Slurm: one paragraph, not a traceback


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    from rft.runtime.main import main as run

    return run(cfg)


if __name__ == "__main__":
    main()
