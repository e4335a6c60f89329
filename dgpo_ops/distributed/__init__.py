"""Routes that let sharding engines (FSDP2, ZeRO-3) serve the fused-linear op."""
