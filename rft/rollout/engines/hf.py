"""Rollout engines: `generate(prompts, n, args, seed) -> samples` and weight updates.

`hf` (transformers `generate`, batched with a KV cache) is the CPU default. Every engine returns,
for each prompt, `n` samples of response token ids, the log-prob of each token under the
sampling distribution (after temperature/top-p/top-k), and a finish reason.

Stop strings (`rollout_args.stop`) end a sample the same way in every engine: at the first token
after which the decoded response contains one of them. That token is kept, so the sample's tokens
are exactly those sampled (the trainer trains on them, one log-prob each) and its text contains
the stop string; later tokens are dropped; the finish reason is "stop". The response is decoded
as vLLM's detokenizer does (incrementally, after the prompt, special tokens skipped). A token
that completes a stop string and goes on past it is kept whole: with stop "ss" and a token
"assistant", the response ends with "assistant". With a tokenizer of multi-character tokens (BPE)
a response can so end a few characters past its stop string; with the tiny model's
character-level one, only at its role-name tokens.
"""

from __future__ import annotations

import functools
import time

import torch

from rft.data.chat import stop_ids
from rft.models import load_model
from rft.rollout.engines.base import Sample
from rft.sync.weights import copy_pairs, fingerprint, same_bits


class StopStrings:
    """A `generate` stopping criterion: row i ends at the first response token after which its
    decoded response contains one of `stop`; `ends[i]` is then the number of response tokens it
    keeps (that token included), else None.

    Each response is decoded as vLLM decodes it (the tokenizers library's DecodeStream, started
    after the prompt, special tokens skipped), so both engines cut at the same token.
    `start`: the column of `input_ids` where responses begin.
    """

    def __init__(self, tokenizer, prompts: list[list[int]], stop: list[str], start: int):
        from tokenizers.decoders import DecodeStream

        self.backend = tokenizer.backend_tokenizer
        self.stop, self.start = list(stop), start
        self.streams = [DecodeStream(ids=p, skip_special_tokens=True) for p in prompts]
        self.texts = [""] * len(prompts)
        self.seen = 0  # response tokens looked at so far (as many in every row)
        self.ends: list[int | None] = [None] * len(prompts)

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        new = input_ids[:, self.start + self.seen :].tolist()
        for i, tokens in enumerate(new):
            for j, t in enumerate(tokens):
                if self.ends[i] is None:
                    old = len(self.texts[i])
                    self.texts[i] += self.streams[i].step(self.backend, t) or ""
                    # only occurrences that end in the new text: earlier ones would have stopped it
                    if any(s in self.texts[i][max(0, old - len(s) + 1) :] for s in self.stop):
                        self.ends[i] = self.seen + j + 1
        self.seen += len(new[0])
        return torch.tensor([e is not None for e in self.ends], device=input_ids.device)


def warpers(args) -> list:
    """transformers' temperature, top-k and top-p warpers for `args`, in the order `generate`
    applies its own (and with the same conditions: each only when it changes the distribution)."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    out = []
    if args.temperature != 1.0:
        out.append(TemperatureLogitsWarper(args.temperature))
    if args.top_k > 0:
        out.append(TopKLogitsWarper(top_k=args.top_k))
    if args.top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=args.top_p))
    return out


class SampledLogprobs:
    """A `generate` logits processor, for greedy decoding (DrawOne records its own draws): the
    log-prob of each row's token under the processed scores, one step at a time.

    Asking `generate` for `output_scores` instead keeps every step's [rows, vocabulary] scores
    until the end: rows x new tokens x vocabulary x 4 bytes (256 x 1,024 x 151,936: 160 GB).
    This keeps one step's log-softmax: at its next call the token sampled from it is the last
    column of `input_ids`; the last step's token is the last column of the returned sequences
    (`finish`). Rows already finished get a pad token and a log-prob nobody reads.
    """

    def __init__(self):
        self.previous: torch.Tensor | None = None  # [rows, vocabulary], the last step's log-softmax
        self.steps: list[torch.Tensor] = []  # [rows] per step

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._take(input_ids[:, -1:])
        self.previous = torch.log_softmax(scores, dim=-1)
        return scores

    def _take(self, tokens: torch.Tensor) -> None:
        if self.previous is not None:
            self.steps.append(self.previous.gather(1, tokens).squeeze(1))
            self.previous = None

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """[rows, new tokens]: the log-probs, once `generate` returned `sequences`."""
        self._take(sequences[:, -1:])
        return torch.stack(self.steps, 1)


class DrawOne:
    """A `generate` logits processor, the last but TrimHeap: draws each row's next token from the
    processed scores and leaves it the only token possible (0, every other -inf), so that
    `generate`, run greedy, takes it; records the drawn token's log-prob (`finish`).

    `generate`'s own sampling (torch.multinomial) draws one exponential variate per vocabulary
    entry and row: 32 rows x 151,936 take 0.11 s a step on 2 CPU cores, a third of a 0.5B model's
    decode step (experiments/engine_memory/README.md). This draws one uniform per row and looks it
    up in the row's cumulative distribution. The cumulative sum is float64: each token's share of
    it is then its float32 probability to ~1e-16, where float32 would misplace each boundary by up
    to 6e-8 (1% of a token's probability in a flat distribution over 151,936).

    It runs over `block` entries at a time: the float64 sums of the row's blocks find the block
    the uniform falls in, and the cumulative sum runs over that block alone. The probabilities
    are computed in place of `scores` (generate's own float32 copy of the logits, which the
    result overwrites): no [rows, vocabulary] tensor is allocated. A decode step's tensors of that
    size (19 MB each at 32 x 151,936) are what the C heap placed differently from run to run,
    moving the peak of a generation by hundreds of MB (experiments/engine_memory/README.md)."""

    block = 4096

    def __init__(self):
        self.steps: list[torch.Tensor] = []  # [rows] per step: the drawn tokens' log-probs

    def finish(self) -> torch.Tensor:
        """[rows, new tokens]: the drawn tokens' log-probs under the processed scores (a row's
        tokens after generate ended it, its padding, get one nobody reads)."""
        return torch.stack(self.steps, 1)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        R, V = scores.shape
        probs = scores.sub_(scores.amax(-1, keepdim=True)).exp_()  # the softmax, in place
        total = probs.sum(-1, keepdim=True, dtype=torch.float64)
        probs.div_(total.float())
        B = min(self.block, V)
        full = V // B * B
        sums = probs[:, :full].view(R, -1, B).sum(-1, dtype=torch.float64)
        if full < V:
            sums = torch.cat([sums, probs[:, full:].sum(-1, keepdim=True, dtype=torch.float64)], 1)
        cum = torch.nn.functional.pad(sums.cumsum(-1), (1, 0))  # [R, blocks + 1], from 0
        u = torch.rand((R, 1), dtype=torch.float64, device=scores.device) * cum[:, -1:]
        # the block, then the token, whose cumulative probability first passes u: never one of
        # probability 0
        b = torch.searchsorted(cum[:, 1:].contiguous(), u, right=True).clamp_(max=cum.shape[1] - 2)
        at = b * B + torch.arange(B, device=scores.device)
        inside = probs.gather(1, at.clamp(max=V - 1)).masked_fill_(at >= V, 0.0)
        t = torch.searchsorted(inside.cumsum(-1, dtype=torch.float64) + cum.gather(1, b), u, right=True)
        token = at.gather(1, t.clamp(max=B - 1))
        # u * total rounded up to the total, or past its block's own sum (their summing orders
        # differ; odds ~1e-16): the most likely token, not a zero-probability one nor one past the end
        past = (u >= cum[:, -1:]) | (t >= B) | (token >= V) | (probs.gather(1, token.clamp(max=V - 1)) == 0)
        token = torch.where(past, probs.argmax(-1, keepdim=True), token)
        # the log of the drawn token's float32 probability: the log-softmax to ~1e-7 (exp's and the
        # division's rounding), and no [rows, vocabulary] log-softmax made (one such tensor a step less)
        self.steps.append(probs.gather(1, token).squeeze(1).double().log().float())
        return scores.fill_(float("-inf")).scatter_(1, token, 0.0)


class TrimHeap:
    """A `generate` logits processor that changes nothing and hands the C heap's free pages back
    to the system every `every` steps (glibc's malloc_trim), on CPU.

    A decode step allocates tensors a token larger than the last step's (the KV cache where it is
    not reserved, which DynamicCache concatenates anew; the attention's mask): glibc serves them
    from its heap and keeps what they leave free, so what stays resident through a long
    generation grows past what is live (the tiny model, 32 rows x 512 tokens, before the cache was
    reserved: 116 MB untrimmed, 64 trimmed, over a 33 MB cache; experiments/engine_memory/README.md)."""

    def __init__(self, every: int = 16):
        self.every, self.calls = every, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls % self.every == 0:
            malloc_trim()(0)
        return scores


@functools.cache
def malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (macOS, musl)."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def cache_keyword(model) -> str:
    """The name a model takes its KV cache by: `cache` since transformers renamed it (5.2x; the
    old name then warns on every call), `past_key_values` before."""
    return "cache" if "cache" in _forward_takes(type(model)) else "past_key_values"


@functools.cache
def _forward_takes(cls) -> frozenset:  # once per model class, not per generate call
    """The names a model class's forward takes."""
    import inspect

    return frozenset(inspect.signature(cls.forward).parameters)


def logits_to_keep(model) -> dict:
    """The forward's argument for computing one position's logits instead of every position's:
    a prefill that only fills the KV cache would otherwise hold [rows, prompt tokens, vocabulary]
    (32 prompts x 512 tokens x 151,936 in bfloat16: 5 GB). {} for a model without it."""
    return {"logits_to_keep": 1} if "logits_to_keep" in _forward_takes(type(model)) else {}


def reserve(cache, capacity: int) -> None:
    """Each full-attention layer of a DynamicCache written in place from now on, into keys and
    values reserved for `capacity` tokens (ReservedLayer).

    Every layer's keys and values are views of one tensor: one allocation, which the C heap serves
    by mmap (glibc's threshold stops at 32 MB) and gives back whole. Layer by layer (1 to 9 MB each
    at the 0.5B shape, 32 rows) they would sit in the heap between the decode steps' short-lived
    [rows, vocabulary] tensors, which then find no hole of their size and grow the heap."""
    from transformers.cache_utils import DynamicLayer

    todo = [i for i, layer in enumerate(cache.layers)
            if type(layer) is DynamicLayer and layer.is_initialized and layer.keys.shape[-2] < capacity]
    shapes = {(cache.layers[i].keys.shape, cache.layers[i].values.shape, cache.layers[i].keys.dtype) for i in todo}
    if len(shapes) != 1:  # layers of different shapes (none of transformers' full-attention models): each its own
        for i in todo:
            layer = cache.layers[i]
            cache.layers[i] = _reserved_layer_class()(layer, *(t.new_empty(t.shape[:-2] + (capacity, t.shape[-1]))
                                                               for t in (layer.keys, layer.values)))
        return
    k = cache.layers[todo[0]].keys
    block = k.new_empty((len(todo), 2) + k.shape[:-2] + (capacity, k.shape[-1]))
    for j, i in enumerate(todo):
        cache.layers[i] = _reserved_layer_class()(cache.layers[i], block[j, 0], block[j, 1])


@functools.cache  # one class (transformers imported when an engine first generates, not with this module)
def _reserved_layer_class():
    from transformers.cache_utils import DynamicLayer

    class ReservedLayer(DynamicLayer):
        """A DynamicLayer whose keys and values are views of tensors reserved for the whole
        generation: a step writes its token in place. DynamicLayer concatenates the cache anew
        every step (a copy of the layer's cache, and a block a token larger than the one it
        frees, which the C heap cannot reuse: what stays resident grows past the cache between
        trims). Past the capacity (or once another of DynamicLayer's methods replaced the
        keys) it concatenates, as DynamicLayer does."""

        def __init__(self, layer, keys, values):
            """`keys`, `values`: the reserved tensors, as the layer's but `capacity` tokens long."""
            super().__init__()
            # from the tensors: a DynamicLayer of later transformers (5.2x) keeps no dtype or device of its own
            self.dtype, self.device, self.is_initialized = layer.keys.dtype, layer.keys.device, True
            n = layer.keys.shape[-2]
            self._keys, self._values = keys, values
            self._keys[..., :n, :], self._values[..., :n, :] = layer.keys, layer.values
            self.keys, self.values = self._keys[..., :n, :], self._values[..., :n, :]

        def update(self, key_states, value_states, *args, **kwargs):
            n, new = self.keys.shape[-2], key_states.shape[-2]
            # past the capacity, or the keys replaced by another of DynamicLayer's methods
            if n + new > self._keys.shape[-2] or self.keys.data_ptr() != self._keys.data_ptr():
                return super().update(key_states, value_states, *args, **kwargs)
            self._keys[..., n:n + new, :].copy_(key_states)
            self._values[..., n:n + new, :].copy_(value_states)
            self.keys, self.values = self._keys[..., :n + new, :], self._values[..., :n + new, :]
            return self.keys, self.values

    return ReservedLayer


def sdpa_grouped(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' sdpa attention, except with a mask on CPU: sdpa's `enable_gqa` takes each
    key/value head for its group of query heads as it is.

    transformers repeats the keys and values for every query head whenever there is a mask (CUDA's
    fast kernels take grouped heads only without one), and a left-padded batch always has one. At
    Qwen2.5-0.5B's shape (7 query heads a key/value head), 32 rows x 1,100 tokens: 120 MB
    allocated per layer per decode step and 57 ms, against 2.6 ms and nothing allocated, the same
    output bit for bit (torch's CPU kernel groups the heads itself)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = kwargs.get("position_bias") is None and kwargs.get("cache") is None
    if attention_mask is not None and plain and query.device.type == "cpu" and getattr(module, "num_key_value_groups", 1) > 1:
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def use_sdpa_grouped(model) -> None:
    """A model on CPU with sdpa attention: attention through `sdpa_grouped` (registered with
    transformers under "rft_sdpa_grouped", with sdpa's masks)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if model.config._attn_implementation != "sdpa" or model.device.type != "cpu":
        return
    AttentionInterface.register("rft_sdpa_grouped", sdpa_grouped)
    ALL_MASK_ATTENTION_FUNCTIONS.register("rft_sdpa_grouped", sdpa_mask)
    model.set_attn_implementation("rft_sdpa_grouped")


class HFEngine:
    """transformers `generate` on `device` (the explorer's rft.models.local_device)."""

    def __init__(self, model_cfg, rollout_cfg, tokenizer, path: str | None = None, device="cpu"):
        from transformers import GenerationConfig

        self.device = torch.device(device)
        self.model = load_model(model_cfg, path).to(self.device)
        use_sdpa_grouped(self.model)
        # the rollout's settings are rollout_args' alone: generate() fills each setting it is not
        # given from the checkpoint's generation_config.json (Qwen2.5's: top_k 20, top_p 0.8,
        # repetition_penalty 1.05), which would sample from another distribution than the config
        # says (top_k off, no penalty) and than explorer=vllm does
        self.model.generation_config = GenerationConfig()
        self.tokenizer = tokenizer
        # the ids that end a response, as in the vLLM engine: the tokenizer's eos and the model's
        # generation_config.json eos_token_id (Qwen2.5-Instruct's <|im_end|> and <|endoftext|>),
        # or model.stop_token_ids; the reset generation_config above holds none of them
        self.stop_ids = stop_ids(tokenizer)
        self.batch_size = rollout_cfg.generate_batch_size
        self.max_response_tokens = model_cfg.max_response_tokens
        self.busy_s = 0.0  # seconds spent generating (the runtime benchmark's "model compute")
        self._trim = [TrimHeap()] if self.device.type == "cpu" and malloc_trim() else []

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, args, seed: int) -> list[list[Sample]]:
        t0 = time.perf_counter()
        try:
            return self._generate(prompts, n, args, seed)
        finally:
            self.busy_s += time.perf_counter() - t0

    def _generate(self, prompts: list[list[int]], n: int, args, seed: int) -> list[list[Sample]]:
        # whole groups per chunk (generate_batch_size rows, at least one group): a group's n
        # samples share their prompt's prefill
        per_chunk = max(1, self.batch_size // n)
        samples: list[Sample] = []
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            for start in range(0, len(prompts), per_chunk):
                samples += self._generate_chunk(prompts[start : start + per_chunk], n, args)
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _prefill(self, input_ids, attention_mask, n: int, max_new: int):
        """The KV cache of each prompt but its last token, computed once and repeated for its n
        samples (rows i*n..i*n+n-1), or None when there is nothing to share. `generate` then
        runs only the last prompt token and the new ones: the prefill of a group costs one
        sample's, not n (vLLM's prefix caching does the same). Its layers have room reserved for
        the prompt and `max_new` tokens, written in place (`reserve`)."""
        if n == 1 or input_ids.shape[1] < 2:
            return None
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        mask = attention_mask[:, :-1]
        position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as generate numbers left-padded rows
        self.model(input_ids=input_ids[:, :-1], attention_mask=mask, position_ids=position_ids,
                   **{cache_keyword(self.model): cache}, use_cache=True, **logits_to_keep(self.model))
        cache.batch_repeat_interleave(n)
        reserve(cache, input_ids.shape[1] + max_new)
        return cache

    def _generate_chunk(self, groups: list[list[int]], n: int, args) -> list[Sample]:
        from transformers import LogitsProcessorList

        tok = self.tokenizer
        L = max(len(p) for p in groups)
        # left padding: every prompt ends at the same position, where generation starts
        input_ids = torch.full((len(groups), L), tok.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(groups), L), dtype=torch.long)
        for i, p in enumerate(groups):
            input_ids[i, L - len(p) :] = torch.tensor(p)
            attention_mask[i, L - len(p) :] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        max_new = args.max_tokens or self.max_response_tokens
        cache = self._prefill(input_ids, attention_mask, n, max_new)
        input_ids, attention_mask = input_ids.repeat_interleave(n, 0), attention_mask.repeat_interleave(n, 0)
        prompts = [p for p in groups for _ in range(n)]
        greedy = args.temperature == 0
        # the log-probs: of the token each row drew (DrawOne records them), or, greedy, of the
        # most likely one (SampledLogprobs)
        record = SampledLogprobs() if greedy else DrawOne()
        stop = getattr(args, "stop", None)  # RolloutArgs has it; args built by hand may not
        stops = StopStrings(tok, prompts, stop, L) if stop else None
        sequences = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            **{cache_keyword(self.model): cache},
            # greedy: the token each row draws is the only one DrawOne leaves possible
            do_sample=False,
            max_new_tokens=max_new,
            eos_token_id=self.stop_ids or None,  # None: none ([] of model.stop_token_ids)
            pad_token_id=tok.pad_token_id,
            # the warpers, the recorder after them (it sees the distribution sampled from), the draw
            logits_processor=LogitsProcessorList(([] if greedy else warpers(args)) + [record] + self._trim),
            stopping_criteria=[stops] if stops else None,
        )
        logprobs = record.finish(sequences) if greedy else record.finish()
        return self._samples(prompts, sequences[:, L:], logprobs, stops)

    def _samples(self, prompts, new_tokens, logprobs, strings) -> list[Sample]:
        """Each row's response up to its end: its first stop id (the eos token, one of the
        model's generation_config.json) or the token that completed a stop string (kept), else the
        whole budget ("length"). The first: a finished row is padded, maybe with a stop id
        (Qwen2.5's pad <|endoftext|> is one)."""
        stops = set(self.stop_ids)
        result = []
        for i in range(len(prompts)):
            ids = new_tokens[i].tolist()
            stop_end = strings.ends[i] if strings else None
            if stop_end is not None:
                ids = ids[:stop_end]  # padding follows a stop string
            end = next((j + 1 for j, t in enumerate(ids) if t in stops), None)
            if end is not None:
                reason = "stop"
            else:
                end, reason = len(ids), "length" if stop_end is None else "stop"
            result.append(Sample(ids[:end], logprobs[i, :end].tolist(), reason))
        return result

    # ------------------------------------------------------------------ weights, in place

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        own = self.model.state_dict()  # views of the parameters: copying into one changes the model
        if own.keys() != state_dict.keys() or any(own[k].shape != v.shape for k, v in state_dict.items()):
            self.model.load_state_dict(state_dict, strict=True)  # its error names what does not match
            return
        # the same copies as load_state_dict, a quarter of its time (no walk of the modules)
        with torch.no_grad():
            if self.device.type == "cpu":
                copy_pairs([(own[k], v) for k, v in state_dict.items()])  # on every core
            else:
                for k, v in state_dict.items():
                    own[k].copy_(v)

    def differs(self, state_dict: dict[str, torch.Tensor]) -> list[str]:
        """The names of `state_dict` whose tensor this engine does not hold bit for bit (memory
        sync in one process checks what it loaded against the trainer's own tensors: exact, and
        a third of the cost of fingerprinting both sides)."""
        own = self.model.state_dict()
        return [k for k, v in state_dict.items() if k not in own or not same_bits(own[k], v)]

    def load_weights_file(self, path: str) -> None:
        """A safetensors file of the trainer's weights, or a checkpoint's hf/ directory."""
        from pathlib import Path

        from rft.models import load_hf_weights

        if Path(path).is_dir():
            load_hf_weights(self.model, path)
        else:
            from safetensors.torch import load_file

            self.update_weights(load_file(path))

    def collective_init(self, address: str, port: int, world: int, rank: int, timeout_s: float, manifest) -> None:
        from rft.sync.weights import open_group

        self.group = open_group(address, port, world, rank, timeout_s, self.device)

    @torch.no_grad()
    def collective_receive(self) -> None:
        """The trainer's broadcast, straight into this model's parameters (same names, same order)."""
        from rft.sync.weights import broadcast

        broadcast(self.group, [p for _, p in sorted(self.model.named_parameters())])

    def fingerprint(self) -> str:
        return fingerprint(self.model.parameters())

    def sleep(self) -> None:
        """Free the device for training (colocation): nothing to free for this engine."""

    def wake_up(self) -> None:
        pass
