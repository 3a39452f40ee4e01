"""Rollout: the explorer (explorer.py: tasks -> experiences, eval), its engines (engines/), the
workflows that turn a task into experiences (workflows/) and the environments they step
(environments/)."""
