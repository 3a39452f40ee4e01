"""Planning: the batch plan and every check (batch.py), placement (placement.py), the config
files and overrides before Hydra composes them (overlays.py), a study's module named like a
standard one (search_path.py). Imports nothing that runs: a dry run is this part alone."""
