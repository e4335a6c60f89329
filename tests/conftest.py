import os

# The Triton kernels run on CPU tensors through the interpreter; it is chosen when a kernel is
# decorated, so it must be set before anything imports dgpo_ops.kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")
