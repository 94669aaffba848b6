"""Pure torch + triton kernels. No vLLM imports in this package."""
