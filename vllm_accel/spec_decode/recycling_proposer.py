"""RecyclingProposer: token recycling (model-free drafts from the target's own logits), for vLLM.

Use it through vLLM's ``custom_class`` method::

    --speculative-config '{"method": "custom_class",
                           "model": "vllm_accel.spec_decode.RecyclingProposer",
                           "num_speculative_tokens": 4}'
    --additional-config '{"vllm_accel": {"spec_decode": {"recycling_topk": 8}}}'   # optional

Every step the target model computes logits at each sampled position and at each verified
draft token. Before sampling, the ``proposer_target_logits`` runtime patch (applied when this
class is built, inside the model runner; upstream twin in ``patches/``) hands those rows to
:meth:`RecyclingProposer.observe_target_logits`, which stores each row's top-k token ids as the
successors of the row's input token in a :class:`~vllm_accel.spec_decode.recycling_table.
RecyclingTable` shared by all requests. Then, for each request that sampled a token, the draft
is the chain of first successors starting from that token, at most ``recycling_max_draft``
tokens (and ``num_speculative_tokens``, and what the model length leaves).

Drafts are verified by the target like any other (vLLM's rejection sampler treats them as
point masses), so outputs keep their distribution, and greedy output is unchanged. Token
Recycling proper verifies a tree of candidates; vLLM 0.32 verifies chains only, so this is the
chain of the tree's most likely branch.

A failure inside the proposer never fails a request: that step gets no drafts (or the table
is not updated), the traceback is logged once.
"""

from __future__ import annotations

import atexit
import os
from typing import Any

from vllm_accel import faults
from vllm_accel.config import load_section
from vllm_accel.log import get_logger
from vllm_accel.spec_decode.failsafe import LogOnce, drafts_or_none
from vllm_accel.spec_decode.knobs import MAX_DRAFT, SpecDecodeKnobs
from vllm_accel.spec_decode.recycling_table import RecyclingTable
from vllm_accel.spec_decode.runtime_patches import apply_patch, apply_sampling_fix

logger = get_logger("spec_decode")

_CLASS_PATH = "vllm_accel.spec_decode.RecyclingProposer"


class RecyclingProposer:
    """Speculative proposer over a shared token -> top-k successors table."""

    def __init__(self, vllm_config: Any, enable_patch: bool = True) -> None:
        k = vllm_config.speculative_config.num_speculative_tokens
        if not 1 <= k <= MAX_DRAFT:
            raise ValueError(
                f"--speculative-config num_speculative_tokens={k}: {_CLASS_PATH} drafts 1 to "
                f"{MAX_DRAFT} tokens; set num_speculative_tokens in that range (4 is a good "
                f"start)")
        self.num_speculative_tokens: int = k
        self.knobs: SpecDecodeKnobs = load_section("spec_decode", vllm_config.additional_config)
        model_config = vllm_config.model_config
        self.max_model_len: int = model_config.max_model_len
        vocab_size = model_config.get_vocab_size()
        path = self.knobs.recycling_table
        if path is not None and os.path.exists(path):
            self.table = RecyclingTable.load(path, vocab_size, self.knobs.recycling_topk)
            logger.info("RecyclingProposer: hot start from %s (%d tokens seen)", path,
                        self.table.num_seen)
        else:
            self.table = RecyclingTable(vocab_size, self.knobs.recycling_topk)
        if path is not None:
            atexit.register(self._save_table, path)
        self._once = LogOnce()
        self.logits_enabled = _enable_target_logits() if enable_patch else False
        logger.info("RecyclingProposer: num_speculative_tokens=%d, vocab=%d, topk=%d, "
                    "max_draft=%d", k, vocab_size, self.knobs.recycling_topk,
                    self.knobs.recycling_max_draft)

    # ------------------------------------------------------------------ vLLM hooks

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """vLLM's runners call this on every drafter; RecyclingProposer has no model."""

    def observe_target_logits(self, token_ids: Any, logits: Any) -> None:
        """Record the top-k of each logits row as the successors of ``token_ids[row]``
        (torch tensors ``[n]`` and ``[n, vocab]``, called by the runtime patch)."""
        try:
            import torch

            k = min(self.table.k, logits.shape[-1])
            topk = torch.topk(logits, k, dim=-1).indices
            self.table.update(token_ids.cpu().numpy(), topk.cpu().numpy())
        except Exception:
            self._once.error("observe", "RecyclingProposer could not record the target's "
                             "logits; this step does not update the table (outputs are "
                             "unaffected). Logged once.")

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: Any,
                *args: Any, **kwargs: Any) -> list[list[int]]:
        """vLLM's plain ``custom_class`` call: a draft per row that sampled a token."""
        return self.propose_rows(self.num_speculative_tokens, sampled_token_ids,
                                 num_tokens_no_spec)

    def propose_with_batch(self, num_speculative_tokens: int, input_batch: Any,
                           sampled_token_ids: list[list[int]]) -> list[list[int]]:
        """The call the ``proposer_input_batch`` patch makes (same drafts as :meth:`propose`,
        with the scheduler's draft budget)."""
        return self.propose_rows(num_speculative_tokens, sampled_token_ids,
                                 input_batch.num_tokens_no_spec)

    # ------------------------------------------------------------------ drafting

    def propose_rows(self, num_speculative_tokens: int, sampled_token_ids: list[list[int]],
                     num_tokens_no_spec: Any) -> list[list[int]]:
        """Drafts for each row (``[]`` where nothing was sampled); never raises."""
        return drafts_or_none(
            "RecyclingProposer", self._once, len(sampled_token_ids),
            lambda: self._propose(num_speculative_tokens, sampled_token_ids, num_tokens_no_spec))

    def _propose(self, num_speculative_tokens: int, sampled_token_ids: list[list[int]],
                 num_tokens_no_spec: Any) -> list[list[int]]:
        faults.maybe_inject("proposer")
        k = min(num_speculative_tokens, self.num_speculative_tokens,
                self.knobs.recycling_max_draft)
        drafts: list[list[int]] = []
        for row, sampled in enumerate(sampled_token_ids):
            budget = min(k, self.max_model_len - int(num_tokens_no_spec[row]) - 1)
            drafts.append(self.table.chain(int(sampled[-1]), budget)
                          if sampled and budget > 0 else [])
        return drafts

    # ------------------------------------------------------------------ upkeep

    def _save_table(self, path: str) -> None:
        try:
            self.table.save(path)
            logger.info("RecyclingProposer: table saved to %s", path)
        except Exception as exc:  # at exit: say why, never raise
            logger.warning("RecyclingProposer: could not save the table to %s (%s)", path, exc)



def _enable_target_logits() -> bool:
    """Apply the proposer_target_logits runtime patch (and the CPU sampling fix) in this
    (model-runner) process."""
    apply_sampling_fix("RecyclingProposer")
    return apply_patch("proposer_target_logits", "RecyclingProposer",
                       "it cannot see the target's logits, so the table stays empty and it "
                       "drafts nothing")
