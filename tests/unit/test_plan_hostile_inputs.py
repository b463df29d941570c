"""Every public function of labkit.plan, fed one hostile value at a time with its other arguments valid: it
returns finite numbers (or strings), or refuses with a ValueError or TypeError whose message names the argument
it was given. Never a bare OverflowError, a silent inf or nan, or an error that blames some inner variable."""

import dataclasses
import inspect
import math
import numbers
import re
import reprlib
import sys
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import labkit.plan
from labkit.plan import traffic

CONSTANTS = {"BACKWARD_SHARE", "CONTEXT_VARIANTS", "GB", "RECOMPUTE", "YOUR_CHOICE", "ZERO_STAGES"}
# Functions known to fail the sweep, as strict xfails: once one is fixed its XPASS fails and it leaves this set.
# (labkit.plan.counts, issue 13, was here until its errors named `count` and `text`.)
KNOWN_GAPS: set[str] = set()
EXAMPLE = {"params": 7e9, "per_device_batch": 8, "accumulation_steps": 2, "step_compute_seconds": 1.0,
           "examples": 40_000, "devices": 8, "gradient_bytes_per_param": 2, "bytes_per_param": 16,
           "bandwidth": 14.7e9, "overlap": 0.5}
SHAPE = {"vocab": 82, "d_model": 32, "layers": 2, "heads": 4, "context": 32, "d_ff": None, "tied": False, "experts": 0,
         "top_k": 1}
MOE_SHAPE = dict(SHAPE, experts=4, top_k=2)  # a mixture of experts, for the ep axis
LAYOUT = {"dp": 2, "pp": 2, "tp": 2, "microbatches": 2, "chunks": 1, "sequence_parallel": False, "zero_stage": 0,
          "scatter_gather": True, "vocab_parallel_loss": True, "cp": 1, "ep": 1}
CP_LAYOUT = dict(LAYOUT, cp=2, scatter_gather=False)  # with context parallelism: every sequence over 2 ranks
EP_LAYOUT = dict(LAYOUT, tp=1, ep=2, scatter_gather=False, vocab_parallel_loss=False)  # experts over 2 ranks
# Arguments that work, per function (a list where one set cannot reach every branch); each hostile value
# replaces one of them at a time.
VALID = {
    "WorkedExample": [EXAMPLE],
    "worked_example": [EXAMPLE],
    "allreduce_seconds": [{"nbytes": 1.4e10, "world_size": 8, "bandwidth": 2.45e10, "latency": 1e-5,
                           "algorithm": algorithm, "gamma_seconds_per_byte": 1e-12}
                          for algorithm in traffic.ALLREDUCE_ALGORITHMS],
    "attention_lora_shapes": [{"d_model": 4096, "layers": 32}],
    "attention_work": [{"length": 1000, "cp": 4, "zigzag": zigzag, "causal": causal}
                       for zigzag in (True, False) for causal in (True, False)],
    "context_layout": [{"length": 1000, "cp": 4, "zigzag": zigzag} for zigzag in (True, False)],
    "context_parallel_nbytes": [{"length": 1000, "cp": 4, "rows": 8, "head_dim": 64, "bytes_per_element": 2,
                                 "variant": variant, "zigzag": True} for variant in ("ring", "allgather")],
    "context_attention_saved_nbytes": [{"length": 1000, "cp": 4, "rows": 8, "head_dim": 64, "bytes_per_element": 2,
                                        "variant": variant, "zigzag": False} for variant in ("ring", "allgather")],
    "bandwidth_for_speedup": [{"target_speedup": 3, "devices": 8, "compute_seconds": 1.0,
                               "nbytes_per_rank": 2.45e10, "overlap": overlap, "accumulation_steps": 2}
                              for overlap in (0.5, 1.0)],
    "bubble_fraction": [{"stages": 4, "microbatches": 8, "chunks": 2}],
    "zero_bubble_fraction": [{"stages": 4, "microbatches": 8, "forward": 1.0, "backward_input": 1.0,
                              "backward_weight": 0.5}],
    "bus_bandwidth": [{"collective": "allreduce", "nbytes": 2e9, "seconds": 1.0, "world_size": 4}],
    "data_parallel_speedup": [{"devices": 8, "compute_seconds": 1.0, "comm_seconds": 0.5, "overlap": 0.5,
                               "accumulation_steps": 2}],
    "expert_capacity": [{"tokens": 4096, "experts": 64, "top_k": 2, "capacity_factor": 1.25}],
    "expert_params_per_rank": [{"experts": 64, "ep": 8, "params_per_expert": 1.76e8}],
    "moe_all_to_all_nbytes": [{"tokens": 4096, "d_model": 4096, "top_k": 2, "ep": 8, "bytes_per_element": 2,
                               "experts": experts, "capacity_factor": factor}
                              for experts, factor in ((None, None), (64, 1.25))],
    "effective_batch": [{"per_device_batch": 8, "devices": 8, "accumulation_steps": 2}],
    "format_count": [{"count": 7e9}],
    "parse_count": [{"text": "70B"}],
    "fit_alpha_beta": [{"nbytes": [1e6, 4e6, 16e6], "seconds": [0.00135, 0.0036, 0.0126], "world_size": 4}],
    "fit_point_to_point": [{"nbytes": [1e3, 1e6], "seconds": [1.1e-4, 1.1e-3]}],
    "lora_params": [{"shapes": [(4096, 4096), (4096, 11008)], "rank": 8}],
    "memory_options": [{"params": 7e9, "devices": 8, "lora_rank": lora_rank, "zero_stage": 3, "weight_bytes": 2,
                        "grad_bytes": 2, "optimizer_bytes": 12, "d_model": 4096, "layers": 32, "sequence": sequence,
                        "micro_batch": 8, "heads": 32, "recompute": "none", "flash_attention": False,
                        "sequence_parallel": True, "accumulation_steps": 2}
                       for lora_rank, sequence in ((0, None), (16, 2048), (0, 2048))],
    "activation_nbytes": [{"layers": 32, "d_model": 4096, "heads": 32, "sequence": 2048, "micro_batch": 8,
                           "recompute": recompute, "tp": 8, "sequence_parallel": True, "flash_attention": False,
                           "bytes_per_value": 2, "dropout": True} for recompute in ("none", "full")],
    "tp_in_node": [{"devices": 64, "heads": 32, "gpus_per_node": 8}],
    "naive_allreduce_bytes": [{"nbytes": 1.4e10, "world_size": 8}],
    "parallelism_for": [{"params": 7e9, "largest_layer_params": 0.2e9, "gpu_nbytes": 80e9, "weight_bytes": 2,
                         "grad_bytes": 2, "optimizer_bytes": 12}],
    "ring_allreduce_bytes": [{"nbytes": 1.4e10, "world_size": 8}],
    "scale_lr": [{"lr": 1e-4, "old_batch": 16, "new_batch": 128, "rule": rule} for rule in ("linear", "sqrt")],
    "step_seconds": [{"compute_seconds": 1.0, "comm_seconds": 0.5, "overlap": 0.5, "accumulation_steps": 2,
                      "drain_seconds": 0.1}],
    "hideable_seconds": [{"compute_seconds": 1.0, "accumulation_steps": 2}],
    "tokens_to_hide_allreduce": [{"flops_per_second": 5e14, "bandwidth": 5e10, "devices": 8, "accumulation_steps": 2,
                                  "gradient_bytes_per_param": 2}],
    "steps_per_epoch": [{"examples": 40_000, "effective_batch": 128}],
    "training_memory": [{"params": 7e9, "weight_bytes": 2, "grad_bytes": 2, "optimizer_bytes": 12,
                         "zero_stage": 3, "dp": 8, "activations_nbytes": activations} for activations in (None, 73e9)],
    "transformer_params": [{"vocab": 50257, "d_model": 768, "layers": 12, "d_ff": 3072, "context": 1024,
                            "tied_embeddings": False, "bias": True}],
    "zero_collective_bytes_per_param": [{"zero_stage": stage, "weight_bytes": 2, "grad_bytes": 2}
                                        for stage in (0, 3)],
    "zero_memory_table": [{"params": 7.5e9, "dp": 64, "weight_bytes": 2, "grad_bytes": 2, "optimizer_bytes": 12}],
    "zero_traffic_bytes": [{"params": 7e9, "world_size": 8, "zero_stage": 3, "weight_bytes": 2, "grad_bytes": 2}],
    "zero_redundancy_optimizer_bytes": [{"params": 7e9, "world_size": 8, "weight_bytes": 2, "grad_bytes": 2}],
    "GPTShape": [dict(SHAPE), dict(MOE_SHAPE)],
    "ParallelLayout": [dict(LAYOUT, sequence_parallel=sequence_parallel) for sequence_parallel in (False, True)],
    "check_fit": [{"shape": labkit.plan.GPTShape(**SHAPE), "layout": labkit.plan.ParallelLayout(**LAYOUT),
                   "batch": 16, "sequence": 32}],
    "rank_layers": [{"shape": labkit.plan.GPTShape(**SHAPE), "layout": labkit.plan.ParallelLayout(**LAYOUT),
                     "rank": 3}],
    "rank_params": [{"shape": labkit.plan.GPTShape(**SHAPE), "layout": labkit.plan.ParallelLayout(**LAYOUT),
                     "rank": 3}],
    "axis_traffic": [{"shape": labkit.plan.GPTShape(**shape), "layout": labkit.plan.ParallelLayout(**layout),
                      "batch": 16, "rank": rank, "sequence": 31, "bytes_per_number": 8}
                     for shape, layout, rank in ((SHAPE, LAYOUT, 3), (SHAPE, CP_LAYOUT, 6), (MOE_SHAPE, EP_LAYOUT, 5))],
    "axis_wire_bytes": [{"traffic": {"dp": {"all_reduce": 1000}, "pp": {"send": 500}, "tp": {"all_gather": 300}},
                         "layout": labkit.plan.ParallelLayout(**LAYOUT)}],
    # public in labkit.plan.traffic, though not exported by labkit.plan
    "ring_reduce_scatter_bytes": [{"nbytes": 1.4e10, "world_size": 8}],
    "busbw_factor": [{"collective": "allreduce", "world_size": 8}],
    "ddp_bucket_count": [{"gradient_nbytes": 1.4e10, "bucket_mb": 25.0}],
    "tree_beats_ring_below_nbytes": [{"world_size": 64, "bandwidth": 1e10, "latency": 2e-5}],
}
HOSTILE = [
    0, -1, 0.0, -0.0, -2.5, math.nan, math.inf, -math.inf, 5e-324, 1e300, 1.7e308, -1.7e308,
    10**300, 10**308, 2**1024, 10**400, -(10**400), 10**5000,
    True, False, None, "8", "", b"8", [], [1.0], (2, 2), {}, {"a": 1}, {1}, 1 + 0j, object(),
    Fraction(1, 3), Fraction(10**400), Decimal("1e400"), Decimal("NaN"), Decimal("sNaN"), Decimal("-Infinity"),
    np.float64("nan"), np.int64(-1), np.array([1.0, 2.0]),
]


def functions():
    """Every public function of labkit.plan (its __all__ less the constants), and traffic's unexported ones."""
    exported = {name: getattr(labkit.plan, name) for name in labkit.plan.__all__ if name not in CONSTANTS}
    return {**exported, **{name: getattr(traffic, name)
                           for name in ("ring_reduce_scatter_bytes", "busbw_factor", "ddp_bucket_count",
                                        "tree_beats_ring_below_nbytes")}}


def arguments(function) -> list[str]:
    """The names a caller can pass: the signature's, or for worked_example(**overrides) the scenario's fields."""
    if function is labkit.plan.worked_example:
        return [field.name for field in dataclasses.fields(labkit.plan.WorkedExample)]
    return list(inspect.signature(function).parameters)


def hostile_values(argument: str, valid) -> list:
    """HOSTILE, and for a list argument also the valid list with one element (or one pair's member) replaced."""
    if not isinstance(valid, list):
        return HOSTILE
    spoiled = []
    for value in HOSTILE:
        spoiled += [value, [value, *valid[1:]], [*valid[:-1], value]]
        if argument == "shapes":
            spoiled += [[(value, 8)], [(8, value)]]
    return spoiled


def finite(value) -> bool:
    """True if every number in `value` (dicts, lists, tuples searched) is finite and within float range."""
    if value is None or isinstance(value, str | bool):
        return True
    if isinstance(value, numbers.Integral):
        return abs(value) <= sys.float_info.max
    if isinstance(value, numbers.Real):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(finite(part) for part in value.values())
    if isinstance(value, list | tuple):
        return all(finite(part) for part in value)
    if isinstance(value, labkit.plan.WorkedExample):
        derived = [getattr(value, name) for name, member in inspect.getmembers(type(value))
                   if isinstance(member, property)]
        return finite(derived) and isinstance(value.table(), str)
    if isinstance(value, range):  # rank_layers' pieces
        return finite([value.start, value.stop])
    if dataclasses.is_dataclass(value):  # GPTShape, ParallelLayout
        return finite(dataclasses.asdict(value))
    raise AssertionError(f"unexpected result type {type(value).__name__}")


def verdict(function_name: str, argument: str, kwargs: dict) -> str | None:
    """None if the call computes a finite answer or refuses naming `argument`; else what went wrong."""
    try:
        result = functions()[function_name](**kwargs)
    except (ValueError, TypeError) as error:
        if re.search(rf"\b{argument}\b", str(error)):
            return None
        return f"{type(error).__name__} not naming {argument}: {error}"
    except Exception as error:  # noqa: BLE001 - any other exception is the failure being looked for
        return f"{type(error).__name__}: {error}"
    try:
        ok = finite(result)
    except Exception as error:  # noqa: BLE001 - a result that cannot even be inspected or printed
        return f"its result fails when read: {type(error).__name__}: {error}"
    return None if ok else f"a non-finite result: {result!r}"


def label(value) -> str:
    """`value` for a failure report: a huge int by its size (repr refuses past 4,300 digits)."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"<an int of {value.bit_length()} bits>"
    return reprlib.repr(value)


def cases():
    """(function, argument, valid arguments) for every argument of every public function."""
    table = functions()
    return [(name, argument, valid) for name in sorted(table) for valid in VALID[name]
            for argument in arguments(table[name])]


def test_every_public_function_and_argument_has_valid_values():
    table = functions()
    assert set(VALID) == set(table), "give valid arguments for each new public function in VALID"
    for name, function in table.items():
        for valid in VALID[name]:
            assert sorted(valid) == sorted(arguments(function)), name
            assert finite(function(**valid)), name


def marked(case: tuple, index: int):
    """`case` as a pytest.param with a readable id, a strict xfail for a function in KNOWN_GAPS."""
    name, argument, _ = case
    marks = [pytest.mark.xfail(strict=True, reason="labkit.plan.counts: see KNOWN_GAPS")] if name in KNOWN_GAPS else []
    return pytest.param(*case, marks=marks, id=f"{name}-{argument}-{index}")


@pytest.mark.parametrize("function_name, argument, valid",
                         [marked(case, index) for index, case in enumerate(cases())])
def test_hostile_values_are_computed_or_refused_by_name(function_name, argument, valid):
    failures = []
    for value in hostile_values(argument, valid[argument]):
        problem = verdict(function_name, argument, {**valid, argument: value})
        if problem is not None:
            failures.append(f"{function_name}({argument}={label(value)}): {problem}")
    assert not failures, f"{len(failures)} failing:\n" + "\n".join(failures)


anything = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(-(10**320), 10**320), st.booleans(), st.none(),
    st.text(max_size=5), st.fractions(), st.decimals(allow_nan=True, allow_infinity=True),
    st.lists(st.floats(), max_size=3), st.tuples(st.integers(), st.integers()),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from([case for case in cases() if case[0] not in KNOWN_GAPS]), value=anything)
def test_any_value_is_computed_or_refused_by_name(case, value):
    function_name, argument, valid = case
    problem = verdict(function_name, argument, {**valid, argument: value})
    assert problem is None, problem
