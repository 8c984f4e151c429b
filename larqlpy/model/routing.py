"""DeepSeek's routers (transformers' DeepseekV2TopkRouter and DeepseekV3TopkRouter), step for step so
ties fall as they do there: scores by softmax (V2) or sigmoid (V3); "group_limited_greedy" keeps the
topk_group of n_group expert groups with the best single score and zeroes the rest, "noaux_tc" adds
e_score_correction_bias (to choose, never to weigh), keeps the groups with the best two-score sums
and sets the rest to -inf; torch.topk picks k; the weights are the chosen scores, divided by their
sum where norm_topk_prob says (V3), times routed_scaling_factor."""

from __future__ import annotations

import torch

from larqlpy.model.config import MoeConfig


def choose(logits: torch.Tensor, m: MoeConfig, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (T, E) float32 -> each row's weights and experts (T, k)."""
    scores = logits.sigmoid() if m.scoring == "sigmoid" else logits.softmax(dim=-1, dtype=torch.float32)
    pick = scores + bias if bias is not None else scores
    if m.topk_method in ("group_limited_greedy", "noaux_tc"):
        t, e = pick.shape
        groups = pick.view(t, m.n_group, e // m.n_group)
        best = groups.topk(2, dim=-1)[0].sum(dim=-1) if m.topk_method == "noaux_tc" else groups.max(dim=-1).values
        keep = torch.zeros_like(best).scatter_(1, torch.topk(best, k=m.topk_group, dim=-1, sorted=False)[1], 1)
        keep = keep.unsqueeze(-1).expand(-1, m.n_group, e // m.n_group).reshape(t, e).bool()
        pick = pick.masked_fill(~keep, float("-inf") if m.topk_method == "noaux_tc" else 0.0)
    chosen = torch.topk(pick, k=m.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, chosen)
    if m.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * m.routed_scaling, chosen
