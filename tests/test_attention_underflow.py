"""Decode attention (kernels/attention/chunk.py) takes a weight e^(s - max) under e^-70 as 0: such
weights and their products with the values would be float32 subnormals, which x86 runs by microcode
assists, many times slower; a weight within 70 of the maximum still counts."""

from __future__ import annotations

import pytest
import torch

from larqlpy.kernels.attention.decode import Span, attend_rows


@pytest.mark.parametrize("d", [128, 576])  # 128: the 16-row intrinsics; 576 (latent attention): the pairs path
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gap, counts", [(100.0, False), (60.0, True)])
def test_weights_far_below_the_maximum_are_zero(d, dtype, gap, counts):
    """Row 0 scores `gap` above 299 others; its value is 0 where theirs are 1, so the output is exactly
    0 where their weights (e^-gap) are dropped, and their share where they count."""
    n = 300
    k = torch.zeros(1, n, d)
    k[0, 0, 0] = 1.0
    v = torch.ones(1, n, d)
    v[0, 0] = 0.0
    q = torch.zeros(1, 4, d)
    q[0, :, 0] = gap
    out = attend_rows(q, [Span(k.to(dtype), v.to(dtype), 0, n)], 1.0)
    if counts:
        share = (n - 1) * torch.exp(torch.tensor(-gap, dtype=torch.float64))
        assert torch.allclose(out.double(), share / (1 + share) * torch.ones_like(out.double()), rtol=1e-5)
    else:
        assert torch.equal(out, torch.zeros_like(out))
