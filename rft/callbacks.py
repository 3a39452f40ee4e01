"""Hydra callbacks (conf/config.yaml, hydra.callbacks): checks of what Hydra does itself before
rft runs, which would otherwise end in its traceback or after work was done.

- a run's directory (hydra.run.dir, under checkpoint_root_dir) or a sweep's (hydra.sweep.dir)
  that cannot be written: Hydra makes it before rft runs, so a checkpoint_root_dir under a file
  or in a read-only place raised NotADirectoryError or PermissionError from Hydra's mkdir (and a
  name of '..' parts made a directory outside the project's);
- a sweep whose job cannot plan (`-m buffer.batch_size=4,0`): every job is planned before the
  first starts (rft.sweep.plan_jobs), not when its turn comes after the others trained.

Each ends the command with one paragraph and status 2, as rft's other configuration errors.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from rft.errors import ConfigError


class Checks(Callback):
    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        _exit_on(lambda: _check_dir(config, "hydra.run.dir"))

    def on_multirun_start(self, config: DictConfig, config_name: str | None = None, **kwargs) -> None:
        from rft.sweep import plan_jobs

        _exit_on(lambda: _check_dir(config, "hydra.sweep.dir"))
        _exit_on(lambda: _raise(plan_jobs(config, config_name)))


def _check_dir(config: DictConfig, key: str) -> None:
    from rft import rundir
    from rft.plan import check_run_name

    HydraConfig.instance().set_config(config)  # the directory's name reads hydra's choices
    check_run_name(config)  # name=../.. would make a directory outside the project's
    rundir.check_writable(Path(str(OmegaConf.select(config, key))))


def _raise(message: str | None) -> None:
    if message:
        raise ConfigError(message)


def _exit_on(check) -> None:
    try:
        check()
    except ConfigError as e:
        print(f"\nrft: configuration error: {e}\n", file=sys.stderr)
        sys.exit(2)
