"""The trainer (trainer.py: its construction, micro-batches and forward, entry points) and its
parts: one step's prepare and update (step.py) and metrics (metrics.py), the weights the
synchronizers read (weights.py), checkpoints (state.py), fsdp2 ranks (fsdp.py), per-token
log-probs (logprobs.py), micro-batches and ranks' shares (micro_batches.py), the critic
(critic.py), LoRA adapters (lora.py)."""
