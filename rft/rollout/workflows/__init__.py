"""Workflows: task -> experiences. single_turn.py holds the table of workflows (WORKFLOWS) and the
one-turn case; multi_turn.py a conversation with an environment, as token ids; openai_agent.py
agent code run against the explorer's OpenAI-compatible endpoint."""
