"""Closed-form peak in-flight counts equal the counts derived from the built orders."""

from __future__ import annotations

import pytest

from megapipe.errors import ScheduleError
from megapipe.schedules import SCHEDULE_NAMES, build, peak_in_flight, spec
from megapipe.schedules.registry import _peak_from_orders

MICROBATCHES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 24)


def _grid():
    for name in SCHEDULE_NAMES:
        for pp in (1, 2, 3, 4, 5, 8):
            for m in MICROBATCHES:
                for vp in (1, 2, 3, 4):
                    for group in sorted({pp, pp + 1, 2 * pp}):
                        yield name, pp, m, vp, group


def test_closed_forms_match_built_orders():
    """Where a spec says its closed form applies the builder accepts the sizes and agrees; elsewhere it raises."""
    accepted = 0
    for name, pp, m, vp, group in _grid():
        item = spec(name)
        sizes = dict(pipeline_model_parallel_size=pp, num_microbatches=m, virtual_pipeline_model_parallel_size=vp,
                     microbatch_group_size_per_vp_stage=group if item.fixed_chunks is None else None)
        if not item.sizes_ok(pp, m, vp, group):
            with pytest.raises(ScheduleError):
                build(name, **sizes)
            continue
        accepted += 1
        closed = item.in_flight(pp, m, vp, group)
        assert closed == _peak_from_orders(build(name, **sizes)), (name, pp, m, vp, group)
    assert accepted > 500


def test_named_and_built_counts_agree_through_the_registry():
    for name, vp in (("interleaved_1f1b", 2), ("zb_v", 2), ("dualpipe_v", 2), ("zb_h2", 1)):
        schedule = build(name, pipeline_model_parallel_size=4, num_microbatches=8, virtual_pipeline_model_parallel_size=vp)
        sizes = dict(pipeline_model_parallel_size=4, num_microbatches=8, virtual_pipeline_model_parallel_size=vp)
        assert peak_in_flight(name, **sizes) == peak_in_flight(schedule, **sizes)


@pytest.mark.parametrize("name, pp, m, vp, match", [
    ("dualpipe_v", 4, 7, 2, "num_microbatches >= 2"),
    ("interleaved_1f1b", 4, 6, 2, "must be 0 or >= pipeline_model_parallel_size"),
    ("interleaved_1f1b", 1, 4, 2, "pipeline_model_parallel_size >= 2"),
    ("zb_v", 4, 8, 3, "exactly 2 model chunks"),
    ("1f1b", 4, 0, 1, "num_microbatches=0"),
])
def test_invalid_sizes_raise_the_builders_error(name, pp, m, vp, match):
    with pytest.raises(ScheduleError, match=match):
        peak_in_flight(name, pipeline_model_parallel_size=pp, num_microbatches=m, virtual_pipeline_model_parallel_size=vp)


def test_rank_ops_closed_forms_equal_the_built_orders():
    """1F1B and interleaved 1F1B give each rank's order as plain tuples without building actions; they are the
    built orders, op for op, over a grid of sizes and microbatch group sizes."""
    from megapipe.schedules import registry
    from megapipe.schedules.base import rank_ops_of

    compared = 0
    for name in ("1f1b", "interleaved_1f1b"):
        for pp in (2, 3, 4, 8):
            for v in (1, 2, 3, 5):
                for m in sorted({pp, 2 * pp, 3 * pp, 16, 24}):
                    for group in (None, pp + 1):
                        try:
                            built = registry.build(name, pipeline_model_parallel_size=pp, num_microbatches=m,
                                                   virtual_pipeline_model_parallel_size=v,
                                                   microbatch_group_size_per_vp_stage=group)
                        except ScheduleError:
                            continue
                        assert registry.rank_ops(name, pipeline_model_parallel_size=pp, num_microbatches=m,
                                                 virtual_pipeline_model_parallel_size=v,
                                                 microbatch_group_size_per_vp_stage=group) == rank_ops_of(built.orders)
                        compared += 1
    assert compared > 60


def test_rank_in_flight_profiles_closed_form_equals_the_built_orders():
    """Interleaved 1F1B's peak candidates in closed form give the same non-dominated rows, rank by rank, as every
    forward of the built orders."""
    import numpy as np

    from megapipe.schedules import registry

    compared = 0
    for pp in (2, 3, 4, 8):
        for v in (2, 3, 5):
            for m in sorted({pp, 2 * pp, 3 * pp, 16, 24}):
                for group in (None, pp + 1):
                    sizes = dict(pipeline_model_parallel_size=pp, num_microbatches=m,
                                 virtual_pipeline_model_parallel_size=v, microbatch_group_size_per_vp_stage=group)
                    try:
                        built = registry.build("interleaved_1f1b", **sizes)
                    except ScheduleError:
                        continue
                    closed = registry.rank_in_flight_profiles("interleaved_1f1b", **sizes)
                    from_orders = [registry._pareto(rows) for rows in registry._rank_counts_from_orders(built)]
                    assert all(np.array_equal(a, b) for a, b in zip(closed, from_orders))
                    compared += 1
    assert compared > 40


def test_every_schedule_keeps_fewer_of_a_later_chunk_at_each_peak():
    """The coupled-memory solver's premise (partition/rank_problem.py): at every moment that can be a rank's peak,
    each schedule holds no more microbatches of a later layout stage than of an earlier one on that rank, so
    filling the last stages first minimises every memory row at once."""
    from megapipe.schedules import registry

    checked = 0
    for name in SCHEDULE_NAMES:
        for pp in (2, 3, 4, 8):
            for v in (1, 2, 3, 6):
                for m in sorted({pp, 2 * pp, 3 * pp + 1, 16, 32}):
                    try:
                        profiles = registry.rank_in_flight_profiles(name, pipeline_model_parallel_size=pp,
                                                                    num_microbatches=m,
                                                                    virtual_pipeline_model_parallel_size=v)
                    except ScheduleError:
                        continue
                    for rows in profiles:
                        assert all(list(row) == sorted(row, reverse=True) for row in rows.tolist()), (name, pp, v, m)
                    checked += 1
    assert checked > 100


def test_distinct_rows_are_numpys_unique_rows_and_the_pareto_rows_are_the_undominated_ones():
    """The in-flight rows' dedupe (exact int64 keys of a few columns each) against np.unique(axis=0), on small and
    large counts and widths past one key; and _pareto against its definition, row by row."""
    import numpy as np

    from megapipe.schedules import registry

    rng = np.random.default_rng(0)
    for _ in range(600):
        rows = rng.integers(0, int(rng.choice([2, 5, 300, 70_000, 2 ** 40])), size=(int(rng.integers(0, 40)),
                                                                                 int(rng.integers(1, 30))))
        assert np.array_equal(registry._distinct_rows(rows), np.unique(rows, axis=0).reshape(-1, rows.shape[1]))
        kept = {tuple(row) for row in registry._pareto(rows).tolist()}
        undominated = {tuple(row) for row in rows.tolist()
                       if not any((other >= row).all() and (other > row).any() for other in rows)}
        assert kept == undominated
