"""Loading models and tokenizers, and building the embedded tiny model.

Every model, the tiny one included, is loaded through `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` from a hub id or a local directory. `model=tiny` only adds a step
before that: if its directory does not exist yet, `build_tiny_model` writes a small, randomly
initialised Qwen2-architecture model and a character-level tokenizer there, in Hugging Face format.
"""

from __future__ import annotations

import json

import logging
import os
import string
from pathlib import Path

from rft import manifest
from rft.config import DTYPES as CONFIG_DTYPES
from rft.errors import ConfigError
from rft.registry import Registry

log = logging.getLogger(__name__)

# Bump when the tiny model's architecture or tokenizer changes: the cache is keyed on it.
TINY_VERSION = "v2"  # tiny_tools has its own directory name (conf/model/tiny_tools.yaml)

# One token per character keeps the arithmetic task short and the vocabulary tiny. Role names
# are single tokens so the chat template costs few positions.
_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
_ROLE_TOKENS = ["system", "user", "assistant"]
# Space and newline under their byte-level names (GPT-2's byte-to-unicode map: byte 0x20 is "Ġ", 0x0A
# "Ċ"): transformers loads this tokenizer as Qwen2's, whose pre-tokenizer turns each byte of the text
# into that map's character before the vocabulary is read, so a vocabulary holding " " and "\n"
# themselves (TINY_VERSION v1) dropped every space and newline of a prompt. Same ids (101, 102) as
# v1's " " and "\n": the model's random weights are the same. A tab and non-ASCII characters have no
# token (rft.data.readers warns where a prompt holds one).
_CHARS = [{" ": "\u0120", "\n": "\u010a"}.get(c, c)
          for c in string.digits + string.ascii_letters + string.punctuation + " \n"]

# No newline after the role or the end of a message (Qwen's template has both): v1's tokenizer
# dropped them, so the tiny model's prompts never held them, and every built-in task's ids (and the
# figures measured on them) stay those of v1. A newline inside a message is a token of its own.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}{{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"
)

# head_dim must be >= 32: vLLM's CPU attention rejects smaller heads.
TINY_ARCH = dict(
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=32,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)


def _quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


# model=tiny_tools: the same model with a "tool" role, <tool_call> </tool_call>, and the calculator
# call's JSON around its expression as two tokens, as a BPE vocabulary merges frequent strings: a
# call costs 4 tokens and the expression's characters, so the digits the model copies from the
# question sit a dozen positions back, a distance the tiny model learns (at ~50, one character
# per token, 200 warm-up steps did not). The chat template renders every role alike, the tool's
# answers included: <|im_start|>tool{answer}<|im_end|>
_TOOL_TOKENS = ["tool", "<tool_call>", "</tool_call>", '{"name":"calculator","arguments":{"expression":"', '"}}']
# Its template also renders what an OpenAI client sends (rft/serving/openai_api.py): `tools` as one
# system line of signatures, "tools:add(a,b);upper(text)" (a tool's JSON schema, ~100 characters a
# tool at one token each, would not fit 256 positions), and an assistant turn's `tool_calls` as the
# model writes them, <tool_call>{"name":"add","arguments":{"a":1}}</tool_call>, compact, so a reply
# sent back renders to the ids that were sampled. Without tools it renders as CHAT_TEMPLATE does.
TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>systemtools:{% for t in tools %}{% set f = t.function if t.function is defined else t %}"
    "{{ f.name }}({{ (f.parameters.properties if f.parameters is defined and f.parameters.properties is defined "
    "else {}) | join(',') }}){% if not loop.last %};{% endif %}{% endfor %}<|im_end|>{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% for c in (m['tool_calls'] if m['tool_calls'] is defined and m['tool_calls'] else []) %}"
    "{% set f = c.function if c.function is defined else c %}<tool_call>{\"name\":\"{{ f.name }}\",\"arguments\":"
    "{% if f.arguments is string %}{{ f.arguments }}{% else %}{{ f.arguments | tojson(separators=(',', ':')) }}"
    "{% endif %}}</tool_call>{% endfor %}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"
)


def build_tiny_model(path: str | Path, seed: int = 0, arch: dict | None = None, tools: bool = False,
                     dtype: str = "float32", extra_tokens: list[str] | tuple = ()) -> Path:
    """Write the tiny Qwen2 model and its tokenizer to `path` (atomically, sealed: a damaged one is
    built again, rft/manifest.py; safe to race).

    `arch` overrides entries of TINY_ARCH (a larger model for benchmarks, a narrow one for tests,
    a vocabulary larger than the tokenizer's); `tools` adds the tool role and tool-call tokens
    (model=tiny_tools); `dtype`: the weights' dtype on disk; `extra_tokens`: strings added as one
    token each (model.extra_tokens).
    """
    path = Path(path).expanduser()
    if manifest.verify(path) is None:  # built and whole: the driver of a Ray run need not import torch
        return path
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    _quiet_transformers()
    path.parent.mkdir(parents=True, exist_ok=True)
    with manifest.build_lock(path, "tiny model"):
        if manifest.whole(path, "tiny model"):  # one damaged is moved aside
            return path
        vocab = {tok: i for i, tok in enumerate(_SPECIAL_TOKENS + _ROLE_TOKENS + _CHARS)}
        backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        backend.decoder = decoders.Fuse()
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=backend,
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            unk_token="<unk>",
            additional_special_tokens=["<|im_start|>"],
            chat_template=TOOLS_CHAT_TEMPLATE if tools else CHAT_TEMPLATE,
        )
        # plain (not special) tokens: decoding with skip_special_tokens keeps them in the text
        tokenizer.add_tokens(_ROLE_TOKENS + (_TOOL_TOKENS if tools else []) + list(extra_tokens))
        config = Qwen2Config(**{"vocab_size": len(tokenizer), **TINY_ARCH, **(arch or {})},
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                             bos_token_id=None)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
        tmp = path.with_name(path.name + ".tmp")
        manifest.clear(tmp)  # a killed build's leftovers; a link there goes, never its target
        tmp.mkdir()  # made here: one planted in its place since is an error, not a folder written into
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        manifest.install(tmp, path, "tiny model")
        n = sum(p.numel() for p in model.parameters())
        log.info("built the tiny model (%d parameters) at %s", n, path)
    return path


def build_tiny_tools_model(path: str, extra_tokens: list[str] | tuple = ()) -> Path:
    """The tiny model with a `tool` role and the tool-call tokens (model=tiny_tools)."""
    return build_tiny_model(path, tools=True, extra_tokens=extra_tokens)


# model=qwen2.5-0.5b-shape: Qwen2.5-0.5B's architecture (494M parameters, vocabulary 151,936)
# with random weights and the tiny model's tokenizer, built here: what a real model's size costs
# (memory, time) measured offline. It samples ids the tokenizer does not have and learns nothing.
QWEN05_ARCH = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                   num_key_value_heads=2, head_dim=64, vocab_size=151936, max_position_embeddings=32768,
                   rms_norm_eps=1e-6, tie_word_embeddings=True)


def build_qwen05_shape_model(path: str) -> Path:
    """Qwen2.5-0.5B's shape, random weights in bfloat16 (1 GB on disk), the tiny tokenizer."""
    return build_tiny_model(path, arch=QWEN05_ARCH, dtype="bfloat16")


# model=qwen2.5-1.5b-shape: Qwen2.5-1.5B's architecture (1.54B parameters), built the same way
QWEN15_ARCH = dict(QWEN05_ARCH, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                   num_attention_heads=12, head_dim=128)


def build_qwen15_shape_model(path: str) -> Path:
    """Qwen2.5-1.5B's shape, random weights in bfloat16 (3.1 GB on disk), the tiny tokenizer."""
    return build_tiny_model(path, arch=QWEN15_ARCH, dtype="bfloat16")


# model.builder: name -> fn(model_path), which builds the model there
BUILDERS = Registry("model.builder", {"tiny": "rft.models.build_tiny_model",
                                     "tiny_tools": "rft.models.build_tiny_tools_model",
                                     "qwen2.5-0.5b-shape": "rft.models.build_qwen05_shape_model",
                                     "qwen2.5-1.5b-shape": "rft.models.build_qwen15_shape_model"})


def not_built_here(model_path) -> bool:
    """Whether `model_path` holds a model no builder made: a checkpoint's hf/, an export, a copy of
    either (`model=tiny model.model_path=<run>/<stage>/checkpoints/step_N/hf` keeps the builder).
    The builder took such a folder for an older or damaged build of its own and moved the trained
    weights aside for random ones; it is the user's model, started from as it is."""
    path = Path(os.path.expanduser(str(model_path)))
    if not (path / "config.json").is_file():
        return False
    found, damaged = manifest.read(path)
    if damaged:  # whose it is cannot be read: the builder's check moves it aside (kept) and says so
        return False
    return found is None or "built" not in found["identity"]


def missing_checkpoint(model_cfg) -> None:
    """A ConfigError for a model.model_path of a checkpoint that is not there (<stage>/checkpoints/step_N,
    or its hf/): a mistyped step, where the builder would write a random model and the run train from
    it, exit 0."""
    path = Path(os.path.expanduser(str(model_cfg.model_path)))
    step = path.parent if path.name == "hf" else path
    if path.exists() or not (step.name.startswith("step_") and step.parent.name == "checkpoints"):
        return
    # those with a model: a mode=explore stage's, or one saved without hf/ (trainer.save_hf_checkpoint), has none
    there = sorted((d for d in step.parent.glob("step_*") if d.name[5:].isdigit() and (d / "manifest.json").is_file()
                    and (d / "hf").is_dir()), key=lambda d: int(d.name[5:]))
    which = (f"The checkpoints there: {', '.join(d.name for d in there)}; start from one's hf/ "
             f"({there[-1] / 'hf'})" if there else "It holds no complete checkpoint with a model (its hf/ beside a "
             "manifest.json)")
    gone = (f"{step} holds no hf/ (a checkpoint saved without its model)" if step.is_dir()
            else f"{step.parent} has no {step.name}")
    raise ConfigError(f"model.model_path={str(model_cfg.model_path)!r} does not exist: {gone}. {which}. "
                      f"model.builder={model_cfg.builder} builds a random model only where there is none yet, never in "
                      f"a run's checkpoints.")


def ensure_model(model_cfg) -> None:
    """Build the model if its config names a builder and the directory is missing (or holds a
    build of its own that is damaged)."""
    if model_cfg.builder is None:
        return
    if model_cfg.builder not in BUILDERS:
        raise ConfigError(
            f"model.builder={model_cfg.builder!r} is not a known builder; "
            f"choose one of {sorted(BUILDERS)} or set model.builder=null for a hub id or local path."
        )
    extra = list(model_cfg.get("extra_tokens") or [])
    if not_built_here(model_cfg.model_path):
        # a checkpoint's hf/ or an export keeps the tokens its run was built with; one without these
        # spelt them character by character, without a word
        missing = _not_in_tokenizer(model_cfg.model_path, extra)
        if missing:
            raise ConfigError(
                f"model.model_path={model_cfg.model_path} holds a model rft did not build here (a checkpoint's hf/, "
                f"an export) whose tokenizer has not the model.extra_tokens {missing}: they are added only when the "
                f"tiny model is built. Give model.extra_tokens as the run that trained it had them, or start from a "
                f"model built with these.")
        return
    missing_checkpoint(model_cfg)
    if not extra:
        BUILDERS[model_cfg.builder](model_cfg.model_path)
        return
    if model_cfg.builder not in ("tiny", "tiny_tools"):
        raise ConfigError(f"model.extra_tokens is for model.builder tiny or tiny_tools (the tokenizer the project "
                          f"builds); model.builder={model_cfg.builder} keeps its own. Leave extra_tokens empty.")
    path = BUILDERS[model_cfg.builder](model_cfg.model_path, extra_tokens=extra)
    # a model built before with other extra tokens: its tokenizer would spell these character by character
    missing = _not_in_tokenizer(path, extra)
    if missing:
        raise ConfigError(
            f"model.model_path={model_cfg.model_path} holds a tiny model built without the model.extra_tokens "
            f"{missing}: a model is built once per directory. Give model.model_path a new directory (it is "
            f"built there on first use), or delete this one.")


def _not_in_tokenizer(path, extra: list[str]) -> list[str]:
    """Which of `extra` the tokenizer.json in `path` does not hold as added tokens (none read where
    `extra` is empty or there is no tokenizer.json)."""
    tokenizer = Path(os.path.expanduser(str(path))) / "tokenizer.json"
    if not extra or not tokenizer.is_file():
        return []
    try:
        added = json.loads(tokenizer.read_text()).get("added_tokens", [])
    except (ValueError, AttributeError):  # not a tokenizer's JSON: loading it says so
        return []
    return sorted(set(extra) - {t.get("content") for t in added if isinstance(t, dict)})


def torch_dtype(name: str) -> torch.dtype:
    """model.dtype or one of its aliases (rft.config.DTYPES) -> the torch dtype."""
    import torch

    if name not in CONFIG_DTYPES:
        raise ConfigError(f"model.dtype={name!r} is not a dtype; choose one of {', '.join(CONFIG_DTYPES)}.")
    return getattr(torch, CONFIG_DTYPES[name])


def canonical_dtype(name: str) -> str:
    """"bf16" -> "bfloat16": the name other libraries (vLLM) take."""
    return str(torch_dtype(name)).removeprefix("torch.")


def local_device(cluster_cfg) -> torch.device:
    """Where this process computes: the GPU it sees on a GPU cluster (cluster.gpu_per_node > 0;
    Ray shows each actor only the GPUs the placement gave it), else the CPU."""
    import torch

    if cluster_cfg.gpu_per_node > 0 and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def peak_memory(device) -> int:
    """Bytes at this process's peak: on a GPU what torch allocated there, on CPU the resident set
    (Linux reports it in KiB, macOS in bytes: KiB there would show a 100 MB process as 100 GB);
    what rft.plan.memory's estimate is checked against."""
    import sys

    import torch

    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def _not_loadable(path: str, e: Exception, key: str = "model.model_path") -> ConfigError:
    return ConfigError(
        f"{key}={path!r} could not be loaded ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). "
        f"Give a local directory in Hugging Face format (relative paths are relative to {os.getcwd()}) "
        f"or a hub id this machine can reach."
    )


def load_tokenizer(model_cfg, chat: bool = True):
    """The model's tokenizer; `chat`: every prompt is rendered with its chat template, so one that
    is missing or fails on a plain conversation is an error here, before any step."""
    from transformers import AutoTokenizer

    _quiet_transformers()
    try:
        tok = AutoTokenizer.from_pretrained(
            os.path.expanduser(model_cfg.model_path), trust_remote_code=model_cfg.trust_remote_code
        )
    # OSError: transformers' "not a local folder and not a valid model identifier"; ValueError: a
    # folder without tokenizer files ("Couldn't instantiate the backend tokenizer")
    except (OSError, ValueError) as e:
        raise _not_loadable(model_cfg.model_path, e) from e
    if model_cfg.custom_chat_template:
        tok.chat_template = model_cfg.custom_chat_template
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    # carried by the tokenizer, which every engine, workflow and reader is handed
    # (rft.data.chat.stop_ids reads it)
    tok.rft_stop_ids = stop_token_ids(model_cfg, tok)
    if chat:
        check_chat_template(tok, model_cfg)
    return tok


def check_tokenizer_here(model_cfg) -> None:
    """The dry run's look at the policy's chat template, which every prompt is rendered with: a
    ConfigError (check_chat_template's) where the model is a local directory whose tokenizer can
    be read without its weights. A base model without one was found only by the run, when its
    actors loaded it. Nothing is read for a hub id (a download) or a directory the project builds
    (model.builder: its tokenizer has a template), nor where no tokenizer is there yet (the plan
    says what is missing)."""
    path = Path(os.path.expanduser(str(model_cfg.model_path)))
    if model_cfg.builder is None and (path / "tokenizer_config.json").is_file():
        load_tokenizer(model_cfg)


def stop_token_ids(model_cfg, tok) -> list[int]:
    """The ids that end a response: model.stop_token_ids, or (null) the tokenizer's eos and the
    eos_token_id (an id or a list) of the model's generation_config.json, or of its config.json
    where it has none: what vLLM stops on by itself (its try_get_generation_config).

    An instruct model's turn can end with a token other than its tokenizer's eos: Qwen2.5-Instruct
    lists [151645 <|im_end|>, 151643 <|endoftext|>], Llama-3.x-Instruct [128001, 128008, 128009
    <|eot_id|>] while some of its tokenizer versions name <|end_of_text|>. The hf engine stopped on
    the tokenizer's alone, generating past the turn's end to max_tokens where vLLM stopped."""
    from transformers import AutoConfig, GenerationConfig

    given = model_cfg.get("stop_token_ids")
    if given is not None:
        bad = [i for i in given if not 0 <= i < len(tok)]
        if bad:
            what = "is not an id" if len(bad) == 1 else "are not ids"
            raise ConfigError(
                f"model.stop_token_ids={list(given)}: {', '.join(map(str, bad))} {what} of the tokenizer of "
                f"model.model_path={model_cfg.model_path!r} (0..{len(tok) - 1}). Give the ids of the tokens that "
                f"end a turn (tokenizer.convert_tokens_to_ids('<|eot_id|>')), or null for the tokenizer's eos and "
                f"the model's generation_config.json eos_token_id.")
        return list(given)
    path = os.path.expanduser(model_cfg.model_path)
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError as e:  # no generation_config.json (a damaged one is not read as none: the stops would change)
        written = Path(path, "generation_config.json")
        if written.is_file():
            raise ConfigError(f"{written} is not a generation config transformers can read ({e}); the ids that end a "
                              f"response come from its eos_token_id. Restore the file from the model's source, or "
                              f"set model.stop_token_ids to those ids.") from None
        try:
            eos = GenerationConfig.from_model_config(
                AutoConfig.from_pretrained(path, trust_remote_code=model_cfg.trust_remote_code)).eos_token_id
        except (OSError, ValueError):  # no config.json either (a tokenizer alone)
            eos = None
    ids = [tok.eos_token_id] + (eos if isinstance(eos, (list, tuple)) else [eos])
    return list(dict.fromkeys(i for i in ids if i is not None))


def check_chat_template(tok, model_cfg) -> None:
    """The tokenizer renders a one-question conversation (transformers would raise a ValueError or a
    Jinja error at the first prompt, as a traceback)."""
    whose = ("model.custom_chat_template" if model_cfg.custom_chat_template else
             f"the chat template of model.model_path={model_cfg.model_path!r}")
    if not tok.chat_template:
        raise ConfigError(
            f"model.model_path={model_cfg.model_path!r}: its tokenizer has no chat template, and every prompt is "
            f"rendered with one (a base model's tokenizer often has none). Set model.custom_chat_template to a "
            f"Jinja template, e.g. \"{{% for m in messages %}}{{{{ m['role'] }}}}: {{{{ m['content'] }}}}\\n"
            f"{{% endfor %}}{{% if add_generation_prompt %}}assistant: {{% endif %}}\", or use the model's "
            f"instruct variant.")
    try:
        tok.apply_chat_template([{"role": "user", "content": "1+1"}], tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja2's TemplateError, or what the template raises itself
        at = f" at line {e.lineno}" if getattr(e, "lineno", None) else ""
        raise ConfigError(
            f"{whose} fails on a one-message conversation ({type(e).__name__}{at}: {e}). Fix the template "
            f"(or set model.custom_chat_template to one that renders).") from None


def load_model(model_cfg, path: str | None = None, dtype=None, key: str = "model.model_path"):
    """Load a causal LM from `path` (default: model.model_path), in `dtype` (default: model.dtype)."""
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            os.path.expanduser(path or model_cfg.model_path),
            dtype=dtype or torch_dtype(model_cfg.dtype),
            trust_remote_code=model_cfg.trust_remote_code,
            # (a config built by hand may lack the key: transformers' default)
            **({"attn_implementation": a} if (a := model_cfg.get("attn_implementation")) else {}),
        )
    except OSError as e:
        raise _not_loadable(path or model_cfg.model_path, e, key) from e
    # Dropout would make recomputed log-probs differ from the sampling ones.
    model.eval()
    return model


def load_teacher(model_cfg, path: str, student_tokenizer):
    """On-policy distillation's teacher (algorithm.teacher_model_path), frozen, in model.dtype. It
    reads the student's token ids, so its tokenizer must be the student's: the same token for every
    id (its embedding matrix may be padded to another size: Qwen2.5-7B's has 152,064 rows, 0.5B's
    151,936, one tokenizer). A ConfigError otherwise, naming the first id that differs."""
    from transformers import AutoTokenizer

    _quiet_transformers()
    try:
        tok = AutoTokenizer.from_pretrained(os.path.expanduser(path), trust_remote_code=model_cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise _not_loadable(path, e, "algorithm.teacher_model_path") from e
    mine, theirs = student_tokenizer.get_vocab(), tok.get_vocab()
    if mine != theirs:
        by_id = {i: t for t, i in theirs.items()}
        diff = next((f"id {i} is {t!r} for the student, {by_id.get(i)!r} for the teacher"
                     for t, i in sorted(mine.items(), key=lambda kv: kv[1]) if by_id.get(i) != t),
                    f"the teacher has {len(theirs) - len(mine)} more tokens")
        raise ConfigError(
            f"algorithm.teacher_model_path={path!r} has another tokenizer than the policy ({model_cfg.model_path}): "
            f"{diff}. On-policy distillation scores the student's own token ids, so the teacher must share its "
            f"tokenizer (a larger model of the same family does)."
        )
    model = load_model(model_cfg, path, key="algorithm.teacher_model_path")
    rows, tokens = model.get_input_embeddings().num_embeddings, len(student_tokenizer)
    if rows < tokens:  # (more rows is padding, as above; fewer: an IndexError in the first step)
        raise ConfigError(
            f"algorithm.teacher_model_path={path!r} has {rows} rows in its input embedding, fewer than the {tokens} "
            f"tokens of its tokenizer (the policy's): it cannot read the ids {rows} to {tokens - 1}, which the policy "
            f"may sample. Give a teacher whose embedding covers its tokenizer (a model saved after "
            f"resize_token_embeddings)."
        )
    model.requires_grad_(False)
    return model


def load_reward_head(model_cfg, path: str | None, tokenizer, dtype=None):
    """A reward model to train (algorithm=rm): the causal LM at `path` (default model.model_path) as
    AutoModelForSequenceClassification with one output, its head new (seeded by the caller) unless
    the checkpoint has one (a resumed run). It scores a row at its last token that is not the pad
    token, so pad_token_id is the tokenizer's (right padding): what the reward_model part's
    kind=classifier reads back (rft/rewards/reward_model.py)."""
    from transformers import AutoModelForSequenceClassification

    _quiet_transformers()
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            os.path.expanduser(path or model_cfg.model_path), num_labels=1,
            dtype=dtype or torch_dtype(model_cfg.dtype), trust_remote_code=model_cfg.trust_remote_code)
    except OSError as e:
        raise _not_loadable(path or model_cfg.model_path, e) from e
    model.config.pad_token_id = tokenizer.pad_token_id
    model.eval()  # no dropout, as for the policy
    return model


def enable_gradient_checkpointing(model) -> None:
    """Recompute each transformer block's activations in the backward instead of keeping them.

    transformers checkpoints a block only in training mode, and our models stay in eval mode
    (no dropout: recomputed log-probs must equal the sampling ones). So the flag is set on the
    blocks alone, not on their children: a block's `training` gates nothing but checkpointing,
    the attention and MLP inside stay in eval mode. Non-reentrant, as FSDP2 needs."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    blocks = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not blocks:
        raise ConfigError(f"trainer.gradient_checkpointing=true: {type(model).__name__} has no blocks that "
                          f"transformers can checkpoint. Set trainer.gradient_checkpointing=false.")
    for m in blocks:
        m.training = True


# dense bf16 peak FLOP/s of GPUs by name (vendors' datasheets), for the MFU estimate
_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12,
               "L40S": 362e12, "L4": 121e12, "A10": 125e12, "RTX 4090": 165e12}


def peak_flops(device) -> float | None:
    """The device's peak (None where unknown, e.g. a CPU: no perf/mfu then)."""
    if device.type != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    return next((v for k, v in _PEAK_FLOPS.items() if k in name), None)


def load_hf_weights(model, hf_dir) -> None:
    """Load a checkpoint's `hf/` weights (one file or shards) into `model` in place.

    save_pretrained writes tied weights once, so those may be missing; anything else missing or
    unexpected means the checkpoint is of another model.
    """
    from rft.sync.weights import hf_tensors

    missing, unexpected = model.load_state_dict(dict(hf_tensors(hf_dir)), strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if unexpected or any(k not in tied for k in missing):
        raise RuntimeError(f"checkpoint {hf_dir} does not match the model: missing {missing}, unexpected {unexpected}")
