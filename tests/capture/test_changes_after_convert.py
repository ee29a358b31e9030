"""Changes made to a converted model after its first call take effect (issue 35), torch.export
front end (`amp_fx.capture.changes`): each change is made to the eager model and to the converted
one, and the converted model's output after it is compared with the eager model's.

Classes of change, each with members the issue does not name: submodules added, replaced and
deleted (attribute, ModuleList, ModuleDict); parameters and buffers replaced, set to None,
deleted; attributes forward reads (dropout ``p``, norm ``eps``, a plain config object's flags);
hooks registered and removed (forward, forward pre, with kwargs); a submodule's train/eval mode;
``requires_grad``; Hugging Face config flags (``output_hidden_states``, ``output_attentions``,
``use_cache``, ``return_dict``), a classification head with more labels, a deleted decoder layer,
an RMSNorm's eps, PEFT's LoRA put in after a first call; and under torch.compile.

The torch.fx front end (`amp_fx.capture.graph_follower.GraphFollower`): leaves replaced (a fused norm
among them), parameters replaced, added to a leaf or set to None, eps, hooks on leaves (a fused
norm's too), a leaf's mode, dropout ``p``, train/eval, deepcopies; and the changes its graph cannot
follow (a module or parameter it uses deleted, one added to traced-through code, a hook on a
traced-through module, a leaf replaced by a composite), refused at each call with the fix.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import pytest
import torch
from torch import nn

import amp_fx
from amp_fx.capture.captured_model import capture_states
from amp_fx.testing import assert_close_normwise, grad_tolerances, tolerances

WIDTH = 8
RTOL, ATOL = tolerances(torch.bfloat16)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.norm(self.fc(x)))


class Net(nn.Module):
    """Blocks in a ModuleList, optional extras in a ModuleDict, a plain config object, a buffer and
    a parameter read only if present."""

    def __init__(self) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(double=False, extra_scale=1.0)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.extras = nn.ModuleDict({"a": nn.Linear(WIDTH, WIDTH)})
        self.head = nn.Linear(WIDTH, 3)
        self.scale = nn.Parameter(torch.full((WIDTH,), 1.5))
        self.register_buffer("shift", torch.full((WIDTH,), 0.25))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        for extra in self.extras.values():
            x = x + self.config.extra_scale * extra(x)
        if getattr(self, "scale", None) is not None:
            x = x * self.scale
        x = x + self.shift
        if self.config.double:
            x = x * 2
        return self.head(x)


def _double(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output * 2


def _negate_input(module: nn.Module, args: tuple) -> tuple:
    return (-args[0],)


def _add_three(module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor:
    return output + 3


CHANGES: dict[str, Callable[[nn.Module], object]] = {
    "replace head (more outputs)": lambda m: setattr(m, "head", nn.Linear(WIDTH, 7)),
    "replace a block's Linear": lambda m: setattr(m.blocks[1], "fc", nn.Linear(WIDTH, WIDTH)),
    "append a block": lambda m: m.blocks.append(Block().eval()),
    "insert a block": lambda m: m.blocks.insert(0, Block().eval()),
    "delete a block": lambda m: m.blocks.__delitem__(1),
    "ModuleDict entry added": lambda m: m.extras.update({"b": nn.Linear(WIDTH, WIDTH)}),
    "ModuleDict entry popped": lambda m: m.extras.pop("a"),
    "parameter replaced": lambda m: setattr(m, "scale", nn.Parameter(torch.full((WIDTH,), -2.0))),
    "parameter deleted": lambda m: delattr(m, "scale"),
    "bias set to None": lambda m: setattr(m.head, "bias", None),
    "buffer replaced": lambda m: m.register_buffer("shift", torch.full((WIDTH,), 3.0)),
    "norm eps": lambda m: [setattr(b.norm, "eps", 10.0) for b in m.blocks],
    "config flag": lambda m: setattr(m.config, "double", True),
    "config value": lambda m: setattr(m.config, "extra_scale", -4.0),
    "forward hook": lambda m: m.blocks[0].register_forward_hook(_double),
    "forward pre-hook": lambda m: m.blocks[2].fc.register_forward_pre_hook(_negate_input),
    "forward hook with kwargs": lambda m: m.extras["a"].register_forward_hook(_add_three, with_kwargs=True),
    "forward hook removed": lambda m: m._handle.remove(),
    "a block's norm in eval mode": lambda m: m.blocks[0].norm.eval(),
}


def _net() -> Net:
    torch.manual_seed(0)
    return Net().eval()


def _with_hook(model: nn.Module) -> nn.Module:
    # A hook present at the first call, removed by one change.
    model._handle = model.blocks[1].register_forward_hook(_double)
    return model


def _check(converted: nn.Module, eager: nn.Module, x: torch.Tensor) -> None:
    with torch.no_grad():
        actual, expected = converted(x), eager(x)
    assert type(actual) is torch.Tensor
    assert actual.shape == expected.shape
    assert_close_normwise(actual.float(), expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", list(CHANGES))
def test_change_after_first_call_takes_effect(name: str) -> None:
    eager = _net()
    converted = _with_hook(amp_fx.convert(eager, "O2", dtype=torch.bfloat16, front_end="export"))
    _with_hook(eager)
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1))
    _check(converted, eager, x)
    for model in (eager, converted):
        torch.manual_seed(2)  # new modules: the same weights in both
        CHANGES[name](model)
    _check(converted, eager, x)


@pytest.mark.parametrize("front_end", ["export", "fx"])
def test_dropout_p_and_train_mode_take_effect(front_end: str) -> None:
    """``p = 0`` on every Dropout makes training calls deterministic, as eagerly; ``.eval()`` and
    ``.train()`` switch graphs both ways."""
    eager = _net().train()
    converted = amp_fx.convert(eager, "O2", dtype=torch.bfloat16, front_end=front_end).train()
    x = torch.randn(4, WIDTH)
    assert not torch.equal(converted(x), converted(x))  # dropout at p=0.5
    for model in (eager, converted):
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
    _check(converted, eager, x)
    converted.eval()
    eager.eval()
    _check(converted, eager, x)


def test_new_parameters_are_stored_as_convert_stores_them() -> None:
    """At O2 a new head's weights are stored low, as `convert` stores a Linear's, keeping the
    parameter objects (an optimizer built after the swap holds them); a new LayerNorm's stay FP32."""
    converted = amp_fx.convert(_net(), "O2", dtype=torch.bfloat16, front_end="export")
    x = torch.randn(4, WIDTH)
    converted(x)
    head, norm = nn.Linear(WIDTH, 5), nn.LayerNorm(WIDTH)
    converted.head, converted.blocks[0].norm = head, norm
    weight = head.weight
    optimizer = torch.optim.SGD(converted.parameters(), lr=0.1)
    converted(x).float().sum().backward()
    assert converted.head.weight is weight and weight.dtype == torch.bfloat16
    assert norm.weight.dtype == torch.float32
    assert weight.grad is not None and weight.grad.dtype == torch.bfloat16
    optimizer.step()


def test_requires_grad_change_follows() -> None:
    """Freezing parameters after a first call: they get no gradient, the others get eager's."""
    eager = _net()
    converted = amp_fx.convert(eager, "O1", dtype=torch.bfloat16, front_end="export")
    x = torch.randn(4, WIDTH)
    converted(x).sum().backward()
    for model in (eager, converted):
        model.zero_grad()
        for param in model.blocks.parameters():
            param.requires_grad_(False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager(x).float().sum().backward()
    converted(x).float().sum().backward()
    assert all(param.grad is None for param in converted.blocks.parameters())
    rtol, atol = grad_tolerances(torch.bfloat16)
    assert_close_normwise(converted.head.weight.grad, eager.head.weight.grad, rtol=rtol, atol=atol)


def _graphs(model: nn.Module) -> list[int]:
    return [id(graph) for _, state in capture_states(model) for graph in state.graphs]


def test_nothing_changed_no_recapture() -> None:
    """Calls with nothing changed, ``.train()`` on a model in training, a train/eval round trip
    and writes of an attribute's same value reuse the graphs captured."""
    converted = amp_fx.convert(_net(), "O2", dtype=torch.bfloat16, front_end="export").train()
    x = torch.randn(4, WIDTH)
    converted(x)
    converted.eval()(x)
    graphs = _graphs(converted)
    converted.train()(x)
    converted.train()(x)
    converted.eval()(x)
    converted.config.double = False
    converted.blocks[0].drop.p = converted.blocks[0].drop.p
    converted.head.weight = converted.head.weight
    converted(x)
    assert _graphs(converted) == graphs and len(graphs) == 2


def test_compiled_converted_model_follows_a_change() -> None:
    """Under torch.compile the check is traced: a change recompiles and the call follows it."""
    eager = _net()
    converted = amp_fx.convert(eager, "O2", dtype=torch.bfloat16, front_end="export")
    x = torch.randn(4, WIDTH)
    converted(x)  # captured before compiling (docs/DESIGN.md)
    torch._dynamo.reset()
    compiled = torch.compile(converted, backend="eager")
    _check(compiled, eager, x)
    for model in (eager, converted):
        torch.manual_seed(2)
        model.config.double = True
        model.head = nn.Linear(WIDTH, 7)
    _check(compiled, eager, x)
    torch._dynamo.reset()


def _gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2, n_positions=64)
    config._attn_implementation = "eager"  # attention weights can be returned
    return transformers.GPT2LMHeadModel(config)


def _bert() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, num_labels=3,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config)


def _llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _rms_norm_eps(model: nn.Module) -> None:
    for module in model.modules():
        if hasattr(module, "variance_epsilon"):
            module.variance_epsilon = 1.0


HF_CHANGES: dict[str, tuple[Callable[[], nn.Module], Callable[[nn.Module], object]]] = {
    "gpt2 output_hidden_states": (_gpt2, lambda m: setattr(m.config, "output_hidden_states", True)),
    "gpt2 output_attentions": (_gpt2, lambda m: setattr(m.config, "output_attentions", True)),
    "gpt2 use_cache off": (_gpt2, lambda m: setattr(m.config, "use_cache", False)),
    "gpt2 attention unscaled": (
        _gpt2,
        lambda m: setattr(m.transformer.h[0].attn, "scale_attn_weights", False),
    ),
    "bert output_hidden_states": (_bert, lambda m: setattr(m.config, "output_hidden_states", True)),
    "gpt2 lm_head replaced": (_gpt2, lambda m: setattr(m, "lm_head", nn.Linear(32, 128, bias=False))),
    "bert head with 7 labels": (_bert, lambda m: setattr(m, "classifier", nn.Linear(32, 7))),
    "bert pooler activation": (_bert, lambda m: setattr(m.bert.pooler, "activation", nn.ReLU())),
    "llama layer deleted": (_llama, lambda m: m.model.layers.__delitem__(1)),
    "llama RMSNorm eps": (_llama, _rms_norm_eps),
}


def _fields(output: object) -> list[tuple[str, object]]:
    if isinstance(output, tuple):
        return list(enumerate(output))  # type: ignore[arg-type]
    return list(output.items())  # type: ignore[attr-defined]


def _check_hf(actual: object, expected: object) -> None:
    assert type(actual) is type(expected)
    fields, expected_fields = _fields(actual), _fields(expected)
    assert [key for key, _ in fields] == [key for key, _ in expected_fields]
    for (key, value), (_, reference) in zip(fields, expected_fields, strict=True):
        tensors = [value] if isinstance(value, torch.Tensor) else value
        references = [reference] if isinstance(reference, torch.Tensor) else reference
        if not isinstance(tensors, tuple | list):
            assert type(tensors) is type(references), key  # a cache
            continue
        assert len(tensors) == len(references), key
        for tensor, ref in zip(tensors, references, strict=True):
            assert type(tensor) is torch.Tensor and tensor.shape == ref.shape, key
            assert_close_normwise(tensor.float(), ref, rtol=RTOL, atol=ATOL, name=str(key))


@pytest.mark.parametrize("name", list(HF_CHANGES))
def test_hugging_face_change_after_first_call_takes_effect(name: str) -> None:
    build, change = HF_CHANGES[name]
    torch.manual_seed(0)
    eager = build().eval()
    converted = amp_fx.convert(eager, "O2", dtype=torch.bfloat16)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _check_hf(converted(input_ids=ids), eager(input_ids=ids))
        for model in (eager, converted):
            torch.manual_seed(2)
            change(model)
        _check_hf(converted(input_ids=ids), eager(input_ids=ids))


def test_peft_lora_after_first_call_takes_effect() -> None:
    """``get_peft_model`` on a converted Llama already called: the LoRA layers run (their random
    B makes the logits differ from the base model's) and train, as on the eager model."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    eager = _llama()
    converted = amp_fx.convert(eager, "O2", dtype=torch.bfloat16)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    before = converted(input_ids=ids).logits.detach()
    models = []
    for model in (eager, converted):
        torch.manual_seed(3)
        config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        models.append(peft.get_peft_model(model, config))
    eager_peft, converted_peft = models
    actual, expected = converted_peft(input_ids=ids).logits, eager_peft(input_ids=ids).logits
    assert type(actual) is torch.Tensor
    assert_close_normwise(actual.float(), expected, rtol=RTOL, atol=ATOL)
    with pytest.raises(AssertionError):
        assert_close_normwise(actual.float(), before.float(), rtol=RTOL, atol=ATOL)
    loss = converted_peft(input_ids=ids, labels=ids).loss
    assert_close_normwise(loss.float(), eager_peft(input_ids=ids, labels=ids).loss, rtol=RTOL, atol=ATOL)
    loss.backward()
    lora = [param for name, param in converted_peft.named_parameters() if "lora_" in name]
    assert lora and all(param.grad is not None for param in lora)
    assert all(param.grad is None for name, param in converted_peft.named_parameters() if "lora_" not in name)


# -- The torch.fx front end (`amp_fx.capture.graph_follower.GraphFollower`). Its modules traced through
# are plain holders, so changes reach layers by name (``getattr(m.blocks, "1")``), as on the eager
# model.


def _layer(model: nn.Module, index: int) -> nn.Module:
    return getattr(model.blocks, str(index))


FX_CHANGES: dict[str, Callable[[nn.Module], object]] = {
    "replace head (more outputs)": lambda m: setattr(m, "head", nn.Linear(WIDTH, 7)),
    "replace a block's Linear": lambda m: setattr(_layer(m, 1), "fc", nn.Linear(WIDTH, WIDTH)),
    "replace a fused norm": lambda m: setattr(_layer(m, 2), "norm", nn.LayerNorm(WIDTH, eps=0.5)),
    "parameter replaced": lambda m: setattr(m, "scale", nn.Parameter(torch.full((WIDTH,), -2.0))),
    "bias set to None": lambda m: setattr(m.head, "bias", None),
    "bias added": lambda m: setattr(_layer(m, 0).fc, "bias", nn.Parameter(torch.ones(WIDTH))),
    "buffer replaced": lambda m: m.register_buffer("shift", torch.full((WIDTH,), 3.0)),
    "norm eps": lambda m: [setattr(_layer(m, i).norm, "eps", 10.0) for i in range(3)],
    "forward hook on a fused norm": lambda m: _layer(m, 0).norm.register_forward_hook(_double),
    "forward pre-hook": lambda m: _layer(m, 2).fc.register_forward_pre_hook(_negate_input),
    "forward hook with kwargs": lambda m: m.extras.a.register_forward_hook(_add_three, with_kwargs=True),
    "forward hook removed": lambda m: m._handle.remove(),
    "a block's norm in train mode": lambda m: _layer(m, 0).norm.train(),
}


def _with_leaf_hook(model: nn.Module) -> nn.Module:
    model._handle = model.head.register_forward_hook(_double)
    return model


def _fx(model: nn.Module, opt_level: str = "O2") -> nn.Module:
    return amp_fx.convert(model, opt_level, dtype=torch.bfloat16, front_end="fx")


@pytest.mark.parametrize("name", list(FX_CHANGES))
def test_fx_change_after_conversion_takes_effect(name: str) -> None:
    eager = _net()
    converted = _with_leaf_hook(_fx(eager))
    _with_leaf_hook(eager)
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1))
    _check(converted, eager, x)
    for model in (eager, converted):
        torch.manual_seed(2)  # new modules: the same weights in both
        FX_CHANGES[name](model)
    _check(converted, eager, x)


FX_REFUSED: dict[str, tuple[Callable[[nn.Module], object], str]] = {
    "parameter deleted": (lambda m: delattr(m, "scale"), "`scale`"),
    "a called Linear deleted": (lambda m: delattr(_layer(m, 1), "fc"), "`blocks.1.fc`"),
    "a block deleted": (lambda m: delattr(m.blocks, "2"), "`blocks.2."),
    "a module added to traced code": (
        lambda m: m.extras.add_module("b", nn.Linear(WIDTH, WIDTH)),
        "`extras.b`",
    ),
    "a parameter added to traced code": (
        lambda m: m.register_parameter("offset", nn.Parameter(torch.ones(WIDTH))),
        "`offset`",
    ),
    "hook on a traced-through block": (lambda m: _layer(m, 0).register_forward_hook(_double), "`blocks.0`"),
    "a leaf replaced by a composite": (
        lambda m: setattr(m, "head", nn.Sequential(nn.Linear(WIDTH, 3), nn.ReLU())),
        "`head`",
    ),
}


@pytest.mark.parametrize("name", list(FX_REFUSED))
def test_fx_change_it_cannot_follow_is_refused_at_each_call(name: str) -> None:
    """A change that needs the traced-through code the GraphModule does not keep: each call raises,
    naming what changed and the fix, before any graph runs (a forward hook would count it)."""
    change, named = FX_REFUSED[name]
    converted = _fx(_net())
    x = torch.randn(4, WIDTH)
    converted(x)
    runs = []
    converted.head.register_forward_hook(lambda *_: runs.append(1))
    converted(x)
    change(converted)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="convert that again") as raised:
            converted(x)
        assert named in str(raised.value)
    assert len(runs) == 1


def test_fx_new_parameters_are_stored_as_convert_stores_them() -> None:
    """At O2 a new head's weights are stored low as conversion stores a Linear's, keeping the
    parameter objects an optimizer holds; a new LayerNorm's stay FP32; nothing else changes."""
    converted = _fx(_net())
    x = torch.randn(4, WIDTH)
    converted(x)
    stored = {name: tensor.dtype for name, tensor in converted.state_dict().items()}
    head, norm = nn.Linear(WIDTH, 5), nn.LayerNorm(WIDTH)
    converted.head, _layer(converted, 0).norm = head, norm
    weight = head.weight
    optimizer = torch.optim.SGD(converted.parameters(), lr=0.1)
    converted(x).float().sum().backward()
    assert converted.head.weight is weight and weight.dtype == torch.bfloat16
    assert norm.weight.dtype == torch.float32
    assert weight.grad is not None and weight.grad.dtype == torch.bfloat16
    optimizer.step()
    after = {name: tensor.dtype for name, tensor in converted.state_dict().items()}
    assert {k: v for k, v in after.items() if not k.startswith("head")} == {
        k: v for k, v in stored.items() if not k.startswith("head")
    }


def test_fx_nothing_changed_no_rewrite() -> None:
    """Calls with nothing changed, train/eval round trips and writes of the same value keep the
    graph; a change rewrites it once."""
    converted = _fx(_net()).train()
    x = torch.randn(4, WIDTH)
    converted(x)
    graph = converted.graph
    converted.eval()(x)
    converted.train()(x)
    converted.train()(x)
    _layer(converted, 0).drop.p = _layer(converted, 0).drop.p
    converted.head.weight = converted.head.weight
    converted(x)
    assert converted.graph is graph
    _layer(converted, 1).norm.eps = 0.1
    converted(x)
    changed = converted.graph
    assert changed is not graph
    converted(x)
    assert converted.graph is changed


def test_fx_copy_follows_its_own_changes() -> None:
    """A deepcopy of a converted GraphModule follows changes made to it, not to the original."""
    import copy

    eager = _net()
    converted = _fx(eager)
    x = torch.randn(4, WIDTH)
    converted(x)
    copied = copy.deepcopy(converted)
    for model in (eager, copied):
        torch.manual_seed(2)
        model.head = nn.Linear(WIDTH, 6)
    _check(copied, eager, x)
    assert converted(x).shape == (4, 3)


def test_export_mode_switch_needs_no_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Switching a whole model between train and eval compares modes, without a walk; a module
    switched on its own is still seen."""
    from amp_fx.capture import changes

    converted = amp_fx.convert(_net(), "O2", dtype=torch.bfloat16, front_end="export")
    x = torch.randn(4, WIDTH)
    converted.train()(x)
    converted.eval()(x)
    walks = []
    take = changes.take
    monkeypatch.setattr("amp_fx.capture.captured_model.take", lambda m: walks.append(1) or take(m))
    for _ in range(2):
        converted.train()(x)
        converted.eval()(x)
    assert not walks
    converted.blocks[0].norm.train()
    converted(x)
    assert walks


def test_fx_hooks_on_the_model_itself_fire_without_a_rewrite() -> None:
    """A hook on the converted GraphModule itself (as FSDP2 and DDP helpers put there) runs when the
    model is called, whatever its graph traced: no rewrite, no refusal."""
    eager = _net()
    converted = _fx(eager)
    x = torch.randn(4, WIDTH)
    converted(x)
    graph = converted.graph
    for model in (eager, converted):
        model.register_forward_hook(lambda module, args, output: output * 3)
        model.register_forward_pre_hook(lambda module, args: (args[0] + 1,))
    _check(converted, eager, x)
    assert converted.graph is graph


@pytest.mark.parametrize("front_end", ["export", "fx"])
def test_a_change_to_another_model_recompiles_nothing(front_end: str) -> None:
    """Each model counts its own changes: changing one converted model leaves another's compiled
    graph valid (no recompile, no graph break into the change check)."""
    compiled_model = amp_fx.convert(_net(), "O2", dtype=torch.bfloat16, front_end=front_end)
    other = amp_fx.convert(_net(), "O2", dtype=torch.bfloat16, front_end=front_end)
    x = torch.randn(4, WIDTH)
    compiled_model(x), other(x)  # captured (export) before compiling, as README says
    compiles = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        compiles.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(compiled_model, backend=backend, fullgraph=True)
    with torch.no_grad():
        expected = compiled(x)
        for module in other.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
        other(x)
        torch.testing.assert_close(compiled(x), expected, rtol=0, atol=0)
    torch._dynamo.reset()
    assert len(compiles) == 1
