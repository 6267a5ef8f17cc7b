"""Adapter popularity: exact shares per mode and sampled shares for a fixed seed."""

from __future__ import annotations

import numpy as np
import pytest

from dlora.bench.popularity import assign_adapters, popularity_shares, stride_mapping


def test_exact_shares():
    assert np.allclose(popularity_shares("uniform", 4), 0.25)
    # skewed (SGLang/Punica): adapter i gets α× the requests of adapter i+1 -> 4:2:1 for α=2.
    assert np.allclose(popularity_shares("skewed", 3, alpha=2), [4 / 7, 2 / 7, 1 / 7])
    # zipf (MuxServe power law): (a+1)^-1 over 3 adapters -> 1 : 1/2 : 1/3.
    assert np.allclose(popularity_shares("zipf", 3, alpha=1), np.array([6, 3, 2]) / 11)
    # powerlaw (S-LoRA, floor(N·X), X ~ power(α)): α=0.5, N=4 -> sqrt(k/4) differences.
    assert np.allclose(popularity_shares("powerlaw", 4, alpha=0.5), np.diff(np.sqrt([0, 0.25, 0.5, 0.75, 1])))
    assert np.allclose(popularity_shares("powerlaw", 5, alpha=1.0), 0.2)  # α=1 is uniform


def test_muxserve_top20_anchor():
    # seed-digest §6.2 (C): top-20 % share is 54.5 % (α 0.9) / 90.9 % (α 2.1) for the top 4 of 19
    # models, and 50.1 % / 87.8 % for 16 models (there the top 20 % rounds down to 3 models).
    assert popularity_shares("zipf", 19, alpha=0.9)[:4].sum() == pytest.approx(0.545, abs=0.001)
    assert popularity_shares("zipf", 19, alpha=2.1)[:4].sum() == pytest.approx(0.909, abs=0.001)
    assert popularity_shares("zipf", 16, alpha=0.9)[:3].sum() == pytest.approx(0.501, abs=0.001)
    assert popularity_shares("zipf", 16, alpha=2.1)[:3].sum() == pytest.approx(0.878, abs=0.001)


def test_stride_mapping_and_shares():
    assert stride_mapping(10, 3, 1).tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]
    assert stride_mapping(10, 3, 2).tolist() == [0, 0, 1, 1, 2, 2, 0, 0, 1, 1]
    # Zipf(1) over 6 functions, stride 2 onto 3 adapters: adapter0 = f0+f1, adapter1 = f2+f3, ...
    f = 1 / np.arange(1, 7)
    expected = np.array([f[0] + f[1], f[2] + f[3], f[4] + f[5]]) / f.sum()
    assert np.allclose(popularity_shares("stride", 3, alpha=1, stride=2, num_functions=6), expected)
    # a larger stride concentrates the hottest functions on adapter 0
    s1 = popularity_shares("stride", 8, stride=1)[0]
    s8 = popularity_shares("stride", 8, stride=8)[0]
    assert s8 > s1


@pytest.mark.parametrize(
    "mode,alpha", [("uniform", None), ("skewed", 1.5), ("zipf", 0.9), ("powerlaw", 0.3), ("stride", 1.0)]
)
def test_sampled_shares_match_for_fixed_seed(mode, alpha):
    # 20,000 draws: a share's standard error is <= 0.0036, so 0.015 is > 4 sigma.
    rng = np.random.default_rng(1234)
    idx = assign_adapters(mode, 20_000, 6, rng, alpha=alpha, stride=2)
    observed = np.bincount(idx, minlength=6) / 20_000
    assert np.allclose(observed, popularity_shares(mode, 6, alpha, stride=2), atol=0.015)


def test_distinct_is_round_robin():
    idx = assign_adapters("distinct", 7, 3, np.random.default_rng(0))
    assert idx.tolist() == [0, 1, 2, 0, 1, 2, 0]


def test_bad_values():
    with pytest.raises(ValueError, match="alpha"):
        popularity_shares("zipf", 3, alpha=0)
    with pytest.raises(ValueError, match="popularity mode 'bogus'"):
        popularity_shares("bogus", 3)
