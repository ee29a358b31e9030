"""Mixture-of-experts at O2 (issue 37): experts compute in the low dtype, routers in FP32.

O2 lowers grouped expert products (``aten._grouped_mm``, on no autocast list), batched experts
(``bmm`` over the expert dimension) and looped experts (a Linear per expert), as MoE training
stacks run them; softmax and top-k of the router stay FP32. Its error against FP32 is measured
against autocast with the experts run low the same way (`amp_fx.testing.running_low`, the
oracle's default for O2), and must be within `RELATIVE_BOUND` of it. O1 stays autocast bit for
bit; ``set_op("_grouped_mm", "fp32")`` keeps autocast's numerics for the experts.

The layouts are written here in plain torch (three expert layouts, four routers, a shared expert)
and taken from transformers' MoE families on their default call, with each
``experts_implementation`` the installed version offers.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import amp_fx
from amp_fx.core.policy import Rule, preset
from amp_fx.optim import FusedAdam
from amp_fx.testing import (
    RELATIVE_BOUND,
    assert_equivalent,
    error_ratio,
    lowered_unlisted_ops,
    running_low,
    with_autocast,
)

BF16 = torch.bfloat16
FP32 = torch.float32
HIDDEN, FFN, EXPERTS, TOKENS = 16, 32, 4, 24  # 16-byte aligned rows: _grouped_mm's CPU kernel needs them

_aten = torch.ops.aten
_MATMULS = {_aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten._grouped_mm}
_ADDED_TO_FIRST = {_aten.addmm, _aten.baddbmm}  # their first argument is what the product is added to
_ROUTER_OPS = {_aten.topk, _aten._softmax, _aten.softmax, _aten.sigmoid}


class OpDtypes(TorchDispatchMode):
    """Counts, per (op, dtype it computed in), the output elements of matrix products and the
    calls of router ops (softmax, sigmoid, top-k) by their input's dtype. Outer products (inner
    dimension 1) sum nothing and are left out: transformers 5.17 computes its rotary angles as
    one (``inv_freq @ position_ids``, FP32 with autocast off), 5.24 as a product of elements."""

    def __init__(self) -> None:
        super().__init__()
        self.matmul_elements: Counter[tuple[str, torch.dtype]] = Counter()
        self.router_calls: Counter[tuple[str, torch.dtype]] = Counter()
        self.chosen: list[torch.Tensor] = []  # the indices of each top-k call
        self.fp32_widths: set[int] = set()  # the last dimension of each FP32 product's output

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        packet = func.overloadpacket
        if packet in _MATMULS and (args[1] if packet in _ADDED_TO_FIRST else args[0]).shape[-1] > 1:
            operand = next(a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2)
            self.matmul_elements[(packet.__name__, operand.dtype)] += out.numel()
            if operand.dtype == FP32:
                self.fp32_widths.add(out.shape[-1])
        elif packet in _ROUTER_OPS:
            self.router_calls[(packet.__name__, args[0].dtype)] += 1
            if packet is _aten.topk:
                self.chosen.append(out[1])
        return out

    def fp32_elements(self) -> int:
        return sum(n for (_, dtype), n in self.matmul_elements.items() if dtype == FP32)

    def low_share(self, ops: set[str] | None = None) -> float:
        """The share of matrix-product output elements (of ``ops``, default all) computed in bf16."""
        counted = {k: n for k, n in self.matmul_elements.items() if ops is None or k[0] in ops}
        return sum(n for (_, dtype), n in counted.items() if dtype == BF16) / max(1, sum(counted.values()))


def op_dtypes(model: Any, *args: Any, **kwargs: Any) -> OpDtypes:
    with torch.no_grad(), OpDtypes() as counted:
        model(*args, **kwargs)
    return counted


# ---- MoE layers in plain torch ----------------------------------------------------------------------
def route(logits: torch.Tensor, router: str, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-choice routers: (weights (T, k) in FP32, expert ids (T, k))."""
    logits = logits.float()
    if router == "softmax_topk":  # Mixtral: softmax, top-k, renormalized
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
        return weights / weights.sum(-1, keepdim=True), ids
    if router == "sigmoid_topk":  # DeepSeek-V3 style: sigmoid scores, top-k, normalized
        scores = torch.sigmoid(logits)
        weights, ids = torch.topk(scores, k, dim=-1)
        return weights / (weights.sum(-1, keepdim=True) + 1e-20), ids
    if router == "switch":  # Switch Transformer: top-1 of the softmax, unnormalized
        return torch.topk(torch.softmax(logits, dim=-1), 1, dim=-1)
    raise ValueError(router)


class TokenChoiceMoE(nn.Module):
    """A SwiGLU MoE layer whose experts run as ``layout`` says: ``grouped`` (``torch._grouped_mm``
    on tokens sorted by expert), ``bmm`` (each token-expert pair's weights gathered, ``bmm``) or
    ``loop`` (one Linear pair per expert, in a Python loop, gated densely); optionally with a
    sigmoid-gated shared expert (Qwen2-MoE)."""

    def __init__(self, layout: str, router: str, shared: bool = False) -> None:
        super().__init__()
        self.layout, self.router, self.k = layout, router, 1 if router == "switch" else 2
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        if layout == "loop":
            self.up = nn.ModuleList(nn.Linear(HIDDEN, 2 * FFN, bias=False) for _ in range(EXPERTS))
            self.down = nn.ModuleList(nn.Linear(FFN, HIDDEN, bias=False) for _ in range(EXPERTS))
        else:
            self.w_up = nn.Parameter(torch.randn(EXPERTS, HIDDEN, 2 * FFN) / HIDDEN**0.5)
            self.w_down = nn.Parameter(torch.randn(EXPERTS, FFN, HIDDEN) / FFN**0.5)
        self.shared = (
            nn.Sequential(nn.Linear(HIDDEN, FFN), nn.SiLU(), nn.Linear(FFN, HIDDEN)) if shared else None
        )
        self.shared_gate = nn.Linear(HIDDEN, 1, bias=False) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.router, self.k)
        if self.layout == "loop":
            out = torch.zeros_like(x)
            for e in range(EXPERTS):
                gate = (weights * (ids == e)).sum(-1, keepdim=True)
                g, u = self.up[e](x).chunk(2, dim=-1)
                out = out + self.down[e](F.silu(g) * u) * gate
        else:
            flat = ids.reshape(-1)
            order = torch.argsort(flat, stable=True)
            tokens = order // self.k
            xs = x[tokens]
            if self.layout == "grouped":
                offs = F.one_hot(flat, EXPERTS).sum(0).cumsum(0).to(torch.int32)
                # _grouped_mm is on no autocast list: its inputs are cast to the weights' dtype, as
                # transformers casts them
                g, u = torch._grouped_mm(xs.to(self.w_up.dtype), self.w_up, offs=offs).chunk(2, dim=-1)
                ys = torch._grouped_mm((F.silu(g) * u).to(self.w_down.dtype), self.w_down, offs=offs)
            else:
                experts = flat[order]
                g, u = torch.bmm(xs.unsqueeze(1), self.w_up[experts]).squeeze(1).chunk(2, dim=-1)
                ys = torch.bmm((F.silu(g) * u).unsqueeze(1), self.w_down[experts]).squeeze(1)
            ys = ys * weights.reshape(-1)[order].unsqueeze(-1)
            out = ys.new_zeros(x.shape).index_add(0, tokens, ys)
        if self.shared is not None:
            out = out + torch.sigmoid(self.shared_gate(x)) * self.shared(x)
        return out


class ExpertChoiceMoE(nn.Module):
    """Expert-choice routing (Zhou et al. 2022): each expert takes its top-``capacity`` tokens by
    softmax score; the experts run as one ``bmm`` over the expert dimension."""

    def __init__(self, capacity: int = 8) -> None:
        super().__init__()
        self.capacity = capacity
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.w_up = nn.Parameter(torch.randn(EXPERTS, HIDDEN, FFN) / HIDDEN**0.5)
        self.w_down = nn.Parameter(torch.randn(EXPERTS, FFN, HIDDEN) / FFN**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.softmax(self.gate(x).float(), dim=-1)  # (T, E)
        weights, tokens = torch.topk(scores.t(), self.capacity, dim=-1)  # (E, C): tokens per expert
        h = F.gelu(torch.bmm(x[tokens], self.w_up))  # (E, C, FFN)
        ys = torch.bmm(h, self.w_down) * weights.unsqueeze(-1)
        return ys.new_zeros(x.shape).index_add(0, tokens.reshape(-1), ys.reshape(-1, HIDDEN))


class Block(nn.Module):
    """Embedding-free pre-norm residual block around a MoE layer, with a head: the MoE layer sits
    in a network as in a transformer (FP32 residual stream at O2, a norm before it)."""

    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        self.proj, self.norm, self.moe = nn.Linear(8, HIDDEN), nn.LayerNorm(HIDDEN), moe
        self.head = nn.Linear(HIDDEN, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        h = h + self.moe(self.norm(h))
        return self.head(h)


PLAIN = {
    "grouped_softmax": lambda: TokenChoiceMoE("grouped", "softmax_topk"),
    "grouped_sigmoid_shared": lambda: TokenChoiceMoE("grouped", "sigmoid_topk", shared=True),
    "grouped_switch": lambda: TokenChoiceMoE("grouped", "switch"),
    "bmm_sigmoid": lambda: TokenChoiceMoE("bmm", "sigmoid_topk"),
    "bmm_switch_shared": lambda: TokenChoiceMoE("bmm", "switch", shared=True),
    "loop_softmax_shared": lambda: TokenChoiceMoE("loop", "softmax_topk", shared=True),
    "loop_switch": lambda: TokenChoiceMoE("loop", "switch"),
    "expert_choice": ExpertChoiceMoE,
}


def _plain(name: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Block(PLAIN[name]()).eval(), torch.randn(TOKENS, 8)


def _trains_every_parameter(converted: nn.Module, *args: Any, loss: Any, **kwargs: Any) -> None:
    """One FusedAdam step on ``converted`` moves every parameter (experts and router included)."""
    converted.train()
    before = {name: p.detach().clone() for name, p in converted.named_parameters()}
    optimizer = FusedAdam(converted.parameters(), lr=1e-2)
    loss(converted(*args, **kwargs)).backward()
    optimizer.step()
    unmoved = [name for name, p in converted.named_parameters() if torch.equal(p, before[name])]
    assert not unmoved, f"one step left these unchanged: {unmoved}"


@pytest.mark.parametrize(("name", "front_end"), [(n, f) for n in PLAIN for f in ("fx", "export")])
def test_plain_moe_experts_run_low_at_o2(name: str, front_end: str) -> None:
    model, x = _plain(name)
    o2 = amp_fx.convert(model, "O2", dtype=BF16, device_type="cpu", front_end=front_end)
    o2(x)  # the export front end captures at its first call
    counted = op_dtypes(o2, x)
    # Every matrix product (experts, shared expert, projections) computes in bf16 but the router's
    # logits: FP32, TOKENS x EXPERTS of them.
    assert counted.fp32_elements() == TOKENS * EXPERTS, counted.matmul_elements
    assert counted.matmul_elements and counted.low_share() == 1 - TOKENS * EXPERTS / sum(
        counted.matmul_elements.values()
    ), counted.matmul_elements
    assert o2.get_submodule("moe.gate").weight.dtype == FP32  # export: stored so at its first graph
    # The router's softmax/sigmoid and top-k read FP32.
    topk = {dtype for (op, dtype) in counted.router_calls if op == "topk"}
    assert topk == {FP32}, counted.router_calls
    assert all(dtype == FP32 for (op, dtype) in counted.router_calls if op != "sigmoid"), counted.router_calls
    # Within the oracle's bound of autocast with the experts run low the same way.
    measured = error_ratio(model, o2, (x,))
    assert "_grouped_mm in torch.bfloat16" in measured.reference
    assert not measured.failures(RELATIVE_BOUND), measured.failures(RELATIVE_BOUND)
    _trains_every_parameter(o2, x, loss=lambda out: out.float().square().mean())


def _router_choices(policy_or_level: Any, moe: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The experts (sorted, per token) a converted ``moe`` layer's top-k picks on ``x``."""
    if policy_or_level == "autocast":
        converted = with_autocast(moe, "cpu", BF16)
    elif isinstance(policy_or_level, str):
        converted = amp_fx.convert(moe, policy_or_level, dtype=BF16, device_type="cpu")
    else:
        converted = amp_fx.convert(moe, policy=policy_or_level)
    (chosen,) = op_dtypes(converted, x).chosen
    return chosen.sort(-1).values


@pytest.mark.parametrize("router", ["softmax_topk", "sigmoid_topk", "switch"])
def test_o2_router_picks_the_experts_of_a_float64_router(router: str) -> None:
    # Many tokens, inputs that bf16 holds exactly (O2 casts its inputs low): the router's logits
    # alone decide whether O2 picks the float64 router's experts (softmax and sigmoid are monotone).
    torch.manual_seed(0)
    moe = TokenChoiceMoE("bmm", router).eval()
    x = torch.randn(4096, HIDDEN).to(BF16).float()
    reference = F.linear(x.double(), moe.gate.weight.double()).topk(moe.k, dim=-1).indices.sort(-1).values
    assert torch.equal(_router_choices("O2", moe, x), reference)
    # autocast's bf16 router picks other experts for some tokens (ties and near-ties), as does O2
    # with the rule set back to autocast's.
    assert not torch.equal(_router_choices("autocast", moe, x), reference)
    lowered = preset("O2", BF16, "cpu").set_op("moe_router", "lower")
    assert lowered.decide("moe_router").rule is Rule.LOWER
    assert not torch.equal(_router_choices(lowered, moe, x), reference)


def test_o2_reports_why_the_router_is_fp32() -> None:
    model, _ = _plain("loop_softmax_shared")
    o2 = amp_fx.convert(model, "O2", dtype=BF16, device_type="cpu")
    reasons = {
        n.target: amp_fx.core.node_info.node_info(n).reason for n in o2.graph.nodes if n.op == "call_module"
    }
    assert "MoE router logits" in reasons["moe.gate"] and "top-k" in reasons["moe.gate"]
    # Products that feed no top-k (the shared expert's gate feeds a sigmoid only) stay low.
    assert "lower_precision_fp" in reasons["moe.shared_gate"] and "lower_precision_fp" in reasons["head"]
    # O3 has no FP32 islands: its router is lowered like every product.
    assert "moe_router" not in preset("O3", BF16, "cpu").op_rules


@pytest.mark.parametrize("name", ["grouped_sigmoid_shared", "bmm_switch_shared", "loop_softmax_shared"])
def test_o1_stays_autocast_bit_for_bit_on_moe(name: str) -> None:
    model, x = _plain(name)
    o1 = amp_fx.convert(model, "O1", dtype=BF16, device_type="cpu")
    assert_equivalent(with_autocast(model, "cpu", BF16), o1, (x,), exact=True)
    assert lowered_unlisted_ops(amp_fx.testing.references.conversion_policy(o1)) == ()
    if "grouped" in name:  # autocast lists no _grouped_mm: O1 keeps the experts FP32
        assert op_dtypes(o1, x).low_share({"_grouped_mm"}) == 0.0


def test_a_policy_rule_keeps_the_experts_fp32() -> None:
    model, x = _plain("grouped_sigmoid_shared")
    policy = preset("O2", BF16, "cpu").set_op("_grouped_mm", "fp32")
    assert policy.decide("_grouped_mm").rule is Rule.FP32
    o2 = amp_fx.convert(model, policy=policy)
    counted = op_dtypes(o2, x)
    assert counted.low_share({"_grouped_mm"}) == 0.0 and counted.low_share({"addmm"}) == 1.0
    assert counted.matmul_elements[("mm", FP32)] == TOKENS * EXPERTS  # only the router's logits
    # Its reference is then plain autocast: the oracle holds it to autocast's FP32 experts.
    measured = error_ratio(model, o2, (x,))
    assert measured.reference == "torch.autocast(cpu, torch.bfloat16)"
    assert not measured.failures(), measured.failures()
    # The low experts of the default are measured against the low-expert reference, not plain autocast.
    assert error_ratio(model, amp_fx.convert(model, "O2", dtype=BF16), (x,), lowered_ops=()).reference == (
        "torch.autocast(cpu, torch.bfloat16)"
    )


def test_running_low_lowers_only_inside_and_autograd_sees_the_casts() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, HIDDEN, requires_grad=True)
    w = torch.randn(2, HIDDEN, FFN, requires_grad=True)
    offs = torch.tensor([3, 8], dtype=torch.int32)
    with running_low(("_grouped_mm",), "cpu"), torch.autocast("cpu", dtype=BF16):
        y = torch._grouped_mm(x, w, offs=offs)
    assert y.dtype == BF16 and torch.equal(y, torch._grouped_mm(x.to(BF16), w.to(BF16), offs=offs))
    y.float().sum().backward()
    assert x.grad.dtype == FP32 and w.grad.dtype == FP32  # the casts are on the tape
    with torch.autocast("cpu", dtype=BF16):
        assert torch._grouped_mm(x, w, offs=offs).dtype == FP32  # removed again: autocast's own rule
    with pytest.raises(ValueError, match="on no autocast cpu list.*got 'linear'"):
        with running_low(("linear",), "cpu"):
            pass
    with pytest.raises(ValueError, match="got 'grouped_matmul'"):
        with_autocast(nn.Linear(2, 2), "cpu", BF16, lowered_ops=("grouped_matmul",))
    with pytest.raises(ValueError, match="leave lowered_ops out"):
        error_ratio(
            nn.Linear(2, 2), nn.Linear(2, 2), (torch.randn(1, 2),), reference=nn.Linear(2, 2), lowered_ops=()
        )


# ---- transformers' MoE families, each experts_implementation ---------------------------------------
def _hf_moe(family: str, implementation: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    transformers = pytest.importorskip("transformers")
    common = dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, experts_implementation=implementation,
    )  # fmt: skip
    configs = {
        "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
            moe_intermediate_size=32, shared_expert_intermediate_size=64, intermediate_size=64, num_experts=4,
            num_experts_per_tok=2)),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
            moe_intermediate_size=32, intermediate_size=64, num_experts=4, num_experts_per_tok=2,
            head_dim=8)),
        "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(
            intermediate_size=32, num_experts=4, num_experts_per_tok=2)),
    }  # fmt: skip
    config_name, model_name, extra = configs[family]
    if not hasattr(transformers, config_name):
        pytest.skip(f"transformers {transformers.__version__} has no {config_name}")
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**common, **extra)).eval()
    if model.config._experts_implementation != implementation:
        pytest.skip(f"{family} does not offer experts_implementation={implementation!r}")
    ids = torch.randint(0, 64, (2, 12))
    return model, {"input_ids": ids, "labels": ids}


_FAMILIES = ["qwen2_moe", "qwen3_moe", "olmoe"]
_IMPLEMENTATIONS = ["grouped_mm", "batched_mm", "eager"]


def _hf_case(family: str, implementation: str) -> Any:
    fast = implementation == "grouped_mm" and family in ("qwen2_moe", "olmoe")
    return pytest.param(family, implementation, marks=[] if fast else [pytest.mark.slow])


@pytest.mark.parametrize(
    ("family", "implementation"), [_hf_case(f, i) for f in _FAMILIES for i in _IMPLEMENTATIONS]
)
def test_hf_moe_experts_run_low_at_o2(family: str, implementation: str) -> None:
    model, batch = _hf_moe(family, implementation)
    o2 = amp_fx.convert(model, "O2", dtype=BF16)
    counted = op_dtypes(o2, **batch)
    expert_ops = {"grouped_mm": {"_grouped_mm"}, "batched_mm": {"bmm"}, "eager": {"mm", "addmm"}}[
        implementation
    ]
    # The routers' logits (width: the experts) are the only FP32 products.
    assert counted.fp32_widths == {4} and counted.fp32_elements() % (batch["input_ids"].numel() * 4) == 0
    assert counted.fp32_elements() == counted.matmul_elements[("mm", FP32)], counted.matmul_elements
    experts: Counter[torch.dtype] = Counter()
    for (op, dtype), n in counted.matmul_elements.items():
        experts[dtype] += n if op in expert_ops else 0
    assert experts[BF16] > 0 and experts[FP32] == (counted.fp32_elements() if "mm" in expert_ops else 0)
    assert counted.low_share() >= 0.99, counted.matmul_elements  # experts are most of the products
    topk = {dtype for (op, dtype) in counted.router_calls if op == "topk"}
    assert topk == {FP32}, counted.router_calls
    routers = _gate_weights(o2)  # stored FP32 at the first graph (the export front end)
    assert len(routers) == 2 and all(p.dtype == FP32 for p in routers.values()), routers.keys()
    measured = error_ratio(model, o2, (), keyword_inputs=batch)
    assert not measured.failures(RELATIVE_BOUND), measured.failures(RELATIVE_BOUND)
    _trains_every_parameter(o2, loss=lambda out: out.loss, **batch)


@pytest.mark.parametrize(
    ("a_shape", "b_shape", "offs"),
    [((12, 16), (3, 16, 8), [4, 8, 12]), ((3, 4, 16), (3, 16, 8), None), ((8, 24), (24, 16), [8, 16, 24])],
)
def test_capture_kernel_gives_fp32_grouped_mm_the_real_kernels_shape(
    a_shape: tuple[int, ...], b_shape: tuple[int, ...], offs: list[int] | None
) -> None:
    from torch._dispatch.python import enable_python_dispatcher

    from amp_fx.capture.export_meta_kernels import fp32_grouped_mm

    torch.manual_seed(0)
    a, b = torch.randn(a_shape), torch.randn(b_shape)
    offsets = None if offs is None else torch.tensor(offs, dtype=torch.int32)
    real = torch._grouped_mm(a, b, offs=offsets)  # the CPU kernel runs FP32
    mode = torch._subclasses.FakeTensorMode()
    fakes = [None if t is None else mode.from_tensor(t) for t in (a, b, offsets)]
    with enable_python_dispatcher(), fp32_grouped_mm(), mode:  # torch.export's dispatch
        fake = torch._grouped_mm(*fakes[:2], offs=fakes[2])
        low = torch._grouped_mm(fakes[0].to(BF16), fakes[1].to(BF16), offs=fakes[2])
    assert (fake.shape, fake.dtype) == (real.shape, FP32) and low.dtype == BF16  # bf16 as torch gives it
    with pytest.raises(RuntimeError, match="Expected mat_a to be BFloat16"), enable_python_dispatcher(), mode:
        torch._grouped_mm(*fakes[:2], offs=fakes[2])  # torch's own kernel again after the block


# ---- the router's weight is stored FP32 on the export front end too -----------------------------
def _gate_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if n.endswith("gate.weight") and "shared" not in n}


@pytest.mark.parametrize(
    "name", ["grouped_sigmoid_shared", "bmm_switch_shared", "loop_switch", "expert_choice"]
)
def test_export_stores_the_router_weight_fp32_at_its_first_graph(name: str) -> None:
    model, x = _plain(name)
    o2 = amp_fx.convert(model, "O2", dtype=BF16, device_type="cpu", front_end="export")
    gate = o2.get_submodule("moe.gate").weight
    assert gate.dtype == BF16  # stored at convert by its module, before any graph shows the router
    o2(x)
    assert o2.get_submodule("moe.gate").weight is gate and gate.dtype == FP32
    # Only the router's: the other Linears' weights stay low.
    linears = {n: m for n, m in o2.named_modules() if isinstance(m, nn.Linear)}
    assert {n for n, m in linears.items() if m.weight.dtype == FP32} == {"moe.gate"}


def _train(
    converted: nn.Module, x: torch.Tensor, make_optimizer: Any, steps: int = 3
) -> tuple[list[float], Any]:
    converted.train()
    optimizer = make_optimizer(converted.parameters())
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = converted(x).float().square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, optimizer


@pytest.mark.filterwarnings("ignore:AdamW steps")  # bf16 weights in a torch optimizer, as meant here
@pytest.mark.parametrize("optimizer", ["FusedAdam", "AdamW"])
def test_export_router_trains_fp32_with_an_optimizer_built_at_convert(optimizer: str) -> None:
    make = {
        "FusedAdam": lambda params: FusedAdam(params, lr=1e-2),
        "AdamW": lambda params: torch.optim.AdamW(params, lr=1e-2),
    }[optimizer]
    model, x = _plain("grouped_softmax")
    runs = {}
    for front_end in ("fx", "export"):
        o2 = amp_fx.convert(model, "O2", dtype=BF16, device_type="cpu", front_end=front_end)
        gate = o2.get_submodule("moe.gate").weight
        start = gate.detach().float().clone()
        runs[front_end] = (*_train(o2, x, make), gate, start)
    (fx_losses, _, fx_gate, _), (losses, trained_by, gate, start) = runs["fx"], runs["export"]
    assert gate.dtype == FP32 and not torch.equal(gate, start)  # the router moved, in FP32
    assert "master_param" not in trained_by.state[gate]  # its own master (FusedAdam; AdamW keeps none)
    # The same training as the fx front end, whose router weight was FP32 from convert on (the
    # export one's was rounded once at convert: no master held its exact value).
    assert losses == pytest.approx(fx_losses, rel=2e-2)
    assert torch.allclose(gate, fx_gate, atol=2e-2)


def test_export_router_takes_its_exact_value_from_a_master() -> None:
    # A checkpoint loaded before the first call: the FusedAdam master holds the saved FP32 value,
    # so the router weight stored FP32 at the first call is that value, not its rounding.
    model, x = _plain("bmm_sigmoid")
    trained = amp_fx.convert(model, "O2", dtype=BF16, device_type="cpu", front_end="export")
    _train(trained, x, lambda params: FusedAdam(params, lr=1e-2))
    saved = {k: v.clone() for k, v in trained.state_dict().items()}
    assert saved["moe.gate.weight"].dtype == FP32
    fresh = amp_fx.convert(model, "O2", dtype=BF16, device_type="cpu", front_end="export")
    optimizer = FusedAdam(fresh.parameters(), lr=1e-2)
    fresh.load_state_dict(saved)
    gate = fresh.get_submodule("moe.gate").weight
    assert gate.dtype == BF16 and not torch.equal(gate.float(), saved["moe.gate.weight"])  # rounded
    fresh.eval()(x)
    assert gate.dtype == FP32 and torch.equal(gate, saved["moe.gate.weight"])
    assert "master_param" not in optimizer.state[gate]  # its own master from now on
    assert {k: v.dtype for k, v in fresh.state_dict().items()} == {k: v.dtype for k, v in saved.items()}
    trained.eval()
    torch.testing.assert_close(fresh(x), trained(x), rtol=0, atol=0)


@pytest.mark.slow  # a Hugging Face capture: amp's front end is torch.fx for plain-torch models
def test_amp_initialize_router_takes_back_its_exact_fp32_value() -> None:
    # amp's torch.optim optimizer at O2 keeps FP32 masters from the model's own weights: the router
    # weight, stored low at conversion, is stored FP32 at the first call with its original value.
    from amp_fx import amp

    model, batch = _hf_moe("qwen2_moe", "grouped_mm")
    originals = {n: p.detach().clone() for n, p in _gate_weights(model).items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    o2, optimizer = amp.initialize(model, optimizer, opt_level="O2", dtype=BF16, verbosity=0)
    o2.train()
    loss = o2(**batch).loss
    routers = _gate_weights(o2)
    assert all(torch.equal(routers[n], originals[n]) for n in originals)  # exact, FP32
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    assert all(p.dtype == FP32 and not torch.equal(p, originals[n]) for n, p in routers.items())
    masters = {id(m) for m in amp.master_params(optimizer)}
    assert all(id(p) in masters for p in routers.values())  # their own masters now
