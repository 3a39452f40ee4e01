"""Weights from the trainer to the engines: the sync contract (a fingerprint of the weights),
its transports and the synchronizers (weights.py). The trainer and the engines meet only here."""
