"""Closed-form peak in-flight counts equal the counts derived from the built orders."""

from __future__ import annotations

import pytest

from megapipe.errors import ScheduleError
from megapipe.schedules import build, peak_in_flight
from megapipe.schedules.base import SCHEDULE_NAMES
from megapipe.schedules.in_flight import closed_form_in_flight
from megapipe.schedules.registry import _peak_from_orders

MICROBATCHES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 24)


def _grid():
    for name in SCHEDULE_NAMES:
        for pp in (1, 2, 3, 4, 5, 8):
            for m in MICROBATCHES:
                if name == "interleaved_1f1b":
                    for vp in (2, 3, 4):
                        for group in sorted({pp, pp + 1, 2 * pp}):
                            if pp >= 2 and pp <= group <= m and not 0 < m % group < pp:
                                yield name, pp, m, vp, group
                elif name in ("zb_v", "dualpipe_v"):
                    if name == "zb_v" or m >= 2 * pp:
                        yield name, pp, m, 2, None
                else:
                    yield name, pp, m, 1, None


def test_closed_forms_match_built_orders():
    cases = list(_grid())
    assert len(cases) > 500
    for name, pp, m, vp, group in cases:
        schedule = build(name, pipeline_model_parallel_size=pp, num_microbatches=m,
                         virtual_pipeline_model_parallel_size=vp, microbatch_group_size_per_vp_stage=group)
        closed = closed_form_in_flight(name, pipeline_model_parallel_size=pp, num_microbatches=m,
                                       virtual_pipeline_model_parallel_size=vp,
                                       microbatch_group_size_per_vp_stage=group)
        assert closed == _peak_from_orders(schedule), (name, pp, m, vp, group)


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
