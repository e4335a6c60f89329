"""The Triton kernels (installed as ``dgpo_ops.kernels``): from logits or from hidden states and the lm_head
weight, the sampled token's log-prob by an online log-sum-exp, the entropy in the same pass and d loss / d
logits, never a vocabulary-sized softmax; one file per kernel, each with its launcher, and a torch twin of
each (``torch_twins.py``). Imports nothing else of the package."""
