"""One source for the docstrings of the public loss functions: each argument is described once here,
and ``documented`` composes a function's docstring from the arguments of its own signature."""

from __future__ import annotations

import inspect

ARGUMENTS = {
    "logits": "``(B, T, V)`` or ``(N, V)``, fp32, bf16 or fp16 (fp64 on the torch path); may be strided.",
    "hidden": "hidden states ``(B, T, H)`` or ``(N, H)`` entering the lm_head.",
    "weight": "the lm_head weight ``(V, H)``, or the lm_head module itself (``model.lm_head``; needed when an "
              "engine shards it, FSDP2 or DeepSpeed ZeRO-3: the op then runs as the module's forward, so the "
              "engine gathers the weight and reduces its gradient; its bias is used unless ``bias`` is given). "
              "A sharded DTensor weight is refused: pass the module.",
    "vocab_parallel_group": "a process group over which the vocabulary is split (tensor parallelism): every "
                            "process passes the same tokens and its equal share of the vocabulary, in rank order "
                            "(``V / P`` logits columns, or ``V / P`` rows of the lm_head weight and bias); the loss, "
                            "log-probs, entropies and metrics are the whole vocabulary's, the gradient this "
                            "process's share's (the hidden state's is summed over the group). 16 bytes per token "
                            "cross processes, never logits or weights: the row kernels' per-row partials, merged "
                            "by one all-reduce (``dgpo_ops/layouts/vocab.py``); None: not split.",
    "cu_seqlens": "packed (padding-free) sequences: ``(total_tokens, V)`` logits or ``(total_tokens, H)`` hidden "
                  "states with boundaries ``[0, len_0, len_0 + len_1, ..., total_tokens]`` (int32/int64, as "
                  "flash-attention and verl take them); per-token inputs ``(total_tokens,)``, advantages per token "
                  "(``(total_tokens,)`` or ``(1, total_tokens)``) or per sequence (``(B,)`` or ``(B, 1)``; where "
                  "``B`` equals the number of tokens, ``(B,)`` is an error that says which to pass); every "
                  "aggregation and GSPO as on the padded ``(B, max_seqlen)`` layout. The row kernels read the "
                  "packed rows where they are (``dgpo_ops/layouts/packed.py``); None: not packed.",
    "max_seqlen": "the longest packed sequence (the padded layout's width, which "
                  "``seq_mean_token_sum_norm`` divides by); None: read from ``cu_seqlens`` (a host read).",
    "bias": "the lm_head bias ``(V,)``, or None.",
    "target_ids": "sampled token ids ``(B, T)`` / ``(N,)``, int64 or int32; -100 marks positions not scored.",
    "advantages": "per token ``(B, T)`` or per response ``(B,)``.",
    "mask": "which tokens are scored (bool, 0/1 integers or floats); None: every token whose id is not -100.",
    "old_logps": "log-probs of the sampling policy; None means on-policy (ratio exactly 1).",
    "ref_logps": "log-probs of the reference model, for the k3 KL term (needed when ``beta != 0``).",
    "method": "a method of ``dgpo_ops.METHODS`` (or a ``MethodConfig``); its parameters are keywords "
              "(``method_params``).",
    "method_params": "the method's own parameters, e.g. ``eps_low``, ``eps_high``, ``n``, ``m`` (docs/methods.md: "
                     "the method table); unknown names raise ``ValueError``.",
    "temperature": "the logits are divided by it before the log-softmax.",
    "logit_scale": "the logits are ``logit_scale * (hidden @ weight.T + bias)``.",
    "softcap": "``softcap * tanh(logits / softcap)`` after the scale, as Gemma's final softcap; None: off.",
    "aggregation": "``token_mean``, ``seq_mean_token_mean``, ``seq_mean_token_sum_norm``, "
                   "``seq_sum_token_mean``, ``seq_mean_token_sum`` (TRL's luspo) or ``token_sum`` (verl's "
                   "token-sum) (flat ``(N, V)`` logits: token level only); None: the method's own where its "
                   "authors or framework fix one (dcpo: ``seq_sum_token_mean``, geo_mean: "
                   "``seq_mean_token_mean``), else ``token_mean``. A framework's own mode as its trainer divides: "
                   "``\"framework:mode\"`` (``\"roll:seq-mean-token-mean\"``, ``\"skyrl:token_mean\"``, ...; "
                   "``dgpo_ops.FRAMEWORK_AGGREGATIONS``, docs/normalization.md).",
    "loss_normalizer": "the token count ``token_mean`` divides by (a number or a one-element tensor, e.g. the "
                       "tokens of every micro-batch of the step); None: this call's scored tokens.",
    "beta": "weight of the k3 KL to ``ref_logps``.",
    "entropy_coef": "weight of the entropy bonus (the loss subtracts ``entropy_coef * H``).",
    "kl_ratio_correction": "multiply the KL term by the importance ratio (TRL's ``use_bias_correction_kl``), a bool.",
    "positive_nll_coef": "VAPO's positive-example NLL (NeMo-RL's ``positive_example_nll_weight``): the loss adds "
                         "``coef`` times the mean negative log-prob over the scored tokens of the responses whose "
                         "score is > 0 (needs ``scores``); 0: off.",
    "importance_sampling_level": "``token`` or ``sequence`` (GSPO: the ratio is the geometric mean over the "
                                 "response).",
    "rollout_weights": "per-token weights on the policy term (truncated importance sampling), or None; vespo "
                       "and geo_mean fold them into their sequence statistic instead, as TRL folds vLLM's "
                       "importance ratio and verl its rollout weights' geometric mean.",
    "rollout_logps": "the inference engine's per-token log-probs of the sampled tokens (shaped like "
                     "``target_ids``; NaN where the engine gave none, handled as the correction's framework does), "
                     "or None. With ``old_logps`` they give the mismatch metrics (``mismatch_kl_k1``, "
                     "``mismatch_kl_k3``, ``sampling_logp_difference_mean``/``_max``) and feed ``rollout_correction``.",
    "rollout_correction": "a ``dgpo_ops.corrections.RolloutCorrection``, each framework's modes under their own "
                          "names (``TrlCorrection``, ``VerlCorrection``, ``OpenRLHFCorrection``, "
                          "``NemoRLCorrection``, ``SkyRLCorrection``, ``SwiftCorrection`` (ms-swift), "
                          "``ArealCorrection``: docs/corrections.md), or None. It runs "
                          "before the loss on ``old_logps`` and ``rollout_logps`` (both required), giving the rollout "
                          "weights (so not together with ``rollout_weights``) and the rejections, which leave the "
                          "mask (the normaliser counts only the tokens kept).",
    "scores": "each response's score, ``(B,)`` (or per token; ``(n_seqs,)`` packed), or None: the methods that "
              "split responses by its sign read it (topr's positive and negative samples, as ROLL's episode "
              "score); where None the advantage's sign stands in. No gradient.",
    "entropy_weights": "per-token weights ``w`` of a second entropy term, outside the aggregation: the loss "
                       "subtracts ``sum w_t H_t`` over the scored tokens (TRL's entropy bonus, with its own tokens "
                       "and normaliser: ``w = coef * tokens / (count * accumulation)``), in the same passes; or None. "
                       "Padded or flat tokens, eager (not with ``vocab_parallel_group``, ``cu_seqlens`` or under "
                       "``torch.compile`` yet).",
    "generator": "what a method that selects tokens at random draws from (clip_cov), for repeatable runs: a "
                 "``torch.Generator`` on the logits' device; None: torch's default generator of that device. A "
                 "key is drawn for every position of the ``(B, T)`` grid, so the same state draws the same tokens "
                 "for the same grid (another padding draws others). With ``vocab_parallel_group`` the generator, "
                 "or the default one, must be in the same state on every process of the group (they must cut the "
                 "same tokens; nothing checks it). Not taken under ``torch.compile``.",
    "inplace": "write d(loss)/d(logits) into the logits' storage during backward (no extra logits-sized "
               "buffer); the logits must be a non-leaf you do not read again.",
    "memory_budget": "bytes of logits and gradient tiles alive at once (the token chunk follows from it).",
    "logits_on_chip": "False: cuBLAS products into logits tiles of ``memory_budget`` bytes; True: Triton kernels "
                      "that keep the logits in registers (no tiles, no weight copy under autocast, one more pass "
                      "of products, gradients summed with atomics; CUDA or the interpreter).",
    "backend": "``auto`` (Triton on CUDA, the kernels' torch twins on CPU), ``triton`` (on CPU tensors only under "
               "``TRITON_INTERPRET=1``) or ``torch``.",
    "validation": "``auto`` (immediate on CPU, deferred on CUDA), ``immediate`` or ``deferred``: deferred checks "
                  "never synchronise; a bad value makes the loss NaN and raises at a later call or at "
                  "``dgpo_ops.raise_deferred_errors()``.",
}

RETURNS = ("``PolicyLossOutput``: ``loss`` (a scalar, differentiable), per-token ``logps`` and ``entropy`` "
           "(fp32, detached, 0 on tokens not scored) and ``metrics`` (region fractions, EUR, ratio, entropy, KL; "
           "read lazily). Gradients come back in each input's dtype.")


def documented(summary: str, returns: str | None = None):
    """Give a function the docstring ``summary`` + its arguments (from ``ARGUMENTS``, in signature order, a
    method's ``self`` left out) + ``returns`` (default ``RETURNS``; ``""``: none, for a constructor). A
    parameter without an entry is an error at import."""

    def decorate(fn):
        lines = [summary.strip(), "", "Arguments:"]
        for name in inspect.signature(fn).parameters:
            if name == "self":
                continue
            if name not in ARGUMENTS:
                raise AssertionError(f"{fn.__name__}: no description of {name!r} in dgpo_ops.core.docstrings.ARGUMENTS")
            lines.append(f"* ``{name}``: {ARGUMENTS[name]}")
        if returns != "":
            lines += ["", f"Returns {RETURNS if returns is None else returns}"]
        fn.__doc__ = "\n".join(lines)
        return fn

    return decorate
