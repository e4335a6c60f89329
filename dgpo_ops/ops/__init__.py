"""The fused ops: the row pipeline both ops run, the logits op, the fused-linear op, the reference and the compiled custom ops."""
