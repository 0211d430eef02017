"""CommCounters: the handed-over and wire records, and the ring model of DeepSpeed's collectives."""

from __future__ import annotations

import pytest
import torch

from zerohooks.counters import CommCounters, dtype_name, ring_wire_bytes


def test_counter_handed_and_wire_records_are_separate() -> None:
    c = CommCounters()
    c.add("all_reduce", torch.bfloat16, 1000)
    c.add_wire("all_to_all", "int4 codes", 250)
    c.add_wire("all_to_all", "float32 scales", 16)
    c.add_wire("all_to_all", "float32 scales", 16)
    assert c.current() == {"all_reduce": {"bfloat16": 1000}}
    assert c.current(wire=True) == {"all_to_all": {"int4 codes": 250, "float32 scales": 32}}
    assert c.wire_reports == 3
    c.end_step()
    assert c.current() == {} and c.current(wire=True) == {}
    assert c.last_step() == {"all_reduce": {"bfloat16": 1000}}
    assert CommCounters.step_total(c.last_step(wire=True)) == 282
    c.add_default_wire("all_reduce", torch.bfloat16, 1000, 4)  # 2 * 3/4 of the input
    c.end_step()
    assert c.last_step() == {}  # nothing handed in this step
    assert c.last_step(wire=True) == {"all_reduce": {"bfloat16": 1500}}
    assert c.total(wire=True) == {
        "all_to_all": {"int4 codes": 250, "float32 scales": 32},
        "all_reduce": {"bfloat16": 1500},
    }
    assert c.total() == {"all_reduce": {"bfloat16": 1000}}
    assert len(c.history) == len(c.wire_history) == 2


def test_counter_ring_model() -> None:
    assert ring_wire_bytes("all_reduce", 1000, 1) == 0
    assert ring_wire_bytes("all_reduce", 1000, 2) == 1000
    assert ring_wire_bytes("reduce_scatter", 1000, 4) == 750
    assert ring_wire_bytes("reduce", 1000, 2) == 500
    assert ring_wire_bytes("all_gather", 100, 4) == 300
    with pytest.raises(ValueError, match="broadcast"):
        ring_wire_bytes("broadcast", 1, 2)
    assert dtype_name(torch.float32) == "float32" and dtype_name("int4 codes") == "int4 codes"
