"""The graders' private kit: what every grader's guard shares, kept out of labkit.exercises' public API.

`_intercept`: one interceptor that wraps or refuses methods (of torch.distributed, of a ProcessGroup, of a module)
for a guard's time, every patch restored by one ExitStack. `_group_call`: one wrapper of ProcessGroup methods,
whose callback sees the call's kind (a str enum), tensors and options, read one way. The graders import these
modules by their full names; nothing here is part of labkit's API (each module's `__all__` is empty).
"""

__all__: list[str] = []
