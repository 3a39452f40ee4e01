"""Per-token log-probs and entropies of a causal LM, as the trainer computes them.

`token_logprobs` takes right-padded rows and returns [n, L-1] tensors (0 where a position has no
next token of its row). How it gets there, each choice giving the same numbers:

- packed (`trainer.use_remove_padding`): the rows' real tokens are laid end to end with
  position ids restarting at 0 for each; transformers then builds attention that never crosses
  from one sequence into another (a block-diagonal causal mask for sdpa and eager, sequence
  boundaries for flash-attention). With flash-attention every sequence goes in one row; sdpa and
  eager compute a row's whole masked square, so their rows are as wide as the longest sequence,
  filled first-fit (`pack`): no compute on padding but a bin's unused end.
- shared prompts (packed, given each row's prompt length, sdpa or eager attention without sliding
  windows): rows with the same prompt ids (a GRPO group) go in as one sequence, the prompt once
  and each row's response after it, every response attending to the prompt and to itself only
  (a mask of our own, `share_prompts`). The prompt's hidden states do not depend on what follows
  them, so each row's log-probs are those of its own sequence, and the gradient through the
  shared prompt is the sum of the rows'. Done for a group whose prompt is at least as long as
  its mean response: the tokens computed drop by more than (n - 1) / 2n, and the denser
  attention of one long sequence stays cheap next to them.
- chunked (`trainer.logprob_chunk_size`): the output layer runs inside the model's forward on
  `chunk` positions at a time, each chunk under activation checkpointing, so the float32
  [positions, vocab] logits never exist whole, neither in the forward nor kept for the backward
  (it is recomputed chunk by chunk). Only the positions that predict a token of their own row
  go through the output layer.
- `first`: only the positions from each row's `first` on go through the output layer (the
  trainer's: from the last prompt token, as no loss reads a prompt position's log-prob; at
  vocabulary 151,936 the output layer and its float32 log-softmax are a large part of a step).
- `fp32_head` (`model.fp32_lm_head`): the output layer's matmul in float32 for a bfloat16 model.
- `also` (on-policy distillation's JSD, rft/algorithms/distill.py): besides the sampled token's,
  the log-probs of a few other tokens per position, out of the same chunked output layer: each
  position's `top` most likely tokens (the teacher's), or the tokens `at_ids` names (the student's
  at the teacher's). These are of the temperature-scaled distribution before any top-k / top-p cut.

The distribution is the one the explorer sampled from (as verl does for the temperature):
logits divided by `temperature`, then cut to the `top_k` most likely tokens (and any tied with the
k-th) and to the smallest set whose probability reaches `top_p`, renormalised (the order of
transformers' and vLLM's samplers). Each may be a number or a tensor [n] of per-row values
(top_k <= 0, top_p >= 1: no cut). A target token is never cut (the sampler drew it, so it was in
the set; an engine's float rounding at the set's edge must not give it probability 0).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from rft.trainer.micro_batches import first_fit


def token_logprobs(model, input_ids, attention_mask, temperature=1.0, top_p=None, top_k=None,
                   with_entropy_grad=True, packed=False, chunk_size=None, fp32_head=False, prompt_lengths=None,
                   first=None, also=None):
    """Log-prob of each next token and the entropy of each next-token distribution, [n, L-1].

    `with_entropy_grad=False`: the entropy is only a metric (no gradient kept for it).
    `prompt_lengths` ([n], with `packed`): rows sharing a prompt compute it once (module doc).
    `first` ([n]): each row's first position to compute (its prompt length - 1: the one that
    predicts the first response token); the positions before it are 0, their logits never made.
    `also` (a dict, filled in place): {"top": k} adds "top_ids" and "top_logp" [n, L-1, k], each
    position's k most likely tokens and their log-probs (with "below": V, among the ids < V only: a
    teacher's padding rows beyond the tokenizer's tokens, which the student may have no logit for,
    stay in the mass outside the top), and "top_rest" [n, L-1, 1], the log of that mass; {"at_ids":
    [n, L-1, k]} adds "at_logp" and "at_rest", the same of those tokens (with gradient). 0 elsewhere.
    """
    n, L = input_ids.shape
    dev = input_ids.device
    lengths = attention_mask.sum(-1)
    # the positions that predict a token of their own row: t < length - 1, as (row, t); from `first`
    t = torch.arange(L - 1, device=dev)[None, :]
    has_next = t < (lengths[:, None] - 1)
    if first is not None:
        has_next &= t >= torch.as_tensor(first, device=dev)[:, None]
    rows, cols = has_next.nonzero(as_tuple=True)
    targets = input_ids[rows, cols + 1]
    per_row = lambda v, dtype: torch.as_tensor(v, dtype=dtype, device=dev).expand(n)[rows]  # noqa: E731
    sampling = (per_row(temperature, torch.float32),
                None if top_p is None else per_row(top_p, torch.float32),
                None if top_k is None else per_row(top_k, torch.long))
    want = _Also(also, rows, cols)
    shared = None
    if packed and prompt_lengths is not None and can_share_prompts(model):
        shared = share_prompts(input_ids, lengths.tolist(), [int(p) for p in prompt_lengths], model.dtype)
    if shared is not None:
        packed_ids, positions, mask, where = shared
        select = where[rows, cols]
        kwargs = {"input_ids": packed_ids, "position_ids": positions, "attention_mask": mask}
    elif packed:
        packed_ids, positions, starts = pack(input_ids, lengths.tolist(), one_row(model))
        select = starts[rows] + cols
        kwargs = {"input_ids": packed_ids, "position_ids": positions}
    else:
        select = rows * L + cols
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
    head = model.get_output_embeddings()
    if getattr(model.config, "final_logit_softcapping", None) or head is None:
        # the model reshapes its logits after the output layer (Gemma's soft-capping): take them whole
        logits = model(**kwargs, use_cache=False).logits.flatten(0, 1)[select]
        logp, entropy, *extra = _from_logits(logits.float(), targets, *sampling, with_entropy_grad, want.top, want.at,
                                             want.below)
    else:
        out = {}
        with _head_replaced(head, lambda h: _head_logprobs(h, head, select, targets, sampling, out,
                                                            chunk_size, fp32_head, with_entropy_grad, want)):
            model(**kwargs, use_cache=False)
        logp, entropy, extra = out["logp"], out["entropy"], out["extra"]
    want.place(extra, n, L)
    full_logp = torch.zeros((n, L - 1), dtype=logp.dtype, device=dev)
    full_entropy = torch.zeros((n, L - 1), dtype=entropy.dtype, device=dev)
    return full_logp.index_put((rows, cols), logp), full_entropy.index_put((rows, cols), entropy)


class _Also:
    """token_logprobs' `also` request, on the computed positions (rows, cols): `top` (0: none) and
    `at` ([N, k] ids or None) as _from_logits takes them; `place` writes the results back."""

    def __init__(self, also, rows, cols):
        self.also, self.rows, self.cols = also, rows, cols
        self.top = int((also or {}).get("top", 0))
        self.below = (also or {}).get("below")
        at_ids = (also or {}).get("at_ids")
        self.at = None if at_ids is None else at_ids[rows, cols].long()

    def place(self, extra, n, L):
        """The extra outputs ([N, k] each), as [n, L-1, k] into `also`."""
        names = ((["top_logp", "top_ids", "top_rest"] if self.top else [])
                 + (["at_logp", "at_rest"] if self.at is not None else []))
        for name, value in zip(names, extra):
            full = value.new_zeros((n, L - 1, value.shape[-1]))
            self.also[name] = full.index_put((self.rows, self.cols), value)


def reward_scores(model, input_ids, attention_mask):
    """A reward model's (Needs.reward_head) score of each row, where the log-prob of its last token
    would be: ([n, L-1] with row i's score at its length - 2, 0 elsewhere; entropies 0). The model
    pools at the row's last token that is not its pad token (right padding)."""
    n, L = input_ids.shape
    scores = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, 0].float()
    last = (attention_mask.sum(-1) - 2).clamp(min=0)
    out = torch.zeros((n, L - 1), dtype=scores.dtype, device=input_ids.device)
    out = out.index_put((torch.arange(n, device=input_ids.device), last), scores)
    return out, torch.zeros_like(out)


def one_row(model) -> bool:
    """Whether to pack every sequence into one row: with flash-attention, whose varlen kernel
    computes nothing across sequences. sdpa and eager compute the whole masked square of a row,
    so they get rows no longer than the longest sequence."""
    return str(getattr(model.config, "_attn_implementation", "")).startswith("flash_attention")


def pack(input_ids, lengths: list[int], one_row: bool = False):
    """Right-padded rows [n, L] -> packed rows [B, W] (first-fit, longest first, in bins as wide as
    the longest sequence; or one row), their position ids (0.. for each sequence, and for the
    unused end of a bin, a filler sequence of its own that nothing reads), and where each
    sequence starts in the flattened [B * W]."""
    where, bins = first_fit(lengths, sum(lengths) if one_row else max(lengths))
    width = max(bins)
    ids = input_ids.new_zeros((len(bins), width))
    positions = input_ids.new_zeros((len(bins), width))
    arange = torch.arange(width, device=input_ids.device)
    for i, (b, o) in enumerate(where):
        ids[b, o:o + lengths[i]] = input_ids[i, :lengths[i]]
        positions[b, o:o + lengths[i]] = arange[:lengths[i]]
    for b, used in enumerate(bins):
        positions[b, used:] = arange[:width - used]
    starts = torch.tensor([b * width + o for b, o in where], device=input_ids.device)
    return ids, positions, starts


def can_share_prompts(model) -> bool:
    """A model whose attention takes our mask as it is: sdpa or eager, causal over every position
    (no sliding window). flash-attention's varlen kernel knows only whole sequences."""
    c = model.config
    if str(getattr(c, "_attn_implementation", "")) not in ("sdpa", "eager"):
        return False
    if any(t != "full_attention" for t in getattr(c, "layer_types", None) or []):
        return False
    return getattr(c, "sliding_window", None) is None or getattr(c, "use_sliding_window", None) is False


def prompt_units(input_ids, lengths: list[int], prompt_lengths: list[int]):
    """The sequences `share_prompts` lays out: (prompt length, rows) for each group of rows with
    the same prompt ids whose prompt is at least as long as their mean response, (length, [row])
    for every other row (all prompt); with each one's size in tokens. None when no row shares."""
    groups: dict = {}
    for i in range(len(lengths)):
        p = min(prompt_lengths[i], lengths[i])
        groups.setdefault((p, tuple(input_ids[i, :p].tolist())), []).append(i)
    units = []
    for (p, _), members in groups.items():
        responses = sum(lengths[r] - p for r in members)
        if len(members) > 1 and p > 0 and p * len(members) >= responses:
            units.append((p, members))
        else:
            units += [(lengths[r], [r]) for r in members]
    if len(units) == len(lengths):
        return None
    return units, [p + sum(lengths[r] - p for r in members) for p, members in units]


def share_prompts(input_ids, lengths: list[int], prompt_lengths: list[int], dtype):
    """Right-padded rows [n, L] -> packed rows [B, W] in which the rows of a group (the same prompt
    ids) hold their prompt once, followed by each row's response: their ids, position ids (each
    response continues from its prompt's length), an additive attention mask [B, 1, W, W] (a
    response sees its prompt and itself, causally; a prompt only itself), and `where` [n, L]:
    the flat position in [B * W] of each row's token t. None where `prompt_units` is None
    (`pack` serves then)."""
    shared = prompt_units(input_ids, lengths, prompt_lengths)
    if shared is None:
        return None
    units, sizes = shared
    placed, bins = first_fit(sizes, max(sizes))
    B, W = len(bins), max(bins)
    n, L = input_ids.shape
    # built as Python lists, then one tensor each: a few hundred small tensor writes cost ~10 ms
    rows = input_ids.tolist()
    ids, positions, part = [0] * (B * W), [0] * (B * W), [0] * (B * W)  # part 0: a prompt, k: the k-th response
    unit = [-1] * (B * W)  # which unit a position is of
    where = [[0] * L for _ in range(n)]
    for u, ((p, members), (b, o)) in enumerate(zip(units, placed)):
        at = b * W + o
        ids[at:at + p] = rows[members[0]][:p]
        positions[at:at + p] = range(p)
        unit[at:at + sizes[u]] = [u] * sizes[u]
        for r in members:
            where[r][:p] = range(at, at + p)
        at += p
        for k, r in enumerate(members, start=1):
            m = lengths[r] - p
            ids[at:at + m] = rows[r][p:lengths[r]]
            positions[at:at + m] = range(p, p + m)
            part[at:at + m] = [k] * m
            where[r][p:lengths[r]] = range(at, at + m)
            at += m
    for b, used in enumerate(bins):  # a bin's unused end: a filler sequence of its own
        positions[b * W + used:(b + 1) * W] = range(W - used)
        unit[b * W + used:(b + 1) * W] = [len(units) + b] * (W - used)
    dev = input_ids.device
    ids, positions, unit, part = (torch.tensor(v, dtype=torch.long, device=dev).view(B, W) for v in (ids, positions, unit, part))
    where = torch.tensor(where, dtype=torch.long, device=dev)
    same_unit = unit[:, :, None] == unit[:, None, :]
    # query j sees key k: the same unit, k a prompt position or of j's own response, k <= j
    sees = same_unit & ((part[:, None, :] == 0) | (part[:, :, None] == part[:, None, :]))
    sees &= torch.ones((W, W), dtype=torch.bool, device=dev).tril()
    mask = torch.zeros((B, 1, W, W), dtype=dtype, device=dev).masked_fill(~sees[:, None], torch.finfo(dtype).min)
    return ids, positions, mask, where


@contextmanager
def _head_replaced(head, fn):
    """The output layer's forward replaced by `fn` for one model call. Inside the model's own
    forward, so a sharded model (FSDP) has gathered the layer's weights and reduces their
    gradients as it would for its logits."""
    head.forward = fn
    try:
        yield
    finally:
        del head.forward  # back to the class's forward


def _head_logprobs(hidden, head, select, targets, sampling, out, chunk_size, fp32_head, with_entropy_grad, want):
    h = hidden.flatten(0, 1)[select]
    weight, bias = head.weight, getattr(head, "bias", None)
    if fp32_head:
        h, weight = h.float(), weight.float()
        bias = None if bias is None else bias.float()
    N = h.shape[0]
    chunk = N if not chunk_size or chunk_size >= N else int(chunk_size)
    parts = []
    for a in range(0, N, chunk):
        b = min(a + chunk, N)
        args = (h[a:b], weight, bias, targets[a:b], *(None if s is None else s[a:b] for s in sampling),
                with_entropy_grad, want.top, None if want.at is None else want.at[a:b], want.below)
        if chunk < N and torch.is_grad_enabled():
            # keep only this chunk's hidden states for the backward; its logits are recomputed
            parts.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(*args))
    out["logp"] = torch.cat([p[0] for p in parts])
    out["entropy"] = torch.cat([p[1] for p in parts])
    out["extra"] = [torch.cat([p[i] for p in parts]) for i in range(2, len(parts[0]))]
    # what the model returns as its logits (unused): a small tensor, not [positions, vocab]
    return hidden.new_zeros(hidden.shape[:-1] + (1,))


def _chunk_logprobs(h, weight, bias, targets, temperature, top_p, top_k, with_entropy_grad, top=0, at=None, below=None):
    # the float32 logits in a list that _from_logits empties: passed as themselves, this frame's
    # reference (held for the call) kept the [N, V] tensor alive beside its log-softmax and entropy
    return _from_logits([F.linear(h, weight, bias).float()], targets, temperature, top_p, top_k, with_entropy_grad,
                        top, at, below)


def _from_logits(logits, targets, temperature, top_p, top_k, with_entropy_grad, top=0, at=None, below=None):
    """logits [N, V] float32 (or a list holding them, emptied here: the caller's frame then keeps
    no reference and the [N, V] tensor goes once its log-softmax is made) and targets [N] -> log
    p(target) [N], entropy [N]; then, when asked, the `top` most likely tokens' log-probs and ids
    [N, top] (among the ids < `below`) and the log of the mass outside them [N, 1], and the
    log-probs at `at` [N, k] and the log of the mass outside those [N, 1] (all of the distribution
    before the top-k / top-p cut)."""
    if isinstance(logits, list):
        logits = logits.pop()
    if not bool((temperature == 1).all()):  # dividing by 1 changes nothing but costs two passes over [N, V]
        logits = logits / temperature[:, None]
    keep = None
    uncut = logits if top or at is not None else None  # else nothing reads them after the cut
    if top_k is not None or top_p is not None:
        keep = sampling_set(logits, targets, top_p, top_k)
        if keep is not None:
            logits = logits.masked_fill(~keep, float("-inf"))
    # one fused log-softmax, kept for the backward (0.6 s less a micro-batch of 1,208 positions at
    # 151,936 on 2 CPU cores than logsumexp's max, subtract, exp and its backward's three passes)
    log_probs = torch.log_softmax(logits, dim=-1)
    del logits  # [N, V] float32 that nothing reads any more (the log-softmax keeps its output)
    logp, entropy = _TargetAndEntropy.apply(log_probs, targets, torch.is_grad_enabled() and with_entropy_grad)
    extra = []
    if top or at is not None:
        # distillation compares whole distributions: a cut would give a token the teacher ranks
        # high probability 0 under the student, and the forward KL to it infinity (without a cut
        # the log-softmax above is that distribution: no second [N, V] tensor)
        whole = log_probs if keep is None else torch.log_softmax(uncut, dim=-1)
        if top:
            ids = whole.detach()[:, :below]  # (the log-softmax stays over every row: the rest is their mass)
            values, indices = ids.topk(min(top, ids.shape[-1]), dim=-1)
            extra += [values, indices, _outside(whole.detach(), indices)]
        if at is not None:
            extra += [whole.gather(-1, at), _outside(whole, at)]
    return (logp, entropy, *extra)


class _TargetAndEntropy(torch.autograd.Function):
    """From log-probs [N, V]: the target's log-prob [N] (a gather) and the entropy -sum p log p [N],
    where a token of probability 0 (log-prob -inf: outside the top-k/top-p set, or a -inf logit of
    the model's own) adds 0 to the value and to the gradient, as 0 log 0 = 0 (torch.special.entr).
    Autograd's exp(lp) * lp made 0 x -inf = NaN of both; entr and xlogy have the right value but an
    infinite derivative at p = 0, NaN once multiplied by dp/dlp = p = 0.

    One Function for both so that each pass makes one [N, V] tensor besides the log-probs (which
    the log-softmax keeps already, and this keeps too): the forward's p log p, made in place in p;
    the backward's gradient, the entropy's made in place and the target's added into it. Autograd
    made three more at 151,936 wide: the clamped log-probs and p in the forward, a zero [N, V] for
    the gather's gradient and the sum of the two gradients in the backward. `entropy_grad` False:
    the entropy is a metric only, no gradient flows back from it."""

    @staticmethod
    def forward(ctx, log_probs, targets, entropy_grad):
        ctx.save_for_backward(log_probs, targets)
        ctx.entropy_grad = entropy_grad
        logp = log_probs.gather(-1, targets[:, None]).squeeze(-1)
        plogp = log_probs.exp().mul_(log_probs)
        # 0 x -inf = NaN where p = 0: 0 log 0 = 0 (a NaN log-prob, of a NaN logit, stays NaN)
        entropy = -plogp.masked_fill_(log_probs == float("-inf"), 0).sum(-1)
        ctx.mark_non_differentiable(*(() if entropy_grad else (entropy,)))
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        log_probs, targets = ctx.saved_tensors
        if ctx.entropy_grad and grad_entropy is not None:
            # d(-p lp)/d lp = -p (lp + 1) = -(p + p lp): 0 where p = 0 (0 + 0 x -inf is NaN: filled)
            p = log_probs.exp()
            grad = p.addcmul_(p, log_probs).masked_fill_(log_probs == float("-inf"), 0).mul_(-grad_entropy[:, None])
        else:
            grad = torch.zeros_like(log_probs)
        if grad_logp is not None:
            grad.scatter_add_(-1, targets[:, None], grad_logp[:, None])
        return grad, None, None


def _outside(log_probs, ids):
    """log of the probability outside `ids` [N, k], [N, 1]: a logsumexp over the other tokens, not
    log(1 - the mass of `ids`), which float32 cannot resolve below ~1e-7 of the mass (a confident
    model's usual remainder; the JSD's rest bucket then lost the forward KL's pull on it)."""
    return log_probs.scatter(-1, ids, float("-inf")).logsumexp(-1, keepdim=True)


def sampling_set(logits, targets, top_p, top_k):
    """[N, V] mask of the tokens top-k then top-p sampling may draw (None: every token)."""
    N, V = logits.shape
    dev = logits.device
    k = torch.full((N,), -1, device=dev) if top_k is None else top_k
    p = torch.ones(N, dtype=logits.dtype, device=dev) if top_p is None else top_p.to(logits.dtype)
    cut_k, cut_p = (k > 0) & (k < V), p < 1.0
    if not (cut_k.any() or cut_p.any()):
        return None
    ordered, order = logits.sort(-1, descending=True)
    # top-k: every token at least as likely as the k-th (transformers' and vLLM's samplers drop only
    # those strictly below it: a token tied with the k-th stays, and bfloat16 logits tie often)
    kth = ordered.gather(-1, (k.clamp(min=1, max=V) - 1)[:, None])
    in_k = ~cut_k[:, None] | (ordered >= kth)
    # top-p over the top-k distribution: keep a token while the probability of the tokens before
    # it is below p (so the set reaches p, and the most likely token always stays)
    probs = torch.softmax(ordered.masked_fill(~in_k, float("-inf")), dim=-1)
    before = probs.cumsum(-1) - probs
    in_p = ~cut_p[:, None] | (before < p[:, None])
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, order, in_k & in_p)
    return keep.scatter_(-1, targets[:, None], True)
