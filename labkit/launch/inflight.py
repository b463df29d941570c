"""Which collective each rank is in, and which rank diverged: read from torch's Flight Recorder.

torch records every collective a process group issues, with its sequence number in that group, in the Flight
Recorder (PyTorch tutorials, "Flight Recorder for Debugging Stuck Jobs"): a ring buffer of TORCH_FR_BUFFER_SIZE entries
(labkit's ranks get 2000 unless the environment says otherwise). In torch 2.13 gloo's collectives go to the generic
recorder (`torch._C._distributed_c10d._dump_fr_trace_json`) and NCCL's to ProcessGroupNCCL's own
(`_dump_nccl_trace_json`, in CUDA builds only); an entry is retired when its work completes (gloo) or when the NCCL
watchdog sees its end event, and a dump marks "completed" an NCCL entry whose end event has been reached. Gloo
records no point-to-point operations, so only collectives are compared. The NCCL half is designed from torch's
documented Flight Recorder and its source (no GPU here); the gloo half is tested on real ranks.

This matters on NCCL: a collective returns as soon as it is queued, so a rank whose all_reduce never completes is
found waiting somewhere else (labkit's torch.cuda.synchronize after the call, a .item(), the next cell), and its
stack alone does not say what it waits for. The recorder does, on both backends.

On a rank, `recorded_collectives()` turns the dumps into `GroupCollectives` (the control thread sends them with the
stack). On the owner, `collectives_report` compares the ranks of each group at the first collective that did not
complete: who is in it, who called another one there, who never called it, and so which rank diverged;
`where_in_collectives` is the short phrase a rank's own line gets.
"""

from __future__ import annotations

import json
from collections import Counter

from labkit.launch.errors import rank_list
from labkit.launch.protocol import GroupCollectives

__all__ = ["BUFFER_SIZE", "collectives_report", "recorded_collectives", "summed_by_group", "where_in_collectives"]

BUFFER_SIZE = 2000  # entries; torch's own default in recent releases, set explicitly so NCCL records too
_DUMPS = ("_dump_fr_trace_json", "_dump_nccl_trace_json")  # gloo and CPU; NCCL (CUDA builds)
_RENAMED = {"all_reduce_barrier": "barrier"}  # ProcessGroupNCCL's barrier is an all_reduce of one element


def recorded_collectives() -> tuple[GroupCollectives, ...] | None:
    """On a rank: for each of its groups and backends, the collectives issued and those not completed; None if
    the recorder is off (TORCH_FR_BUFFER_SIZE=0) or cannot be read."""
    import torch
    import torch.distributed as dist

    entries, read = [], False
    for name in _DUMPS:
        dump = getattr(torch._C._distributed_c10d, name, None)
        if dump is None:
            continue
        try:
            entries += json.loads(dump()).get("entries", [])
            read = True
        except Exception:  # noqa: BLE001 - a recorder that cannot be read says nothing
            continue
    if not read:
        return None
    try:
        members = {name: tuple(dist.get_process_group_ranks(group))
                   for group, name in list(dist.distributed_c10d._world.pg_names.items())}
    except Exception:  # noqa: BLE001 - no group (yet, or any more)
        return None
    return summed_by_group(entries, members)


def summed_by_group(entries: list[dict], members: dict[str, tuple[int, ...]]) -> tuple[GroupCollectives, ...]:
    """The recorder's entries, summed up per (group, backend) for the groups in `members` (name -> ranks)."""
    issued: dict[tuple[str, str], int] = {}
    in_flight: dict[tuple[str, str], list[tuple[str, int]]] = {}
    for entry in entries:
        group = str(entry.get("process_group", [""])[0])
        if entry.get("is_p2p") or group not in members:
            continue
        backend, _, operation = str(entry.get("profiling_name", "")).partition(":")
        key, seq = (group, backend), int(entry.get("collective_seq_id", 0))
        issued[key] = max(issued.get(key, 0), seq)
        if not entry.get("retired") and entry.get("state") != "completed":
            operation = operation.lstrip("_")
            in_flight.setdefault(key, []).append((_RENAMED.get(operation, operation), seq))
    # sorted by number, each once (should both recorders ever hold an entry, it is one collective)
    return tuple(GroupCollectives(group, members[group], backend, count,
                                  tuple(sorted(set(in_flight.get(key, [])), key=lambda op: (op[1], op[0]))))
                 for key, count in sorted(issued.items()) for group, backend in [key])


def where_in_collectives(collectives: tuple[GroupCollectives, ...] | None) -> str:
    """'in all_reduce #5 of the default group': the oldest collective not completed in each of a rank's groups
    ('' when none, or the recorder could not say)."""
    several = _groups_on_several_backends([collectives])
    places = [f"{record.in_flight[0][0]} #{record.in_flight[0][1]} of {_label(record, several)}"
              for record in collectives or () if record.in_flight]
    return "in " + " and ".join(places) if places else ""


def collectives_report(reported: dict[int, tuple[GroupCollectives, ...] | None]) -> list[str]:
    """One line per (group, backend) where some rank has a collective not completed: at the first such collective,
    #k, which ranks are in it, which called another collective there, which never called it, and which diverged.
    `reported`: every rank that answered, with what its recorder said (None: it could not say)."""
    records: dict[tuple[str, str], dict[int, GroupCollectives]] = {}
    for rank, collectives in reported.items():
        for record in collectives or ():
            records.setdefault((record.name, record.backend), {})[rank] = record
    several = _groups_on_several_backends(reported.values())
    lines = []
    for _, by_rank in sorted(records.items()):
        if any(record.in_flight for record in by_rank.values()):
            some = next(iter(by_rank.values()))
            label = _label(some, several)
            lines.append(f"{label[0].upper()}{label[1:]}: " + _compare(some.ranks, by_rank, reported).strip())
    return lines


def _compare(members: tuple[int, ...], by_rank: dict[int, GroupCollectives], reported: dict) -> str:
    """The facts at the group's first collective not completed, #k, then which rank diverged."""
    first = {rank: record.in_flight[0] for rank, record in by_rank.items() if record.in_flight}
    k = min(seq for _, seq in first.values())
    at_k = {rank: op for rank, (op, seq) in first.items() if seq == k}
    reference = Counter(at_k[rank] for rank in sorted(at_k)).most_common(1)[0][0]
    clusters: dict[str, list[int]] = {}  # what each rank did at #k
    issued: dict[int, int] = {}
    for rank in members:
        record = by_rank.get(rank)
        if rank not in reported or reported[rank] is None:
            clusters.setdefault("unknown", []).append(rank)
        elif rank in at_k:
            clusters.setdefault(f"op:{at_k[rank]}", []).append(rank)
        elif record is None or record.issued < k:
            clusters.setdefault("never", []).append(rank)
            issued[rank] = record.issued if record else 0
        else:
            clusters.setdefault("past", []).append(rank)
    facts = [_fact(kind, ranks, reference, k, issued) for kind, ranks in _ordered(clusters, reference)]
    return "; ".join(facts) + ". " + _verdict(clusters, reference, k)


def _ordered(clusters: dict[str, list[int]], reference: str) -> list[tuple[str, list[int]]]:
    """The reference collective's ranks first, then the other collectives at #k, then the rest."""
    def rank_of(item):
        kind = item[0]
        return (kind != f"op:{reference}", not kind.startswith("op:"), kind)
    return sorted(clusters.items(), key=rank_of)


def _fact(kind: str, ranks: list[int], reference: str, k: int, issued: dict[int, int]) -> str:
    who, plural = rank_list(ranks), len(ranks) > 1
    if kind.startswith("op:"):
        return f"{who} {'are' if plural else 'is'} in {kind[3:]} #{k}"
    if kind == "never":
        counts = sorted({issued[rank] for rank in ranks})
        count = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
        done = "none there" if counts[-1] == 0 else \
            f"{count} collective{'s' * (counts[-1] != 1)} there, all completed"
        return f"{who} never called {reference} #{k} ({'they have' if plural else 'it has'} issued {done})"
    if kind == "past":
        return f"{who} completed #{k} and {'are' if plural else 'is'} past it"
    return f"{who} did not say (no answer, or no Flight Recorder)"


def _verdict(clusters: dict[str, list[int]], reference: str, k: int) -> str:
    """Which ranks diverged: all but the largest group of ranks that did the same at #k. A tie between the
    reference collective and ranks that never called it goes to the collective (a rank skipped it); another tie
    cannot be decided."""
    known = {kind: ranks for kind, ranks in clusters.items() if kind != "unknown"}
    if len(known) == 1:
        only = next(iter(known))
        return ("Every rank that said called it, yet it has not completed: look for what they wait for outside this "
                "group (another group's collective, a point-to-point message)." if only.startswith("op:") else "")
    largest = max(len(ranks) for ranks in known.values())
    tops = [kind for kind, ranks in known.items() if len(ranks) == largest]
    if len(tops) > 1 and set(tops) == {f"op:{reference}", "never"}:
        tops = [f"op:{reference}"]
    if len(tops) > 1:
        return (f"The ranks disagree at collective #{k} ({' vs '.join(kind.removeprefix('op:') for kind in tops)}, "
                f"as many ranks each): which one diverged cannot be told.")
    diverged = sorted(rank for kind, ranks in known.items() if kind != tops[0] for rank in ranks)
    return f"So {rank_list(diverged)} diverged."


def _groups_on_several_backends(reported) -> set[str]:
    """Names of groups whose collectives went over more than one backend ("cpu:gloo,cuda:nccl")."""
    backends: dict[str, set[str]] = {}
    for collectives in reported:
        for record in collectives or ():
            backends.setdefault(record.name, set()).add(record.backend)
    return {name for name, seen in backends.items() if len(seen) > 1}


def _label(record: GroupCollectives, several: set[str]) -> str:
    """'the default group', 'group 2 (ranks 0-1)'; with the backend where the group used more than one."""
    details = ([] if record.name == "0" else [rank_list(record.ranks)]) + [record.backend] * (record.name in several)
    label = "the default group" if record.name == "0" else f"group {record.name}"
    return f"{label} ({', '.join(details)})" if details else label
