"""bf16 non-finite gradients of `dgpo-ops train --tokenizer chars` on H100: a minimal repro.

Cause: every RL batch has left-padded prompts, so the 4-D bool mask transformers builds for SDPA has query
rows that attend to no key (a left-pad query may only see earlier pads); their logsumexp is -inf. On
H100/H200 with torch >= 2.11, bf16 SDPA with an attn_mask dispatches to cuDNN, whose backward returns NaN in
grad_q when seq_len % 128 == 64 and some row's logsumexp < -88.7 (pytorch/pytorch#196678). RL batch length
is max prompt len + max completion len (e.g. 18 + 46 = 64), so whether a step fails depends on the sampled
completion lengths -> random failures. fp32 never uses cuDNN attention; CPU uses the math kernel.

  python bench/experiments/bf16_cudnn_attention_repro.py          # the real model, bf16 autocast, L=64: finite on CPU
  python bench/experiments/bf16_cudnn_attention_repro.py emulate  # CPU: the cuDNN bug's effect injected: 16/27 non-finite
  python bench/experiments/bf16_cudnn_attention_repro.py fix      # CPU: emulated bug, eager attention: finite
On a CUDA H100 with torch >= 2.11, run it without arguments: expected 16/27 non-finite with the default backends,
finite with cuDNN attention disabled (printed second; what `dgpo-ops train` now does on CUDA). Found on the CPU
from the first H100 session's symptoms (6 of 22 bf16 runs of `dgpo-ops train` with non-finite gradients in 16 of
27 parameters after the first RL step; docs/training.md says why: cuDNN's attention backend); confirmed on an H100
(2026-11-23, de21c71, csrc_notes.md's GPU run log, run 11): 16/27 non-finite, then 0/27
(results/bf16_cudnn_repro-h100-11.log).
"""
import sys

import torch
import torch.nn.functional as F
from dgpo_ops.trainer.app.tiny_model import build_char_tokenizer, build_tiny_model

mode = sys.argv[1] if len(sys.argv) > 1 else "real"
dev = "cuda" if torch.cuda.is_available() else "cpu"
tok = build_char_tokenizer()
tok.padding_side = "left"
model = build_tiny_model(tok, seed=0).to(dev)  # the CLI's tiny model: Qwen2, hidden 128, 2 layers, sdpa
if mode == "fix":
    model.config._attn_implementation = "eager"  # the fix: Qwen2Config(..., attn_implementation="eager")
print("attn:", model.config._attn_implementation, "| device:", dev, "| torch", torch.__version__)

# One RL micro-batch as TRL builds it: prompts left-padded (P=18), completions right-padded after eos (C=46).
prompts = ["Calculate 5 + 3.", "Calculate 48 + 16.", "Calculate 7 + 10."] * 2
enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
g = torch.Generator().manual_seed(0)
lens = torch.tensor([46, 12, 30, 5, 46, 20])
comp = torch.randint(0, 95, (6, 46), generator=g)
cmask = (torch.arange(46)[None] < lens[:, None]).long()
comp = comp.masked_fill(cmask == 0, tok.pad_token_id)
ids = torch.cat([enc["input_ids"], comp], 1).to(dev)
att = torch.cat([enc["attention_mask"], cmask], 1).to(dev)
print("L =", ids.shape[1], "| fully masked query rows (left pads):", int((enc["attention_mask"].cumsum(1) == 0).sum()))

real_sdpa = F.scaled_dot_product_attention


class CudnnBugSDPA(torch.autograd.Function):
    """Real SDPA; backward sets grad_q to NaN in rows with logsumexp < -88.7 when L % 128 == 64 (the cuDNN bug)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale):
        ctx.save_for_backward(q, k, v, mask)
        ctx.scale = scale
        return real_sdpa(q, k, v, attn_mask=mask, scale=scale)

    @staticmethod
    def backward(ctx, go):
        q, k, v, mask = ctx.saved_tensors
        with torch.enable_grad():
            q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))
            gq, gk, gv = torch.autograd.grad(real_sdpa(q_, k_, v_, attn_mask=mask, scale=ctx.scale), (q_, k_, v_), go)
        lse = ((q.float() @ k.float().transpose(-1, -2)) * ctx.scale).masked_fill(~mask, float("-inf")).logsumexp(-1)
        if q.shape[2] % 128 == 64:
            gq = gq.masked_fill((lse < -88.7)[..., None], float("nan"))
        return gq, gk, gv, None, None


if mode in ("emulate", "fix"):
    def patched(q, k, v, attn_mask=None, dropout_p=0.0, scale=None, is_causal=False, **kw):
        if attn_mask is None:
            return real_sdpa(q, k, v, dropout_p=dropout_p, scale=scale, is_causal=is_causal, **kw)
        return CudnnBugSDPA.apply(q, k, v, attn_mask, scale if scale is not None else q.shape[-1] ** -0.5)
    F.scaled_dot_product_attention = patched


def step():
    model.zero_grad(set_to_none=True)
    with torch.autocast(dev, dtype=torch.bfloat16):  # what accelerate does with bf16=True (fp32 master weights)
        logits = model(input_ids=ids, attention_mask=att, logits_to_keep=47).logits[:, :-1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, comp.to(dev)[..., None])[..., 0]
        m = cmask.to(dev).float()
        loss = -(lp * torch.linspace(-1, 1, 6, device=dev)[:, None] * m).sum() / m.sum()
    loss.backward()
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p.grad).all()]
    print(f"loss {loss.item():.4f} finite={torch.isfinite(loss).item()} | non-finite grads: {len(bad)}/27 {bad[:3]}")
    return len(bad)


n = step()
if dev == "cuda" and mode == "real":
    torch.backends.cuda.enable_cudnn_sdp(False)  # the fix on GPU
    print("with enable_cudnn_sdp(False):")
    step()
sys.exit(1 if n else 0)
