"""The graders' shared guard (labkit/exercises/_kit/_guard.py) against graded code that imports parts of torch for
the first time: a student's first torch.optim step imports torch._dynamo, and through it FSDP, DTensor and the
functional collectives, which look up the c10d operators under torch.ops when imported. Each check runs in a
fresh Python process, the only place where those imports are still to come."""

import subprocess
import sys
import textwrap

FIRST_IMPORT_UNDER_THE_GUARD = textwrap.dedent("""
    import sys
    import torch
    import torch.distributed as dist
    from labkit._refusals import ForbiddenCall
    from labkit.exercises._kit._guard import Guard

    assert "torch._dynamo" not in sys.modules, "the check needs a process that has not imported it yet"
    t = torch.ones(2)

    def refused(call):
        try:
            call()
        except ForbiddenCall as error:
            return str(error).split(" is switched off")[0]
        return "not refused"

    with Guard() as guard:
        param = torch.nn.Parameter(torch.ones(3))
        param.grad = torch.ones(3)
        torch.optim.SGD([param], lr=0.5).step()  # imports torch._dynamo, FSDP and DTensor here
        import torch.distributed.tensor._collective_utils as dtensor_collectives
        import torch.nn.parallel  # noqa: F401
        print(param.tolist())
        print(refused(lambda: torch.ops._c10d_functional.all_reduce(t, "sum", "0")))
        print(refused(lambda: torch.ops._c10d_functional.all_reduce.default(t, "sum", "0")))
        print(refused(lambda: dtensor_collectives.broadcast(t, src=0)))  # bound by DTensor on import
    print(isinstance(torch.ops._c10d_functional.all_reduce, torch._ops.OpOverloadPacket), guard.on)
    print(torch.ops._c10d_functional.wait_tensor.default in torch.fx.node._side_effectful_functions)
    try:
        dtensor_collectives.broadcast(t, src=0)  # after the guard: torch's own error, there is no process group
    except ForbiddenCall:
        print("still refused")
    except (ValueError, RuntimeError):
        print("torch's own")
""")


def test_torch_imported_first_under_the_guard_works_and_its_collectives_stay_refused():
    """torch.optim's first step under the guard works (it failed with "'function' object has no attribute
    'default'" when the guard's stand-ins for the c10d operators hid their overloads); the operators, their
    overloads and what DTensor bound on import are refused while the guard is on, and torch's own afterwards."""
    result = subprocess.run([sys.executable, "-c", FIRST_IMPORT_UNDER_THE_GUARD], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        "[0.5, 0.5, 0.5]",
        "torch.ops._c10d_functional.all_reduce",
        "torch.ops._c10d_functional.all_reduce",
        "torch.distributed.distributed_c10d.broadcast",
        "True False",
        "True",
        "torch's own",
    ]
