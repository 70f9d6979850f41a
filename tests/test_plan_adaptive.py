"""Per-stage recompute: the exact split with one option per stage, against brute force and uniform settings."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from megapipe.plan.adaptive import split_with_options
from megapipe.records import LayerCost, LayerKind, StageSpec


def _brute(options, stages, in_flight):
    n, best = len(options[0]), None
    for cuts in itertools.combinations(range(1, n), len(stages) - 1):
        bounds = (0, *cuts, n)
        worst = 0.0
        for j, spec in enumerate(stages):
            a, b = bounds[j], bounds[j + 1]
            fitting = [spec.time_scale * sum(e.fwd_ms + e.bwd_ms for e in layers[a:b]) for layers in options
                       if sum(e.static_bytes for e in layers[a:b]) + in_flight[j] * sum(e.act_bytes for e in layers[a:b])
                       <= spec.memory_bytes]
            if not fitting:
                worst = None
                break
            worst = max(worst, min(fitting))
        if worst is not None and (best is None or worst < best):
            best = worst
    return best


def _layer(fwd, bwd, static, act):
    return LayerCost(name="d", kind=LayerKind.decoder, fwd_ms=fwd, bwd_ms=bwd, wgrad_ms=0.0, static_bytes=static,
                     act_bytes=act)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), n=st.integers(2, 7), num_stages=st.integers(1, 3), num_options=st.integers(1, 3))
def test_split_with_options_equals_brute_force(data, n, num_stages, num_options):
    if num_stages > n:
        num_stages = n
    small = st.integers(1, 9)
    base = [(data.draw(small), data.draw(small), data.draw(small), data.draw(small)) for _ in range(n)]
    options = []
    for level in range(num_options):  # more recompute: slower backward, fewer activation bytes
        options.append([_layer(f, b + level * f, s, max(a - 3 * level, 0)) for f, b, s, a in base])
    stages = [StageSpec(time_scale=data.draw(st.sampled_from([1.0, 1.5])), memory_bytes=data.draw(st.integers(5, 60)))
              for _ in range(num_stages)]
    in_flight = [num_stages - j for j in range(num_stages)]
    found = split_with_options(options=options, stages=stages, in_flight=in_flight)
    expected = _brute(options, stages, in_flight)
    if expected is None:
        assert found is None
        return
    assert found is not None and found.bottleneck_ms == expected
    assert len(found.bounds) == num_stages + 1 and found.bounds[0] == 0 and found.bounds[-1] == n
    for j, choice in enumerate(found.choices):  # the reported choice really fits its stage
        layers = options[choice][found.bounds[j]:found.bounds[j + 1]]
        assert layers and sum(e.static_bytes for e in layers) + in_flight[j] * sum(e.act_bytes for e in layers) \
            <= stages[j].memory_bytes
