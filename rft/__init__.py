"""rft: reinforcement fine-tuning of language models, driven by Hydra.

Entry point: `rft.main.main(cfg)` (called by run.py). The pieces, each in the module named for it:
config (schemas), plan (batch plan), models, tasks, rewards, workflows, engine, explorer, buffer,
algorithms, trainer, sync, monitor, actors (Ray or inline), runner (the loop of one stage).
"""
