"""Activations, alone or gating a second projection, computed in fp32 from fp16/bf16 inputs: the
kernel family's contract.

Two implementations take the same arguments and return the same values: ``reference`` (plain
torch, any device) and ``triton`` (CUDA tensors, or CPU under ``TRITON_INTERPRET=1``);
``arguments`` holds the checks both run. ``amp_fx.ops.activations`` is the op built on them.

The math. ``activation`` names act, one of `ACTIVATIONS`; every value is read once, widened to
fp32, and each result rounded once to the inputs' dtype::

    silu(g)      = g * sigmoid(g)
    gelu(g)      = 0.5 * g * (1 + erf(g / sqrt(2)))
    gelu_tanh(g) = 0.5 * g * (1 + tanh(sqrt(2 / pi) * (g + 0.044715 * g^3)))

    gated:  out = act(g) * u              grad_g = dy * u * act'(g)    grad_u = dy * act(g)
    alone:  out = act(x)                  grad_x = dy * act'(x)

The backward recomputes act(g) and act'(g) from the saved input: nothing but the inputs is saved.
``gelu_tanh`` is torch's ``F.gelu(approximate="tanh")``, and Hugging Face's ``gelu_new`` written
out with ``torch.pow`` (the same formula).

The kernels (``KERNELS``); every tensor is 2-D (rows, columns) in fp16, bf16 or fp32, at any
strides, all of one shape, dtype and device; outputs are contiguous, in the inputs' dtype:

- ``gated_activation_forward(gate, up, activation, record=None) -> out``
- ``gated_activation_backward(grad_out, gate, up, activation) -> (grad_gate, grad_up)``
- ``activation_forward(input, activation, record=None) -> out``
- ``activation_backward(grad_out, input, activation) -> grad_input``

``record``: None, or ``(amax, counts, (out_index,))`` (``amp_fx.kernels.range_stats``'
``KernelRecord``): the range statistics of out added to that entry by the same launch, as
``record_range_(out, amax, counts, out_index)`` would add them.

Neither implementation reads a tensor value on the host.
"""

KERNELS = (
    "gated_activation_forward",
    "gated_activation_backward",
    "activation_forward",
    "activation_backward",
)

# The activations the kernels compute, by the name the contract above gives each.
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
