"""vllm_accel: inference acceleration for vLLM, loaded as a vLLM plugin.

Importing this package must stay cheap and must not import vLLM: the kernels in
``vllm_accel.kernels`` run on machines that have only torch and triton.
"""

__version__ = "0.1.0"

# The vLLM release this version of the plugin was built and tested against.
SUPPORTED_VLLM_VERSION = "0.32.0"
