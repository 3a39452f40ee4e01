"""Rewards: reward functions (verifiers.py), a reward config -> parts, weights and their sum
(scoring.py), the LLM judge (judge.py), reward models (reward_model.py), and the client of the
reward server (remote.py)."""
