"""The sampler never fails on extreme but valid sampling parameters (schemathesis found top_p
5e-324, which rounds to 0 in float32, emptying the nucleus: a 500)."""

import pytest
import torch

from kvblend.engine.request import SamplingParams
from kvblend.engine.sampler import create_generator, sample

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "temperature, top_p",
    [(1.0, 5e-324), (0.7, 1e-45), (1e-300, 0.9), (1e-300, 5e-324)],
)
def test_extreme_temperature_and_top_p_sample_the_most_likely_token(temperature, top_p):
    logits = torch.tensor([0.5, 3.0, -1.0, 2.0])
    params = SamplingParams(max_tokens=1, temperature=temperature, top_p=top_p, seed=1)
    assert sample(logits, params, create_generator(params)) == 1


def test_top_p_keeps_the_smallest_head_reaching_its_mass():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    params = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.7, seed=0)
    gen = create_generator(params)
    drawn = {sample(logits, params, gen) for _ in range(200)}
    assert drawn == {0, 1}
