"""Planning: the batch plan and every check (batch.py), placement (placement.py), the config
files and overrides before Hydra composes them (overlays.py). Imports nothing that runs: a dry
run is this part alone."""
