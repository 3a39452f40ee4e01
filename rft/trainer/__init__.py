"""The trainer: one step (trainer.py: prepare -> update -> metrics), fsdp2 ranks (fsdp.py),
per-token log-probs (logprobs.py), micro-batches and ranks' shares (micro_batches.py), the
critic (critic.py), LoRA adapters (lora.py)."""
