"""Where the kernel refuses a network namespace, or the user opts out (issue 28, "Killing a rank through gloo's port").

The ranks then share the host's network: labkit says so once per process, with the kernel's reason, and does not
ask the kernel again for every pool. LABKIT_RANK_NETWORK=shared opts out without a word; NCCL pools always share
the host's network (netns.py says why). A real refusal, end to end, is tests/distributed/test_launch_network.py's.
"""

import errno

import pytest

from labkit.launch import netns


def test_the_default_is_a_network_of_the_pools_own_and_shared_opts_out(monkeypatch):
    monkeypatch.delenv("LABKIT_RANK_NETWORK", raising=False)
    assert netns.rank_network("gloo") == netns.PRIVATE
    assert netns.rank_network("nccl") == netns.SHARED  # NCCL's bootstrap is not verified in a namespace
    monkeypatch.setenv("LABKIT_RANK_NETWORK", "shared")
    assert netns.rank_network("gloo") == netns.SHARED


def test_a_wrong_labkit_rank_network_says_what_to_use(monkeypatch):
    monkeypatch.setenv("LABKIT_RANK_NETWORK", "none")
    with pytest.raises(ValueError, match=r"LABKIT_RANK_NETWORK='none': use 'private' .* or 'shared'"):
        netns.rank_network("gloo")


def test_a_refusal_is_asked_once_and_remembered_with_its_reason(monkeypatch):
    asked = []

    def refuse():
        asked.append(1)
        raise OSError(errno.EPERM, "unprivileged user namespaces are disabled")

    monkeypatch.setattr(netns, "make_namespace", refuse)
    networks = netns.PoolNetworks()
    assert networks.for_pool("pool-a") is None and networks.for_pool("pool-b") is None
    assert not networks.make_spare()
    assert networks.refusal == "unprivileged user namespaces are disabled" and len(asked) == 1


def test_the_fallback_message_comes_once_with_the_reason(monkeypatch, capsys):
    monkeypatch.setattr(netns, "_warned", False)
    netns.warn_once("the limit of user namespaces is reached")
    netns.warn_once("the limit of user namespaces is reached")
    err = capsys.readouterr().err
    assert err.count("labkit: other users on this machine can connect to the ranks' ports") == 1
    assert "(the limit of user namespaces is reached)" in err and "LABKIT_RANK_NETWORK=shared" in err


class _Recorded(netns.Namespace):
    closed = False

    def close(self) -> None:
        self.closed = True


def test_a_pools_ranks_share_one_namespace_released_with_its_last_rank(monkeypatch):
    made = iter(range(10, 100, 2))
    monkeypatch.setattr(netns, "make_namespace", lambda: _Recorded(next(made), None))
    networks = netns.PoolNetworks()
    a = networks.for_pool("pool-a")
    networks.joined("pool-a", 101)
    assert networks.for_pool("pool-a") is a
    networks.joined("pool-a", 102)
    b = networks.for_pool("pool-b")
    networks.joined("pool-b", 201)
    assert b is not a
    networks.release_ended({102: None, 201: None})
    assert not a.closed
    networks.release_ended({201: None})
    assert a.closed and not b.closed
