"""Model-free speculative proposers (vLLM ``custom_class`` method).

``vllm_accel.spec_decode.SAMProposer`` is the dotted path to give vLLM::

    --speculative-config '{"method": "custom_class",
                           "model": "vllm_accel.spec_decode.SAMProposer",
                           "num_speculative_tokens": 8}'
"""

from vllm_accel.spec_decode.sam_proposer import SAMProposer

__all__ = ["SAMProposer"]
