"""HTTP servers: the reward server (reward_server.py), the explorer's OpenAI-compatible endpoint
(openai_api.py), and what they share (auth.py: tokens, request limits, the listening socket)."""
