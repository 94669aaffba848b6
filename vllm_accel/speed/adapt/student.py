"""Teacher and student of SPEED self-distillation, on one teacher-forced sequence.

A sequence is a prompt of ``P`` tokens followed by ``C`` decode tokens (an answer or a text
continuation). The **teacher** is the dense model. The **student** is the same model under the
SPEED visibility rule: the lower layers are dense, so their output is the teacher's; the upper
layers run only on the upper-active rows (:func:`vllm_accel.speed.policy.upper_positions`) with
:func:`vllm_accel.speed.reference.run_layers` -- the oracle's own layer runner, so training and
the token-for-token oracle cannot drift apart. Positions ``P-1 .. P+C-2`` are the decode-phase
predictions (of tokens ``P .. P+C-1``): that is where the loss is taken.

Only the upper layers are adapted (the default, and what this module supports), so the student's
input at the cut -- the teacher's hidden state entering layer ``num_lower`` at those rows -- is
computed once per example and cached (:func:`teacher_features`); a training step then costs the
upper layers on ``~C`` rows, not the whole model on ``P + C`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm_accel.speed.policy import upper_positions
from vllm_accel.speed.reference import LayerCache, run_layers


@dataclass
class Features:
    """What one example contributes to training (all on CPU, small: ``~C`` rows)."""

    cut_hidden: torch.Tensor  # [R, H] hidden state entering layer num_lower, upper-active rows
    positions: torch.Tensor  # [R] their positions
    loss_rows: torch.Tensor  # [K] indices into the R rows that predict a decode token
    teacher_hidden: torch.Tensor  # [K, H] the dense model's final (normed) hidden state there
    kind: str = ""


@torch.no_grad()
def teacher_features(model, ids: list[int], prompt_len: int, num_lower: int,
                     anchor_tokens: int, kind: str = "") -> Features:
    """One dense forward of ``ids`` (prompt + continuation) gives everything the student needs."""
    if not 1 <= prompt_len < len(ids):
        raise ValueError(f"need a prompt and at least one continuation token "
                         f"(prompt {prompt_len}, total {len(ids)})")
    device = model.device
    tokens = torch.as_tensor(ids, device=device)[None]
    out = model.model(input_ids=tokens, output_hidden_states=True, use_cache=False)
    hidden = out.hidden_states  # [0] embeddings, [i] input of layer i, [-1] final normed
    rows = torch.tensor(upper_positions(len(ids), prompt_len, anchor_tokens), device=device)
    predicting = (rows >= prompt_len - 1) & (rows <= len(ids) - 2)
    loss_rows = torch.nonzero(predicting).flatten()
    return Features(hidden[num_lower][0, rows].float().cpu(), rows.cpu(), loss_rows.cpu(),
                    hidden[-1][0, rows[loss_rows]].float().cpu(), kind)


def student_hidden(model, features: Features, num_lower: int) -> torch.Tensor:
    """The student's final normed hidden state ``[K, H]`` at the loss rows (differentiable)."""
    device, dtype = model.device, model.model.norm.weight.dtype
    h = features.cut_hidden.to(device, dtype)[None]
    caches = [LayerCache() for _ in model.model.layers]
    h = run_layers(model, h, features.positions.to(device), caches,
                   range(num_lower, len(model.model.layers)))
    return model.model.norm(h)[0, features.loss_rows.to(device)]


def distillation_loss(model, features: Features, num_lower: int,
                      hidden_weight: float = 0.0) -> torch.Tensor:
    """KL(teacher || student) of the next-token distributions at the decode-phase positions,
    plus ``hidden_weight`` x the relative squared error of the final hidden states."""
    student = student_hidden(model, features, num_lower)
    teacher = features.teacher_hidden.to(student.device, student.dtype)
    with torch.no_grad():
        teacher_logp = F.log_softmax(model.lm_head(teacher).float(), dim=-1)
    student_logp = F.log_softmax(model.lm_head(student).float(), dim=-1)
    loss = F.kl_div(student_logp, teacher_logp, log_target=True, reduction="batchmean")
    if hidden_weight:
        error = (student.float() - teacher.float()).pow(2).sum(-1)
        loss = loss + hidden_weight * (error / teacher.float().pow(2).sum(-1)).mean()
    return loss
