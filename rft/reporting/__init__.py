"""Reporting: progress and metrics (monitor.py: console, metrics.jsonl, TensorBoard, wandb), a
sweep's table and curves (report.py), a sweep's progress and a dead job's error (sweep.py)."""
