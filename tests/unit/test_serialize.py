"""What travels between the owner and its ranks comes back equal, and code keeps its file name; the
messages themselves are named types, read by field, and cost about what a plain tuple does; their kinds are
text enums that Python 3.10 has, as has everything else in labkit."""

import ast
import multiprocessing
import pickle
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.launch import protocol, serialize
from labkit.launch.protocol import (
    Call,
    ExceptionDescription,
    Exited,
    Forked,
    ForkRank,
    Frame,
    Interrupt,
    Outcome,
    RankSpec,
    Ready,
    Reply,
    SignalRanks,
    Stack,
    StackRequest,
    StartFailed,
)

LABKIT = Path(__file__).resolve().parents[2] / "labkit"
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64, torch.int8,
          torch.bool, torch.complex64]


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(0, 4), max_size=3), dtype=st.sampled_from(DTYPES), transpose=st.booleans())
def test_tensors_round_trip_exactly(shape, dtype, transpose):
    t = (torch.randn(shape) * 10).to(dtype)
    if transpose and t.dim() >= 2:
        t = t.transpose(0, 1)  # not contiguous
    back = serialize.loads(serialize.dumps(t))
    assert back.dtype == t.dtype and back.shape == t.shape
    assert torch.equal(back, t)


def test_scalars_grads_and_parameters_survive():
    scalar = torch.tensor(3.5)
    leaf = torch.ones(3, requires_grad=True)
    parameter = torch.nn.Parameter(torch.zeros(2))
    back = serialize.loads(serialize.dumps([scalar, leaf, parameter, {"nested": scalar}]))
    assert back[0].item() == 3.5 and back[0].shape == () and back[3]["nested"].item() == 3.5
    assert back[1].requires_grad
    assert isinstance(back[2], torch.nn.Parameter)


def test_functions_keep_their_file_name():
    def f():
        return 1
    g = serialize.loads(serialize.dumps(f))
    assert g() == 1
    assert g.__code__.co_filename == __file__


def test_gpu_tensors_land_on_the_receiving_ranks_device(monkeypatch):
    # No GPU here: take CPU tensors for GPU ones, and a rank whose device is "meta" (any but the source's)
    monkeypatch.setattr(serialize, "lands_on_rank_device", lambda t: True)
    landed = []
    monkeypatch.setattr(serialize, "landing_device", lambda: landed.append(1) or torch.device("meta"))
    weights = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
    back = serialize.loads(serialize.dumps({"w": weights, "ids": torch.tensor([1, 2])}))
    assert back["w"].device.type == "meta" and back["ids"].device.type == "meta" and len(landed) == 2
    assert back["w"].shape == (2, 3) and back["w"].dtype == torch.float32 and back["w"].requires_grad
    monkeypatch.setattr(serialize, "landing_device", lambda: torch.device("cpu"))
    assert torch.equal(serialize.loads(serialize.dumps(weights)), weights.detach())


def test_outside_a_rank_gpu_tensors_land_on_the_cpu():
    assert serialize.landing_device() == torch.device("cpu")


def test_a_result_that_cannot_be_unpickled_names_its_rank():
    with pytest.raises(TypeError, match=r"rank 3's result .* cannot be unpickled here \(UnpicklingError"):
        serialize.load_result(3, b"not a pickle")


SPEC = RankSpec(rank=1, world_size=2, backend="gloo", store_path="/tmp/labkit-x/store", pg_timeout_seconds=30.0,
                threads=1, cwd="/", sys_path=["/"], env={"RANK": "1"})
MESSAGES = [SPEC, ForkRank(0, SPEC), SignalRanks([12, 13], 9), Forked(0, 12), Exited(12, None),
            Call(3, 60.0, b"payload"), Ready(), StartFailed(ExceptionDescription([])),
            Reply(3, Outcome.OK, b"result", 1.5, {"0/cpu": 2}, False), StackRequest(), Interrupt(3),
            Stack([Frame("train.py", 4, "step")])]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_crosses_a_connection_unchanged(message):
    ours, theirs = multiprocessing.Pipe()
    protocol.send(ours, message)
    back = protocol.receive(theirs)
    assert type(back) is type(message) and back == message


def test_a_reply_is_read_by_name_and_its_outcome_is_text():
    reply = pickle.loads(protocol.encode(MESSAGES[8]))
    assert (reply.call_id, reply.body, reply.steps, reply.group_destroyed) == (3, b"result", {"0/cpu": 2}, False)
    assert type(reply.outcome) is Outcome and reply.outcome == "ok" and f"{reply.outcome}" == "ok"


def test_a_named_message_costs_about_what_a_tuple_does():
    # a warm call is two messages per rank: naming them must not make them much larger than the tuples they were
    reply = MESSAGES[8]
    as_tuple = (reply.call_id, str(reply.outcome), *reply[2:])
    assert len(protocol.encode(reply)) - len(pickle.dumps(as_tuple, protocol=pickle.HIGHEST_PROTOCOL)) < 80



ADDED_IN_PYTHON_3_11 = {  # names labkit must not use while pyproject promises Python >= 3.10 (3.11's "What's New")
    "enum": {"StrEnum", "ReprEnum", "EnumCheck", "FlagBoundary", "verify", "member", "nonmember", "global_enum"},
    "typing": {"Self", "Never", "LiteralString", "assert_never", "assert_type", "reveal_type", "dataclass_transform",
               "Required", "NotRequired", "TypeVarTuple", "Unpack", "get_overloads", "clear_overloads"},
    "datetime": {"UTC"}, "contextlib": {"chdir"}, "hashlib": {"file_digest"}, "operator": {"call"},
    "math": {"cbrt", "exp2"}, "asyncio": {"TaskGroup", "timeout", "timeout_at", "Runner"},
    "builtins": {"ExceptionGroup", "BaseExceptionGroup"},
}
MODULES_ADDED_IN_PYTHON_3_11 = {"tomllib", "wsgiref.types"}


def python_3_11_uses(source: str) -> list[str]:
    """What in `source` Python 3.10 lacks: 3.11's syntax (except*) raises SyntaxError, its names are listed."""
    found = []
    for node in ast.walk(ast.parse(source, feature_version=(3, 10))):
        if isinstance(node, ast.ImportFrom):
            added = ADDED_IN_PYTHON_3_11.get(node.module, set()) | (
                {a.name for a in node.names} if node.module in MODULES_ADDED_IN_PYTHON_3_11 else set())
            found += [f"{node.module}.{a.name} (line {node.lineno})" for a in node.names if a.name in added]
        elif isinstance(node, ast.Import):
            found += [f"{a.name} (line {node.lineno})" for a in node.names if a.name in MODULES_ADDED_IN_PYTHON_3_11]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.attr in ADDED_IN_PYTHON_3_11.get(node.value.id, ()):
            found.append(f"{node.value.id}.{node.attr} (line {node.lineno})")
        elif isinstance(node, ast.Name) and node.id in ADDED_IN_PYTHON_3_11["builtins"]:
            found.append(f"{node.id} (line {node.lineno})")
    return found


@pytest.mark.parametrize("path", sorted(LABKIT.rglob("*.py")), ids=lambda p: str(p.relative_to(LABKIT.parent)))
def test_labkit_runs_on_python_3_10(path):
    uses = python_3_11_uses(path.read_text())
    assert not uses, f"{path.relative_to(LABKIT.parent)} needs Python 3.11: {uses}"


def test_python_3_11_uses_are_found():
    assert python_3_11_uses("from enum import StrEnum\nimport tomllib\nimport typing\nx: typing.Self\n") == [
        "enum.StrEnum (line 1)", "tomllib (line 2)", "typing.Self (line 4)"]
    with pytest.raises(SyntaxError, match="only supported in Python 3.11"):
        python_3_11_uses("try:\n    pass\nexcept* ValueError:\n    pass\n")
    assert python_3_11_uses("from enum import Enum\nclass Kind(str, Enum):\n    A = 'a'\n") == []
