"""Recurrent layers at O2 on both front ends: input, weights and states in one dtype.

The torch.export front end records ``aten.lstm``/``gru``/``rnn_*`` (and the cells) with the states
a module creates as float32 ``zeros`` and its weights as stored; their kernels refuse mixed
dtypes, so O2 casts every argument (tensors inside ``Tensor[]`` arguments included) to the low
dtype, as autocast runs them. Returned states get the dtype the policy gives outputs. Each model is
checked against torch.autocast with the relative oracle, and a training step must move every
parameter.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import amp_fx
from amp_fx.core.policy import preset
from amp_fx.testing import assert_equivalent

BF16 = torch.bfloat16


class Layer(nn.Module):
    """A recurrent layer whose initial states it creates itself, then a linear head."""

    def __init__(self, layer: nn.Module, width: int) -> None:
        super().__init__()
        self.layer, self.head = layer, nn.Linear(width, 2)

    def forward(self, x):
        return self.head(self.layer(x)[0])


class Cells(nn.Module):
    """A cell unrolled over three steps from no state (the cell makes its zeros)."""

    def __init__(self, cell: nn.Module, pairs: bool) -> None:
        super().__init__()
        self.cell, self.pairs, self.head = cell, pairs, nn.Linear(6, 2)

    def forward(self, x):
        state, outputs = None, []
        for step in range(3):
            state = self.cell(x[:, step], state)
            outputs.append(state[0] if self.pairs else state)
        return self.head(torch.stack(outputs, 1))


class PassedStates(nn.Module):
    """States passed in by the caller and returned with the outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.gru, self.head = nn.GRU(4, 6, num_layers=2), nn.Linear(6, 2)

    def forward(self, x, h0):
        y, h = self.gru(x, h0)
        return self.head(y), h


class Functional(nn.Module):
    """torch.rnn_tanh called directly, its weights in a list and its state built from the input."""

    def __init__(self) -> None:
        super().__init__()
        self.w_ih, self.w_hh = nn.Parameter(0.3 * torch.randn(6, 4)), nn.Parameter(0.3 * torch.randn(6, 6))
        self.b_ih, self.b_hh = nn.Parameter(torch.zeros(6)), nn.Parameter(0.1 * torch.randn(6))
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        h0 = torch.zeros(1, x.shape[0], 6)
        params = [self.w_ih, self.w_hh, self.b_ih, self.b_hh]
        y, _ = torch.rnn_tanh(x, h0, params, True, 1, 0.0, self.training, False, True)
        return self.head(y)


def _cases():
    torch.manual_seed(0)
    batch_first = torch.randn(2, 5, 4)
    return {
        "lstm_two_layers_bidirectional": (
            Layer(nn.LSTM(4, 6, num_layers=2, bidirectional=True, batch_first=True), 12),
            (batch_first,),
        ),
        "lstm_projected": (Layer(nn.LSTM(4, 6, proj_size=3, batch_first=True), 3), (batch_first,)),
        "gru_time_first": (Layer(nn.GRU(4, 6), 6), (torch.randn(5, 2, 4),)),
        "rnn_relu": (Layer(nn.RNN(4, 6, nonlinearity="relu", batch_first=True), 6), (batch_first,)),
        "lstm_cell": (Cells(nn.LSTMCell(4, 6), pairs=True), (batch_first,)),
        "gru_cell": (Cells(nn.GRUCell(4, 6), pairs=False), (batch_first,)),
        "rnn_tanh_cell": (Cells(nn.RNNCell(4, 6), pairs=False), (batch_first,)),
        "functional_rnn_tanh": (Functional(), (batch_first,)),
        "states_passed_in": (PassedStates(), (torch.randn(5, 2, 4), torch.randn(2, 2, 6))),
    }


def _convert(model: nn.Module, front_end: str) -> nn.Module:
    return amp_fx.convert(copy.deepcopy(model), policy=preset("O2", BF16, "cpu"), front_end=front_end)


@pytest.mark.parametrize("name", sorted(_cases()))
@pytest.mark.parametrize("front_end", ["fx", "export"])
def test_recurrent_layers_run_as_accurately_as_autocast(name, front_end) -> None:
    model, inputs = _cases()[name]
    converted = _convert(model, front_end)
    outputs = converted(*inputs)
    for out in outputs if isinstance(outputs, tuple) else (outputs,):
        assert type(out) is torch.Tensor and out.dtype == torch.float32  # states returned too
    assert_equivalent(model, converted, inputs)


@pytest.mark.parametrize("name", sorted(_cases()))
@pytest.mark.parametrize("front_end", ["fx", "export"])
def test_a_training_step_moves_every_parameter(name, front_end) -> None:
    model, inputs = _cases()[name]
    converted = _convert(model, front_end)
    optimizer = amp_fx.optim.FusedAdam(converted.parameters(), lr=1e-2)
    before = {n: p.detach().clone() for n, p in converted.named_parameters()}
    outputs = converted(*inputs)
    first = outputs[0] if isinstance(outputs, tuple) else outputs
    first.float().square().mean().backward()
    optimizer.step()
    assert not [n for n, p in converted.named_parameters() if torch.equal(p, before[n])]
