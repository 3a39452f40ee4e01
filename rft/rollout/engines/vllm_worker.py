"""Methods vLLM adds to each of its workers (`worker_extension_cls`), for in-place weight updates.

They run inside vLLM's worker processes. Every path hands vLLM's own `reload_weights` an iterator
of (Hugging Face name, tensor) pairs: it fuses them into vLLM's layout (q/k/v into one projection,
gate/up into one) and redoes the post-load processing (on CPU, weights are repacked for the
kernels, so a second plain `load_weights` would fail).

The fingerprint: once loaded, vLLM's weights may be repacked beyond reading back, so the worker
fingerprints the tensors it received and loaded (a tied output layer counts once, as the trainer
counts it). It catches a corrupted, partial or stale transfer; that the model took them is
vLLM's own check (it warns about any weight not loaded), and the engine tests compare outputs.
"""

from __future__ import annotations

import torch

_BATCH = 1 << 24  # elements fingerprinted at a time, as they pass (32 MB in bfloat16)


class WorkerExtension:
    def _reload(self, named_tensors) -> dict:
        """Load (name, tensor) pairs; returns {"check_s": the seconds the fingerprint of them took
        past the load}. It is summed beside the load, a batch at a time as the tensors pass (none is
        kept for a pass at the end): on CPU, vLLM's reload repacks each layer for its kernels while
        another core sums the layer before (the 0.5B shape: 0.3 s of sums, mostly hidden)."""
        import time
        from concurrent.futures import ThreadPoolExecutor

        from rft.sync.weights import format_fingerprint, weight_sums

        tied = getattr(self.model_runner.model_config.hf_config, "tie_word_embeddings", False)
        pending, parts = [], []  # tensors not handed to the summing thread yet; its futures
        beside = ThreadPoolExecutor(1, thread_name_prefix="rft-check")

        def add_up(at_least: int) -> None:
            if pending and sum(t.numel() for t in pending) >= at_least:
                parts.append(beside.submit(weight_sums, list(pending)))
                pending.clear()

        def tap():
            embed, head = None, False
            for name, t in named_tensors:
                if tied and name == "lm_head.weight":
                    head = True
                else:
                    pending.append(t)
                if name.endswith("embed_tokens.weight"):
                    embed = t
                yield name, t
                add_up(_BATCH)
            add_up(0)
            # a tied output layer: the trainer sends it once (as the embedding), but the reload
            # re-processes layer by layer and would leave the output layer's packed copy stale
            if tied and not head and embed is not None:
                yield "lm_head.weight", embed

        try:
            self.reload_weights(weights_iterator=tap(), is_checkpoint_format=True)
            t0 = time.perf_counter()
            sums = [f.result() for f in parts]
            check_s = time.perf_counter() - t0
        finally:
            beside.shutdown(wait=True)
        self.rft_fingerprint_value = format_fingerprint(sum(n for n, _ in sums), sum(s for _, s in sums))
        return {"check_s": check_s}

    def rft_load_weights(self, blob: bytes) -> dict:
        """A state dict serialised by safetensors.torch.save."""
        from safetensors.torch import load

        return self._reload(load(blob).items())

    def rft_load_shared(self, segment: str, layout: tuple) -> dict:
        """The trainer's shared-memory segment on this node (memory sync, rft.sync.weights.SharedWeights),
        read where it lies: views of it are what vLLM loads from, no bytes through the RPC."""
        from rft.sync.weights import SharedWeights, read_shared

        return self._reload(read_shared(SharedWeights(segment, layout)).items())

    def rft_load_file(self, path: str) -> dict:
        """A safetensors file, or a checkpoint's hf/ directory (one file or shards)."""
        from rft.sync.weights import hf_tensors

        return self._reload(hf_tensors(path))

    def rft_collective_init(self, address, port, world, rank, timeout_s, manifest) -> None:
        from rft.sync.weights import open_group

        # with tensor parallelism each worker would need a rank of its own; one worker here
        self.rft_group = open_group(address, port, world, rank, timeout_s, self._rft_device())
        self.rft_manifest = manifest

    def _rft_device(self):
        """Where this worker's weights are: its GPU (vLLM's GPU worker sets `device`), else the CPU."""
        return self.device if isinstance(getattr(self, "device", None), torch.device) else torch.device("cpu")

    @torch.no_grad()
    def rft_collective_receive(self) -> dict:
        from rft.sync.weights import broadcast

        device = self._rft_device()

        def received():
            for name, shape, dtype in self.rft_manifest:
                t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                broadcast(self.rft_group, [t])
                yield name, t

        return self._reload(received())

    def rft_fingerprint(self) -> str:
        """Of the weights last loaded; before any update, of the parameters as they are."""
        from rft.sync.weights import fingerprint

        value = getattr(self, "rft_fingerprint_value", None)
        return value or fingerprint(self.model_runner.model.parameters())
