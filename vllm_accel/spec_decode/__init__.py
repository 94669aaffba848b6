"""Model-free speculative proposers (vLLM ``custom_class`` method).

The dotted paths to give vLLM::

    --speculative-config '{"method": "custom_class",
                           "model": "vllm_accel.spec_decode.SAMProposer",
                           "num_speculative_tokens": 8}'

* ``vllm_accel.spec_decode.SAMProposer`` — suffix automata over the request and a corpus;
* ``vllm_accel.spec_decode.RecyclingProposer`` — token recycling (the target's own top-k
  successors of each token);
* ``vllm_accel.spec_decode.HybridProposer`` — per request and step, whichever of the two is
  expected to pay off, or no draft.
"""

from vllm_accel.spec_decode.hybrid_proposer import HybridProposer
from vllm_accel.spec_decode.recycling_proposer import RecyclingProposer
from vllm_accel.spec_decode.sam_proposer import SAMProposer

__all__ = ["HybridProposer", "RecyclingProposer", "SAMProposer"]
