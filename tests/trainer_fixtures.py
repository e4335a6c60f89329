"""A tiny causal LM and tokenizer built in-process (no hub), saved so TRL can load them by path."""

from __future__ import annotations

import pathlib

WORDS = ("what is one two three four five six seven eight nine ten plus minus times equals the answer "
         "boxed yes no so then a an of and").split()


def build_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "<eos>", "<unk>"]
    vocab = {token: i for i, token in enumerate(special + WORDS + list("0123456789{}\\+-=?.,"))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(r"[0-9{}\\+\-=?.,]", behavior="isolated")]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def build_model_dir(path: pathlib.Path, seed: int = 0, tie_word_embeddings: bool = True,
                    hidden_size: int = 64) -> str:
    """The head dim is hidden_size / 4: vLLM's CPU attention needs at least 32 (hidden_size=128)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=tie_word_embeddings, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def prompt_dataset(n: int = 8):
    from datasets import Dataset

    prompts = [f"what is {a} plus {b} ?" for a, b in zip("1234567890", "9876543210")][:n]
    answers = [str(int(a) + int(b)) for a, b in zip("1234567890", "9876543210")][:n]
    return Dataset.from_dict({"prompt": prompts, "answer": answers})


def length_reward(prompts, completions, **kwargs):
    """A deterministic reward with spread within a group."""
    return [float(len(c) % 7) / 7.0 for c in completions]
