"""rft: reinforcement fine-tuning of language models, driven by Hydra.

Entry point: `rft.runtime.main.main(cfg)` (called by run.py). The folders are the parts, each
importing only those below it (tests/test_layers.py): plan (every number and check, before
anything runs), algorithms, data, rewards, rollout (explorer, engines, workflows, environments),
trainer, sync, runtime (stages, schedule, actors, checkpoints), serving (HTTP servers), reporting,
studio. README's "Layout" says what each holds.
"""
