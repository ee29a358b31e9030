"""A fused op's output in the caller's shape, as a tensor of its own.

The kernels compute on (rows, width) buffers; the ops give the result the input's shape. A
``view`` would do it without a copy, but autograd records a view returned by a custom Function or
custom op as "created inside a custom Function" (one output) or "one of multiple views" (several),
and refuses any in-place op on it: ``nn.ReLU(inplace=True)`` after a fused norm or activation
would fail where it works after the chain the op replaces. `reshaped_output` gives the buffer the
shape without that record: no copy, and the buffer's base is held by nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

__all__ = ["reshaped_output"]


def reshaped_output(buffer: Tensor, shape: Sequence[int]) -> Tensor:
    """``buffer.view(shape)`` that autograd does not track as a view, for a fused op to return:
    the next op may modify it in place, as it may an output of the torch ops the op replaces.
    ``buffer`` must be the kernel's own fresh output, which nothing else reads or writes.

    Example:
        >>> import torch
        >>> out = reshaped_output(torch.zeros(6, 4), (2, 3, 4))
        >>> out.shape, out._is_view()
        (torch.Size([2, 3, 4]), False)
    """
    if buffer.shape == tuple(shape) and not buffer._is_view():
        return buffer
    # A detached tensor shares the storage (no copy) and carries no view record. (view of ints,
    # not of a torch.Size: the latter parses slower, and every fused call pays it.)
    return buffer.view(*shape).detach()
