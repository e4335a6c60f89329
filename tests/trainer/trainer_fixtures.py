"""Tiny models and a tokenizer built in-process (no hub), saved so TRL can load them by path: a Qwen2 causal LM,
a Qwen3-MoE (router logits), a Qwen2.5-VL and a Gemma3 vision-language model; and the first-update harness that
compares DGPOTrainer with GRPOTrainer on the same weights and batch (tests/trainer/test_trainer_parity.py,
tests/trainer/test_trainer_conformance.py)."""

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
                    hidden_size: int = 64, **config_overrides) -> str:
    """The head dim is hidden_size / 4: vLLM's CPU attention needs at least 32 (hidden_size=128)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=tie_word_embeddings, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **config_overrides)
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


# ----------------------------------------------------------------------------- the first update, both trainers


def make_trainer(cls, config_cls, model_dir, tmp_path, **overrides):
    """A trainer of ``cls`` on the model in ``model_dir`` in train mode, its accumulation at 2 steps."""
    fields = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                  use_cpu=True, bf16=False, report_to=[], logging_steps=1, gradient_accumulation_steps=2)
    args = config_cls(**{**fields, **overrides})
    trainer = cls(model=model_dir, reward_funcs=length_reward, args=args, train_dataset=prompt_dataset(),
                  processing_class=build_tokenizer())
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    trainer.model.train()
    return trainer


def vision_inputs(model, batch_size: int, prompt_ids, generator):
    """Images of a Qwen2.5-VL or Gemma3 model in the prompts (written over ``prompt_ids``), as TRL's
    generation hands them to the loss: pixel values, grid or token types, images per sample."""
    import torch

    config = model.config
    inputs = {"num_images": [1] * batch_size}
    if config.model_type == "qwen2_5_vl":
        merge, temporal = config.vision_config.spatial_merge_size, config.vision_config.temporal_patch_size
        side = IMAGE_SIZE // PATCH
        prompt_ids[:, 0] = config.vision_start_token_id
        prompt_ids[:, 1:1 + side * side // merge**2] = config.image_token_id
        inputs["image_grid_thw"] = torch.tensor([[1, side, side]] * batch_size)
        inputs["pixel_values"] = torch.randn(batch_size * side * side, 3 * temporal * PATCH * PATCH,
                                             generator=generator)
    else:  # gemma3
        prompt_ids[:, 1:1 + config.mm_tokens_per_image] = config.image_token_id
        inputs["pixel_values"] = torch.randn(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
    return inputs


def first_update_batch(trainer, beta=0.0, vision=False, sampling=False, importance_sampling=None, seed=1,
                       advantages=(1.2, -0.7, 0.4, -1.5)):
    """A batch as TRL's generation hands it to the loss: 4 completions of 8 tokens (two of them shorter),
    old log-probs off the current ones (ratios spread over every region, so the loss depends on the
    weights), reference log-probs when ``beta``, vLLM's sampling log-probs (``sampling``) and importance
    ratios (``importance_sampling``: "token" (B, T) or "sequence" (B, 1)), images (``vision``)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    B, P, C = 4, 7, 8
    vocab = len(build_tokenizer())
    completion_mask = torch.ones(B, C, dtype=torch.long)
    completion_mask[1, 5:] = 0
    completion_mask[3, 2:] = 0
    inputs = {
        "prompt_ids": torch.randint(3, vocab, (B, P), generator=g),
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": torch.randint(3, vocab, (B, C), generator=g),
        "completion_mask": completion_mask,
        "advantages": torch.tensor(advantages),
        "num_items_in_batch": completion_mask.sum() * 2,
    }
    model = trainer.accelerator.unwrap_model(trainer.model)
    extra = vision_inputs(model, B, inputs["prompt_ids"], g) if vision else {}
    inputs.update(extra)
    with torch.no_grad():
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        mask = torch.cat([inputs["prompt_mask"], completion_mask], 1)
        if "pixel_values" in extra and model.config.model_type == "gemma3":
            inputs["token_type_ids"] = (input_ids == model.config.image_token_id).long()
        model_inputs = {k: v for k, v in inputs.items() if k in ("pixel_values", "image_grid_thw", "token_type_ids")}
        logits = model(input_ids=input_ids, attention_mask=mask, **model_inputs).logits[:, P - 1:-1]
        logps = torch.log_softmax(logits.float() / trainer.temperature, -1).gather(
            -1, inputs["completion_ids"][..., None])[..., 0]
    inputs["old_per_token_logps"] = logps - torch.randn(B, C, generator=g) * 0.8
    if beta:
        inputs["ref_per_token_logps"] = logps + torch.randn(B, C, generator=g) * 0.3
    if sampling:
        inputs["sampling_per_token_logps"] = inputs["old_per_token_logps"] + torch.randn(B, C, generator=g) * 0.5
    if importance_sampling == "token":  # 1 on padding, as TRL's generation makes them (exp of a masked difference)
        inputs["importance_sampling_ratio"] = torch.where(completion_mask.bool(), torch.rand(B, C, generator=g) * 1.5,
                                                          1.0)
    elif importance_sampling == "sequence":
        inputs["importance_sampling_ratio"] = torch.tensor([[0.5], [1.0], [0.0], [2.0]])
    return inputs


def loss_and_grads(trainer, inputs):
    """The loss of one micro-batch and the gradients it leaves (trainer._compute_loss, then backward)."""
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def build_dropout_model_dir(path: pathlib.Path, seed: int = 0) -> str:
    """A GPT-2 whose dropouts are nn.Dropout modules (TRL's disable_dropout sets their p to 0; Qwen2's attention
    dropout is a config value that it leaves alone)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=256, resid_pdrop=0.3,
                        embd_pdrop=0.3, attn_pdrop=0.3, pad_token_id=tokenizer.pad_token_id,
                        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)
    GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def build_granite_model_dir(path: pathlib.Path, seed: int = 0) -> str:
    """A Granite causal LM: its forward divides the logits by ``logits_scaling``."""
    import torch
    from transformers import GraniteConfig, GraniteForCausalLM

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = GraniteConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, logits_scaling=0.25,
                           pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    GraniteForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def build_moe_model_dir(path: pathlib.Path, seed: int = 0, **config_overrides) -> str:
    """A Qwen3-MoE (4 experts, 2 per token): its config has output_router_logits and router_aux_loss_coef."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
                            tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                            eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **config_overrides)
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


# Vision-language models: the tokenizer's vocabulary plus the image tokens, 16 x 16 images in patches of 4.
IMAGE_SIZE, PATCH = 16, 4


def build_vlm_model_dir(path: pathlib.Path, seed: int = 0) -> str:
    """A Qwen2.5-VL: a 1-block vision tower, merger 2 x 2, on a 2-layer text model. The image token, video
    token and vision start are the three ids after the tokenizer's vocabulary."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = build_tokenizer()
    vocab = len(tokenizer)
    torch.manual_seed(seed)
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab + 3, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=PATCH,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=32, window_size=8,
                           fullatt_block_indexes=[0]),
        image_token_id=vocab, video_token_id=vocab + 1, vision_start_token_id=vocab + 2, tie_word_embeddings=False)
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def build_gemma3_model_dir(path: pathlib.Path, seed: int = 0) -> str:
    """A Gemma3 vision-language model (SigLIP tower, 4 tokens per image, final logit softcapping): its
    prepare_inputs_for_generation takes **kwargs, so generate() checks keywords against the forward's signature."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tokenizer = build_tokenizer()
    vocab = len(tokenizer) + 3
    torch.manual_seed(seed)
    config = Gemma3Config(
        text_config=dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
                         sliding_window=16, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=None, final_logit_softcapping=30.0),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=IMAGE_SIZE, patch_size=PATCH),
        mm_tokens_per_image=4, image_token_index=vocab - 1, boi_token_index=vocab - 2, eoi_token_index=vocab - 3)
    Gemma3ForConditionalGeneration(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
