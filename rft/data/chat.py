"""The chat template, rendered incrementally: the token ids each message adds to a conversation.

Used by the multi-turn workflow (rft/rollout/workflows/multi_turn.py), which holds conversations as token ids, and
by SFT on conversations (rft/data/readers.py, format.enable_concatenated_multi_turn). Imports nothing
that runs: a tokenizer is handed in.
"""

from __future__ import annotations

from rft.errors import ConfigError


def render(tok, messages: list[dict], generation_prompt: bool = False, tools: list[dict] | None = None) -> list[int]:
    # `tools`: function schemas in OpenAI's shape, which a template that knows them renders
    ids = tok.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=generation_prompt)
    if hasattr(ids, "keys"):  # transformers may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def stop_ids(tok) -> list[int]:
    """The ids that end a response (rft.models.load_tokenizer sets them: model.stop_token_ids, or
    the tokenizer's eos and the model's generation_config.json eos_token_id); a tokenizer loaded
    otherwise: its eos alone."""
    ids = getattr(tok, "rft_stop_ids", None)
    return list(ids) if ids is not None else [tok.eos_token_id]


def last_stop(tok, ids: list[int]) -> int | None:
    """The index of the last stop id in `ids`, or None."""
    stops = set(stop_ids(tok))
    return next((i for i in range(len(ids) - 1, -1, -1) if ids[i] in stops), None)


def turn_end_id(tok) -> int:
    """The stop id the chat template closes an assistant turn with (<|im_end|>, Llama-3's
    <|eot_id|>), which a response learnt by SFT ends with: the first stop id the template writes
    after a reply's content. A template that writes none (a base model's "assistant: {content}"):
    the tokenizer's eos, as ever."""
    stops = set(stop_ids(tok))
    if getattr(tok, "chat_template", None):
        history = [{"role": "user", "content": "1"}]
        start = render(tok, history, generation_prompt=True)
        full = render(tok, history + [{"role": "assistant", "content": "2"}])
        end = next((t for t in full[common_prefix(start, full):] if t in stops), None)
        if end is not None:
            return end
    return tok.eos_token_id


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def message_ids(tok, history: list[dict], message: dict, generation_prompt: bool) -> list[int]:
    """The ids the chat template adds for `message` after `history` (and the next generation
    prompt): the rendering of history + [message] after that of history. A template whose
    rendering of the history changes once the message is added cannot be held incrementally: a
    ConfigError naming the message."""
    before = render(tok, history)
    after = render(tok, history + [message], generation_prompt)
    if after[: len(before)] != before:
        at = common_prefix(before, after)
        raise ConfigError(
            f"the chat template renders the conversation's first {len(history)} messages differently once a "
            f"{message.get('role')!r} message follows (they differ at token {at}), so the conversation cannot be "
            f"held as token ids turn by turn. Use a template that renders each message on its own "
            f"(model.custom_chat_template)."
        )
    return after[len(before):]


def closing_ids(tok, history: list[dict], sampled: list[int], text: str) -> tuple[list[int], int | None]:
    """What the template writes after an assistant turn's sampled ids, and where (if anywhere) its
    rendering of the turn's text departs from them (None: it does not).

    The template renders history + [assistant: text]; after the generation prompt come the turn's
    ids: the sampled ones when the text re-encodes to them, then the rest (the newline after
    <|im_end|>, or <|im_end|> too when a stop string ended the turn)."""
    start = render(tok, history, generation_prompt=True)
    full = render(tok, history + [{"role": "assistant", "content": text}])
    turn = full[len(start):] if full[: len(start)] == start else full[common_prefix(start, full):]
    same = common_prefix(turn, sampled)
    if same == len(sampled):
        return turn[same:], None
    # the rendering departs from the sampled ids: keep them (what the engine sampled) and close
    # the turn with its end-of-turn token (unless a stop id ended it) and what the template puts
    # after that token
    end = last_stop(tok, turn)
    tail = turn[end + 1:] if end is not None else []
    close = turn[end] if end is not None else tok.eos_token_id
    return ([] if sampled and sampled[-1] in stop_ids(tok) else [close]) + tail, same


def conversation_ids(tok, messages: list[dict]) -> tuple[list[int], int, list[int]]:
    """A whole conversation (an SFT row's `messages`) as (ids, prompt_length, loss_mask): the loss
    mask (one entry per id after the prompt) is 1 on each assistant turn's content and its
    end-of-turn token, 0 on everything the template adds around them and on other roles' turns.
    The prompt is everything before the first assistant turn's content (its generation prompt
    included)."""
    if not any(m.get("role") == "assistant" for m in messages):
        raise ConfigError("the conversation has no assistant message to learn from")
    ids: list[int] = []
    mask: list[int] = []
    prompt_length = None
    for i, m in enumerate(messages):
        if m.get("role") == "assistant":
            start = render(tok, messages[:i], generation_prompt=True) if i else render(tok, [], True)
            head = start[len(ids):] if start[: len(ids)] == ids else None
            full = render(tok, messages[: i + 1])
            if head is None or full[: len(start)] != start:
                raise ConfigError(
                    f"the chat template renders messages[{i}] (assistant) so that the conversation before it "
                    f"changes; it cannot be trained turn by turn (use model.custom_chat_template)."
                )
            turn = full[len(start):]
            # train on the content and its end-of-turn token (the last stop id), not on what the
            # template adds after it
            end = last_stop(tok, turn)
            trained = end + 1 if end is not None else len(turn)
            ids += head
            mask += [0] * len(head)
            if prompt_length is None:
                prompt_length = len(ids)
            ids += turn
            mask += [1] * trained + [0] * (len(turn) - trained)
        else:
            delta = message_ids(tok, messages[:i], m, generation_prompt=False) if i else render(tok, [m])
            ids += delta
            mask += [0] * len(delta)
    return ids, prompt_length, mask[prompt_length:]
