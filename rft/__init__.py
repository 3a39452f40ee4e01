"""rft: reinforcement fine-tuning of language models, driven by Hydra.

Entry point: `rft.main.main(cfg)` (called by run.py). Planning, which imports nothing that runs:
config (schemas, names), plan (stages, batch plan, checks), placement (actor counts), algorithms
(registries and their needs), rewards, workflows, tasks, data. Running: main, runner (one stage's
schedule), actors (Ray or inline), checkpoint, explorer, engine, trainer, fsdp, sync, buffer,
monitor. README's "Layout" says what each holds.
"""
