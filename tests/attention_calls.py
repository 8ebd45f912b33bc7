"""A dispatch mode that counts the attention kernels that actually run, shared by the kept-attention
tests (tests/unit/test_kept_attention.py, tests/distributed/test_megatron_kept_attention.py).
Counted at the aten level: a kernel served from a selective checkpoint's cache is not a call."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class AttentionCalls(TorchDispatchMode):
    """Counts the forward attention kernels that run (`unirl.backends.kept_attention`'s list), the
    outermost only (an attention op that calls another inside counts once)."""

    def __init__(self) -> None:
        super().__init__()
        self.forward = 0
        self._depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from unirl.backends.kept_attention import is_attention_op

        if not is_attention_op(func):
            return func(*args, **(kwargs or {}))
        self.forward += self._depth == 0
        self._depth += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self._depth -= 1
