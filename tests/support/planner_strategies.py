"""Hypothesis strategies shared by the planner's property tests."""

from __future__ import annotations

from hypothesis import strategies as st
from prfaas_core.profiles import KvSizeModel, PrefillTimeModel
from prfaas_core.throughput import DecodeProfile, SystemProfile, Workload


@st.composite
def profiles(draw: st.DrawFn) -> SystemProfile:
    def curve() -> PrefillTimeModel:
        return PrefillTimeModel(
            c0=draw(st.floats(0.01, 5)), c1=draw(st.floats(1e-7, 1e-3)), c2=draw(st.floats(0, 1e-9))
        )

    return SystemProfile(
        kv_size=KvSizeModel(bytes_per_token=draw(st.floats(100, 1e6)), fixed_bytes=draw(st.floats(0, 1e9))),
        prfaas_prefill=curve(),
        pd_prefill=curve(),
        decode=DecodeProfile(max_batch=draw(st.integers(1, 256)), step_seconds=draw(st.floats(1e-3, 1))),
    )


@st.composite
def workloads(draw: st.DrawFn, *, max_length: int, max_points: int) -> Workload:
    pairs = draw(
        st.lists(st.tuples(st.integers(1, max_length), st.floats(1e-3, 1)), min_size=1, max_size=max_points)
    )
    return Workload.from_weighted(
        [length for length, _ in pairs],
        [weight for _, weight in pairs],
        mean_output_tokens=draw(st.floats(1, 4096)),
        source="hypothesis",
    )
