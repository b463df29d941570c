"""A single-stream model of NCCL's point-to-point operations, to check that a pipeline's posted groups of
messages cannot hang (used by test_pipeline_parallel.py and test_pipeline_interleaved.py)."""

from labkit.parallel.pipeline import Action, communication_plan


def stream_deadlock(posts: list[list[tuple]]) -> list | None:
    """A single-stream model of NCCL: None if every rank's operations complete, else each rank's stuck head.

    posts[r]: rank r's groups, in posting order; a group is a tuple of ("send", peer, key, nbytes),
    ("recv", peer, key, nbytes) or ("barrier",). Each rank's stream runs its groups in order, one at a time.
    The k-th send from a to b matches the k-th recv on b from a (NCCL ignores tags); the two complete only
    together, when both are in their stream's running group (a group's operations run at once: a
    batch_isend_irecv); a barrier completes when it is in every rank's running group. A group ends when all
    its operations have."""
    counts, streams = {}, []
    for r, groups in enumerate(posts):
        stream = []
        for group in groups:
            ops = []
            for op in group:
                pair = ("barrier",) if op[0] == "barrier" else (r, op[1]) if op[0] == "send" else (op[1], r)
                key = (op[0], pair, r if op[0] == "barrier" else None)  # barriers: counted per rank
                index = counts[key] = counts.get(key, -1) + 1
                ops.append((op[0], pair, index, op[2:]))
            stream.append(ops)
        streams.append(stream)
    head, done = [0] * len(posts), [set() for _ in posts]

    def running(r):
        return streams[r][head[r]] if head[r] < len(streams[r]) else []

    while any(head[r] < len(streams[r]) for r in range(len(posts))):
        progressed = False
        for r in range(len(posts)):
            for op in running(r):
                if op in done[r]:
                    continue
                if op[0] == "barrier" and all(op in running(q) for q in range(len(posts))):
                    for q in range(len(posts)):
                        done[q].add(op)
                    progressed = True
                elif op[0] == "send":
                    match = next((o for o in running(op[1][1]) if o[:3] == ("recv", op[1], op[2])), None)
                    if match is not None and match not in done[op[1][1]]:
                        assert match[3] == op[3], f"send {op} meets recv {match}: different messages"
                        done[r].add(op)
                        done[op[1][1]].add(match)
                        progressed = True
        for r in range(len(posts)):
            if running(r) and all(op in done[r] for op in running(r)):
                head[r], done[r] = head[r] + 1, set()
                progressed = True
        if not progressed:
            return [running(r) for r in range(len(posts))]
    return None


def plan_posts(kind, p, m, chunks=1, receives_ahead=False):
    """communication_plan's groups as stream_deadlock reads them (no sizes): a barrier first, as run_pipeline.
    A message is (op, peer, what, micro-batch, chunk)."""
    return [[(("barrier",),)] + [tuple((msg.op, msg.peer, msg.what, msg.microbatch, msg.chunk) for msg in step)
                              for step in steps if not isinstance(step, Action)]
            for steps in communication_plan(kind, p, m, chunks, receives_ahead)]
