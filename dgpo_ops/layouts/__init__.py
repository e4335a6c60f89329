"""Where one call's tokens and vocabulary lie: packed sequences (cu_seqlens) and a vocabulary split across processes."""
