"""vLLM attention backends of vllm_accel (see ``registry.BACKENDS`` for the names)."""
