"""Model-free speculative proposers (vLLM ``custom_class`` method)."""
