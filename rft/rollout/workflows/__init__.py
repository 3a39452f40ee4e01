"""Workflows: task -> experiences. single_turn.py holds the table of workflows and the one-turn
case; multi_turn.py a conversation with an environment, as token ids."""
