"""The graders' private kit: what every grader shares, kept out of labkit.exercises' public API.

    _intercept   one interceptor that wraps or refuses methods (of torch.distributed, a ProcessGroup, a module)
                 for a guard's time, every patch restored by one ExitStack
    _guard       the base of every grader's guard: torch.distributed's communication switched off but what the
                 exercise teaches, each refusal noted and raised as ForbiddenCall
    _group_call  one wrapper of ProcessGroup methods, whose callback sees the call's kind (a str enum), tensors
                 and options, read one way
    _record      one record of a call (`Call`) and the `Recorder` that makes them and keeps their handles
    _store       on a rank: the last attempt's calls and refusals, kept as they happen
    _messages    the sentences every grader shares (refused, hang, unwaited, not a function) and reading a
                 RankError (which failure, which forbidden call)
    _wait_watch  which collectives graded code waited for (handles, futures): the one wait watcher
    _stack       is the course's own answer on the call stack? (the outermost ready-made frame)
    _leftovers   on a rank: what graded code left behind (patched callables, threads, modes, env, cwd, signal
                 handlers), so that the runner stops a pool a solution changed
    _runner      one grading loop driven by an exercise's `Spec`, with one rule after a RankError
    _file_watch  what graded code does to one file, seen where it happens (audit hooks, torch.save, the
                 sync functions followed): notebook 09's watch in the saving process

Ready-made helpers refuse to run while graded from a leaf below every kernel, labkit._refusals. The graders import
these modules by their full names; nothing here is part of labkit's API (each module's `__all__` is empty).
"""

__all__: list[str] = []
