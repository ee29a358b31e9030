"""A small GPT trained character by character on the Python standard library's own source.

Every machine that runs Python has the corpus: the ``.py`` files of the standard library
(found with ``sysconfig``). The model is converted with `amp_fx.convert` at any opt level and
trained with amp_fx's native API, shaped like ``torch.amp``::

    gm = amp_fx.convert(model, "O2", dtype=torch.float16)
    opt = amp_fx.optim.FusedAdam(gm.parameters(), lr=3e-3)      # FP32 master weights
    scaler = amp_fx.LossScaler()
    scaler.scale(loss).backward(); amp_fx.clip_grad_norm_(opt, 1.0)
    scaler.step(opt); scaler.update()

It prints the loss and the loss-scale history; ``--plot out.png`` draws both against the step
(needs matplotlib). Runs in seconds on a CPU with the defaults:

    python examples/gpt.py --opt-level O2 --steps 60
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_fx

VOCAB_SIZE = 256  # bytes


# --------------------------------------------------------------------------------------------
# Data: the standard library's source, as bytes
# --------------------------------------------------------------------------------------------
def stdlib_corpus(max_bytes: int) -> bytes:
    """Concatenate the standard library's top-level .py files (sorted by name) up to max_bytes."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for name in sorted(os.listdir(root)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(root, name), "rb") as handle:
            data = handle.read()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise SystemExit(f"no .py files found in the standard library directory {root}")
    return b"".join(chunks)[:max_bytes]


class Batches:
    """Random windows of the corpus: (inputs, targets shifted by one), train or validation split."""

    def __init__(self, corpus: bytes, block_size: int, batch_size: int, device: torch.device, seed: int):
        data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()
        split = int(0.9 * len(data))
        self.splits = {"train": data[:split], "val": data[split:]}
        self.block_size, self.batch_size, self.device = block_size, batch_size, device
        self.generator = torch.Generator().manual_seed(seed)

    def get(self, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        data = self.splits[split]
        starts = torch.randint(len(data) - self.block_size - 1, (self.batch_size,), generator=self.generator)
        x = torch.stack([data[s : s + self.block_size] for s in starts.tolist()])
        y = torch.stack([data[s + 1 : s + 1 + self.block_size] for s in starts.tolist()])
        return x.to(self.device), y.to(self.device)


# --------------------------------------------------------------------------------------------
# Model: nanoGPT's, small; attention written out so the report shows softmax as an FP32 island
# --------------------------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_embd, self.n_head, self.head_dim = n_embd, n_head, n_embd // n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.scale = self.head_dim**-0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time_steps = x.size(0), x.size(1)
        q, k, v = self.qkv(x).split(self.n_embd, dim=2)
        q = q.view(batch, time_steps, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(batch, time_steps, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(batch, time_steps, self.n_head, self.head_dim).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * self.scale
        # True above the diagonal: the future positions a token may not attend to. Built here from
        # the input's length (a buffer sliced by it would stop torch.fx, which traces with proxies).
        future = x.new_ones(time_steps, time_steps, dtype=torch.bool).triu(1)
        att = att.masked_fill(future, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(batch, time_steps, self.n_embd)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln2 = nn.LayerNorm(n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.fc_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc_proj(self.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, n_layer: int = 2, n_head: int = 4, n_embd: int = 64, block_size: int = 64):
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB_SIZE, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, VOCAB_SIZE, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.size(1), device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@torch.no_grad()
def sample(
    model: nn.Module, prompt: bytes, length: int, block_size: int, device: torch.device, seed: int = 0
) -> str:
    """A sampled continuation of `prompt` (temperature 0.8), decoded as UTF-8 (invalid bytes replaced).

    Sampled, not greedy: after a short run the likeliest next byte is nearly always a space, so a
    greedy continuation was 60 blanks.
    """
    generator = torch.Generator(device=device).manual_seed(seed)
    idx = torch.tensor(list(prompt), dtype=torch.long, device=device)[None]
    for _ in range(length):
        logits = model(idx[:, -block_size:])
        probs = torch.softmax(logits[:, -1].float() / 0.8, dim=-1)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
    return bytes(idx[0].tolist()).decode("utf-8", errors="replace")


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O2", choices=["O0", "O1", "O2", "O3"])
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "fp16", "bf16"],
        help="low-precision dtype (auto: fp16 on CUDA, bf16 on CPU)",
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--corpus-bytes", type=int, default=1_000_000)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--sample", type=int, default=60, help="characters to generate at the end (0: none)")
    parser.add_argument("--plot", metavar="PNG", default=None, help="plot loss and loss scale against step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    return parser.parse_args(argv)


def choose_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.float16 if device.type == "cuda" else torch.bfloat16
    return {"fp16": torch.float16, "bf16": torch.bfloat16}[name]


def require_matplotlib() -> None:
    """Refuse --plot before training, not after it, when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib (or run without --plot)") from None


def plot_history(path: str, losses: list[float], scales: list[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, loss_axis = plt.subplots(figsize=(7, 4))
    loss_axis.plot(losses, color="tab:blue", label="loss")
    loss_axis.set_xlabel("step")
    loss_axis.set_ylabel("loss", color="tab:blue")
    scale_axis = loss_axis.twinx()
    scale_axis.plot(scales, color="tab:red", label="loss scale")
    scale_axis.set_yscale("log", base=2)
    scale_axis.set_ylabel("loss scale", color="tab:red")
    figure.tight_layout()
    figure.savefig(path)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    args = parse_args(argv)
    if args.plot:
        require_matplotlib()
    torch.manual_seed(args.seed)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = choose_dtype(args.dtype, device)

    corpus = stdlib_corpus(args.corpus_bytes)
    batches = Batches(corpus, args.block_size, args.batch_size, device, args.seed)
    print(f"corpus: {len(corpus):,} bytes of the standard library in {sysconfig.get_paths()['stdlib']}")

    model = GPT(args.n_layer, args.n_head, args.n_embd, args.block_size).to(device)
    gm = amp_fx.convert(model, args.opt_level, dtype=dtype)
    n_params = sum(p.numel() for p in gm.parameters())
    print(f"model: {n_params:,} parameters, {args.opt_level} {dtype}, device {device}")

    optimizer = amp_fx.optim.FusedAdam(gm.parameters(), lr=args.lr, weight_decay=0.01, adam_w_mode=True)
    # Loss scaling guards fp16 gradients against underflow; O0/O3 use a scale of 1 (Apex's table)
    # and bf16 has fp32's range, so the scaler is a pass-through there.
    scaling = dtype == torch.float16 and args.opt_level in ("O1", "O2")
    scaler = amp_fx.LossScaler(enabled=scaling)

    losses: list[torch.Tensor] = []
    scales: list[torch.Tensor] = []
    start = time.perf_counter()
    gm.train()
    for step in range(args.steps):
        x, y = batches.get("train")
        logits = gm(x)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE).float(), y.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        amp_fx.clip_grad_norm_(optimizer, 1.0)
        scaler.step(optimizer)
        scaler.update()
        # Kept as device tensors: reading them every step would sync with the GPU.
        losses.append(loss.detach())
        current_scale = scaler.scale_tensor() if scaling else None
        scales.append(current_scale.clone() if current_scale is not None else torch.ones((), device=device))
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  scale {scales[-1].item():g}")
    elapsed = time.perf_counter() - start

    gm.eval()
    with torch.no_grad():
        x, y = batches.get("val")
        val_loss = F.cross_entropy(gm(x).reshape(-1, VOCAB_SIZE).float(), y.reshape(-1)).item()
    loss_history = [float(v) for v in torch.stack(losses).float().cpu()]
    scale_history = [float(v) for v in torch.stack(scales).float().cpu()]
    changes = [(0, scale_history[0])] + [
        (i, s) for i, s in enumerate(scale_history) if i and s != scale_history[i - 1]
    ]
    print(f"trained {args.steps} steps in {elapsed:.1f}s; val loss {val_loss:.4f}")
    print("loss-scale history (step: scale): " + ", ".join(f"{i}: {s:g}" for i, s in changes))
    if args.sample:
        text = sample(gm, b"def ", args.sample, args.block_size, device, args.seed)
        print("sample:", repr(text))
    if args.plot:
        plot_history(args.plot, loss_history, scale_history)
    return {"loss": loss_history, "scale": scale_history, "val_loss": [val_loss]}


if __name__ == "__main__":
    main(sys.argv[1:])
