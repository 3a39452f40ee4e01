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


class WorkerExtension:
    def _reload(self, named_tensors) -> None:
        from rft.sync.weights import fingerprint

        tied = getattr(self.model_runner.model_config.hf_config, "tie_word_embeddings", False)
        seen = []

        def tap():
            embed, head = None, False
            for name, t in named_tensors:
                if tied and name == "lm_head.weight":
                    head = True
                else:
                    seen.append(t)
                if name.endswith("embed_tokens.weight"):
                    embed = t
                yield name, t
            # a tied output layer: the trainer sends it once (as the embedding), but the reload
            # re-processes layer by layer and would leave the output layer's packed copy stale
            if tied and not head and embed is not None:
                yield "lm_head.weight", embed

        self.reload_weights(weights_iterator=tap(), is_checkpoint_format=True)
        self.rft_fingerprint_value = fingerprint(seen)

    def rft_load_weights(self, blob: bytes) -> None:
        """A state dict serialised by safetensors.torch.save."""
        from safetensors.torch import load

        self._reload(load(blob).items())

    def rft_load_shared(self, segment: str, layout: tuple) -> None:
        """The trainer's shared-memory segment on this node (memory sync, rft.sync.weights.SharedWeights),
        read where it lies: views of it are what vLLM loads from, no bytes through the RPC."""
        from rft.sync.weights import SharedWeights, read_shared

        self._reload(read_shared(SharedWeights(segment, layout)).items())

    def rft_load_file(self, path: str) -> None:
        """A safetensors file, or a checkpoint's hf/ directory (one file or shards)."""
        from rft.sync.weights import hf_tensors

        self._reload(hf_tensors(path))

    def rft_collective_init(self, address, port, world, rank, timeout_s, manifest) -> None:
        from rft.sync.weights import open_group

        # with tensor parallelism each worker would need a rank of its own; one worker here
        self.rft_group = open_group(address, port, world, rank, timeout_s)
        self.rft_manifest = manifest

    @torch.no_grad()
    def rft_collective_receive(self) -> None:
        from rft.sync.weights import broadcast

        device = self.device if isinstance(getattr(self, "device", None), torch.device) else "cpu"

        def received():
            for name, shape, dtype in self.rft_manifest:
                t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                broadcast(self.rft_group, [t])
                yield name, t

        self._reload(received())

    def rft_fingerprint(self) -> str:
        """Of the weights last loaded; before any update, of the parameters as they are."""
        from rft.sync.weights import fingerprint

        value = getattr(self, "rft_fingerprint_value", None)
        return value or fingerprint(self.model_runner.model.parameters())
