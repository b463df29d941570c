"""Notebook 13's 3D training, unchanged, on 2 nodes x 4 ranks attached from torchrun (tests/distributed/two_nodes.py:
two network namespaces with a link of their own between them), against one process, and the bytes that crossed that
link, read from the kernel's counters, against plan's prediction for the axes whose groups span the nodes."""

from __future__ import annotations

import pytest

import labkit
from labkit import plan
from labkit.parallel.mesh_runs import MICROBATCHES, STEPS, train_3d, train_alone
from tests.distributed.test_attach import ATTACH_SECONDS, free_port
from tests.distributed.two_nodes import LOOPBACK, Nodes

pytestmark = pytest.mark.numerics  # losses and parameters against one process's, in float64

LAYOUTS = ((2, 2, 2), (1, 2, 4))  # dp spans the nodes; pp spans them
MARGIN_NBYTES = 1 << 20  # the groups' set-up across nodes (gloo's full mesh of connections, the store's keys)


def test_3d_training_on_two_attached_nodes_equals_one_process_and_only_dp_and_pp_cross(tmp_path):
    """The mesh puts tp innermost, so a node's four ranks hold whole tp groups: with dp=2 x pp=2 x tp=2 only dp's
    groups span the nodes, with 1 x 2 x 4 only pp's. What crossed must be what plan predicts for the axes that span
    nodes: at least the payload plan.axis_wire_bytes gives, at most that plus about a tenth for the frames' TCP/IP
    headers and acknowledgements and MARGIN_NBYTES of set-up; and less than half of what stayed inside."""
    nodes = Nodes()
    if nodes.network == LOOPBACK:
        nodes.close()
        pytest.skip("needs root for two network namespaces: on loopback no link separates the nodes")
    runs = {}
    try:
        port = free_port(nodes.notebook_host)
        nodes.start(f"{nodes.notebook_host}:{port}", ranks_per_node=4, log_dir=tmp_path)
        labkit.attach(world_size=8, nodes=2, host=nodes.notebook_host, port=port, timeout=ATTACH_SECONDS)
        for layout in LAYOUTS:
            before = nodes.inter_node_nbytes()
            results = labkit.run(train_3d, *layout, world_size=8, timeout=300)
            runs[layout] = results, nodes.inter_node_nbytes() - before
    finally:
        labkit.shutdown()
        nodes.close()
    alone_losses, alone_params = train_alone()
    for (dp, pp, tp), (results, crossed) in runs.items():
        loss_gap = max(abs(a - b) for r in results for a, b in zip(r.losses, alone_losses, strict=True))
        param_gap = max((results[0].params[name] - p).abs().max().item() for name, p in alone_params.items())
        assert loss_gap <= 1e-10 and param_gap <= 1e-10  # float64: the same steps to rounding (notebook 13's bound)
        across = ["dp"] if dp > 1 else ["pp"]
        inside = [axis for axis in ("dp", "pp", "tp") if axis not in across]
        layout = plan.ParallelLayout(dp, pp, tp, MICROBATCHES)
        wire = [plan.axis_wire_bytes(r.planned, layout) for r in results]
        predicted = STEPS * sum(w[axis] for w in wire for axis in across)
        kept_inside = STEPS * sum(w[axis] for w in wire for axis in inside)
        print(f"{(dp, pp, tp)}: crossed {crossed:,} bytes; plan: {predicted:,.0f} across ({', '.join(across)}), "
              f"{kept_inside:,.0f} inside ({', '.join(inside)})")
        assert predicted <= crossed <= 1.15 * predicted + MARGIN_NBYTES, (crossed, predicted)
        assert crossed < predicted + 0.5 * kept_inside  # tp's (and the other axis's) traffic did not cross
