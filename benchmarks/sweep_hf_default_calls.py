"""The default-call check over every causal-LM and seq2seq class of the installed transformers
(issue 22): does the class convert at O1, which autocast islands remain and why, and is O1 bit for
bit equal to ``torch.autocast`` on CPU (bf16)?

Each class registered in transformers' auto mappings (``causal``: MODEL_FOR_CAUSAL_LM_MAPPING_NAMES;
``seq2seq``: MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES; ``vlm``:
MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES) is built offline from a tiny config (the CLI's
`amp_fx.inspect.cli._small_config`, plus smaller expert counts, with the config's own ``use_cache``),
seeded, put in eval mode and called with its default inputs: ``input_ids``, ``attention_mask`` and
``labels``, and whatever else its forward needs (images, audio features;
`amp_fx.inspect.cli.transformers_inputs`).
``use_cache`` is never passed: the call is the one people write.

Per class it records: whether it builds (and runs under autocast), whether it converts and runs
(the first line of the error if not), the graphs captured, the islands left and their reasons, the
share of parameters only islands read (``1 - parameter_coverage`` of `amp_fx.capture_summary`),
the shares of ATen ops and matrix-product FLOPs that ran in rewritten graphs, whether O1's logits
and loss equal autocast's bit for bit, and the seconds the check took. A class that takes longer
than ``--timeout`` seconds is stopped; every exception is caught per class.

    python benchmarks/sweep_hf_default_calls.py --group causal --limit 10
    python benchmarks/sweep_hf_default_calls.py --only OPTForCausalLM,PegasusForConditionalGeneration
    python benchmarks/sweep_hf_default_calls.py --group all --markdown /tmp/sweep.md
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

BF16 = torch.bfloat16
GROUPS = ("causal", "seq2seq", "vlm")
_MAPPINGS = {
    "causal": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "vlm": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
}
# Sizes the CLI's small config leaves at their defaults, which make mixture-of-experts models large
# (DeepSeek-V3's 256 experts); each is given only to a config that already has the attribute.
_SMALLER = {
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "n_shared_experts": 1, "num_shared_experts": 1,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "expert_intermediate_size": 32,
    "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "moe_k": 2, "moe_num_shared_experts": 1,
    "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
}  # fmt: skip
_DECODER_LENGTH = 4


@dataclasses.dataclass
class Row:
    """One class's result (see the module docstring)."""

    name: str
    group: str
    builds: bool = False
    build_error: str = ""
    converts: bool = False
    error: str = ""
    where: str = ""  # the innermost frame of the error (file:line) or, for a timeout, the line it was in
    inputs: list[str] = dataclasses.field(default_factory=list)
    text_only: bool = False  # its forward takes images or audio, but the call was text only
    media_error: str = ""  # why the call with images or audio failed, for a text-only row
    graphs: int = 0
    islands: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    island_parameters: float | None = None
    op_share: float | None = None
    flop_share: float | None = None
    parameters: int = 0
    bit_equal: bool | None = None
    unequal: list[str] = dataclasses.field(default_factory=list)
    # For a row not bit-equal: whether O1 equals autocast running the code path torch.export takes
    # (`_export_code_path`), i.e. the model's own code computes differently when exported.
    export_path_equal: bool | None = None
    seconds: float = 0.0

    @property
    def whole(self) -> bool:
        """Converted and captured with no island."""
        return self.converts and not self.islands


class _Timeout(Exception):
    pass


@contextmanager
def _time_limit(seconds: float | None) -> Iterator[None]:
    """Raise `_Timeout` in the main thread after ``seconds`` (None or 0: no limit)."""
    if not seconds:
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise _Timeout(f"timed out after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def class_names(group: str) -> list[str]:
    """The model classes transformers registers for ``group`` (one of GROUPS), sorted, no repeats."""
    from transformers.models.auto import modeling_auto

    mapping = getattr(modeling_auto, _MAPPINGS[group])
    names: set[str] = set()
    for value in mapping.values():
        names.update([value] if isinstance(value, str) else value)
    return sorted(names)


def _restore_use_cache(values: dict[str, Any], config_class: type) -> None:
    """Give ``use_cache`` (which the CLI's small config turns off) its default, here and in sub-configs."""
    if "use_cache" in values:
        try:
            default = getattr(config_class(), "use_cache", True)
        except Exception:
            default = True
        values["use_cache"] = default
    for name, sub_class in getattr(config_class, "sub_configs", {}).items():
        if isinstance(values.get(name), dict) and isinstance(sub_class, type):
            _restore_use_cache(values[name], sub_class)


def _smaller(values: dict[str, Any], config_class: type) -> None:
    for key, size in _SMALLER.items():
        if isinstance(values.get(key), int) and not isinstance(values[key], bool):
            values[key] = min(values[key], size) if values[key] > 0 else values[key]
    for name, sub_class in getattr(config_class, "sub_configs", {}).items():
        if isinstance(values.get(name), dict) and isinstance(sub_class, type):
            _smaller(values[name], sub_class)


def _small_values(config_class: type) -> dict[str, Any]:
    """As `amp_fx.inspect.cli._small_config`, for a config whose sub-configs are AutoConfig: each gets the
    small sizes of the class its default is (with its model_type, for AutoConfig to resolve)."""
    from transformers import PretrainedConfig

    from amp_fx.inspect.cli import _SMALL_TRANSFORMERS_SIZES

    default = config_class()
    values = default.to_dict()
    values.update({k: v for k, v in _SMALL_TRANSFORMERS_SIZES.items() if k in values})
    values.pop("layer_types", None)  # one per default layer: made again for the small count
    for name in getattr(config_class, "sub_configs", {}):
        sub = getattr(default, name, None)
        if isinstance(sub, PretrainedConfig):
            values[name] = {**_small_values(type(sub)), "model_type": sub.model_type}
    return values


def _layer_kinds(config_class: type) -> list[str]:
    """The distinct ``layer_types`` of the default config, in order (empty: none)."""
    try:
        kinds = getattr(config_class(), "layer_types", None)
    except Exception:
        return []
    if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
        return []
    distinct = list(dict.fromkeys(kinds))
    return distinct if len(distinct) > 1 else []


def tiny_config(config_class: type) -> Any:
    """The CLI's small config for ``config_class``, with fewer experts and the default ``use_cache``."""
    from amp_fx.inspect.cli import _small_config

    try:
        values = _small_config(config_class).to_dict()
    except Exception:  # an AutoConfig sub-config (Llava's text_config), which the CLI cannot build
        values = _small_values(config_class)
    _smaller(values, config_class)
    _restore_use_cache(values, config_class)
    for key in ("transformers_version", "model_type", "architectures"):
        values.pop(key, None)
    config = config_class(**values)
    kinds = _layer_kinds(config_class)
    if kinds and set(getattr(config, "layer_types", None) or kinds) != set(kinds):
        # A hybrid whose first two layers are all of one kind (linear attention): one of each.
        try:
            config = config_class(**{**values, "layer_types": kinds, "num_hidden_layers": len(kinds)})
        except Exception:
            pass  # layer_types is derived (Jamba's periods): the small config as it is
    if not hasattr(config, "decoder_start_token_id") and config.is_encoder_decoder:
        # T5's config no longer carries it; its checkpoints do (the pad token, 0).
        config.decoder_start_token_id = getattr(config, "pad_token_id", None) or 0
    # Special tokens past the text vocabulary (Llava's image token is 32000 of 32000): the tiny
    # model's embedding must hold them, as the released checkpoints' resized ones do.
    text = getattr(config, "text_config", None) or config
    special = [getattr(config, k, None) for k in ("image_token_id", "image_token_index", "video_token_id")]
    special = [t for t in special if isinstance(t, int)]
    if special and isinstance(getattr(text, "vocab_size", None), int) and max(special) >= text.vocab_size:
        text.vocab_size = max(special) + 1
    return config


def _vocab_size(config: Any) -> int:
    for candidate in (getattr(config, "text_config", None), getattr(config, "decoder", None), config):
        size = getattr(candidate, "vocab_size", None)
        if isinstance(size, int) and size > 0:
            return size
    return 100


def default_inputs(model: nn.Module, group: str, with_media: bool = True) -> dict[str, torch.Tensor]:
    """The default call's keyword arguments: token ids, their attention mask and labels (decoder
    labels for seq2seq, from which the model makes its decoder inputs), and the images or audio
    features `amp_fx.inspect.cli.transformers_inputs` makes for a forward that takes them (unless
    ``with_media`` is False: a text-only call). Never ``use_cache``."""
    from amp_fx.inspect.cli import transformers_inputs

    if not with_media:
        inputs = _text_inputs(model)
    else:
        try:
            inputs = transformers_inputs(model)
        except Exception:  # audio sizes under an audio_config (Voxtral): text only
            return default_inputs(model, group, with_media=False)
    accepted = inspect.signature(model.forward).parameters
    generator = torch.Generator().manual_seed(1)
    vocab = _vocab_size(model.config)
    if "pixel_values" in inputs and "input_ids" in inputs:
        inputs["input_ids"] = _with_image_tokens(model, inputs["input_ids"], inputs["pixel_values"])
    if "input_ids" in inputs and "attention_mask" in accepted:
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    if "labels" in accepted:
        if group != "seq2seq" and "input_ids" in inputs:
            inputs["labels"] = inputs["input_ids"].clone()
        else:
            inputs.pop("decoder_input_ids", None)
            length = inputs["input_ids"].shape[1] if "input_ids" in inputs else _DECODER_LENGTH
            inputs["labels"] = torch.randint(0, vocab, (1, length), generator=generator)
    return inputs


def _text_inputs(model: nn.Module) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, _vocab_size(model.config), (1, 8), generator=generator)
    accepted = inspect.signature(model.forward).parameters
    return {"input_ids": ids} if "input_ids" in accepted else {}


def _with_image_tokens(model: nn.Module, ids: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
    """``ids`` after as many image tokens as the model makes image features of ``pixels`` (the
    Llava way: ``get_image_features`` and ``config.image_token_id``); ``ids`` as they are for a model
    that does not work that way."""
    config = model.config
    token = getattr(config, "image_token_id", None)
    token = getattr(config, "image_token_index", None) if token is None else token
    if not isinstance(token, int) or not hasattr(model, "get_image_features"):
        return ids
    try:
        with torch.no_grad():
            features = model.get_image_features(pixel_values=pixels)
    except Exception:
        return ids
    if not isinstance(features, torch.Tensor):
        pooled = getattr(features, "pooler_output", None)
        features = pooled if pooled is not None else features[0]
    tensors = [features] if isinstance(features, torch.Tensor) else list(features)
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        return ids
    count = sum(t.reshape(-1, t.shape[-1]).shape[0] for t in tensors)
    text = torch.where(ids == token, torch.zeros_like(ids), ids)
    return torch.cat([torch.full((ids.shape[0], count), token, dtype=ids.dtype), text], dim=1)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def _where(error: BaseException) -> str:
    """The innermost frame of ``error``'s traceback, as path:line (site-packages paths shortened)."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return ""
    frame = frames[-1]
    path = frame.filename.split("site-packages/")[-1]
    return f"{path}:{frame.lineno}"


@contextmanager
def _export_code_path() -> Iterator[None]:
    """Eager code sees what it sees inside torch.export: ``torch.compiler.is_exporting()`` and
    ``is_compiling()`` are true. Some models take another algorithm there (Qwen3-Next's gated delta
    rule solves its triangular system by forward substitution; masks are built explicitly), which
    rounds differently from their eager path; O1 is then compared with autocast on that path."""
    from unittest import mock

    with (
        mock.patch("torch.compiler.is_exporting", lambda: True),
        mock.patch("torch.compiler.is_compiling", lambda: True),
    ):
        yield


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.detach().reshape(-1).contiguous().view(torch.uint8),
        b.detach().reshape(-1).contiguous().view(torch.uint8),
    )


def _outputs(output: Any) -> dict[str, torch.Tensor]:
    found = {}
    for key in ("loss", "logits"):
        value = getattr(output, key, None)
        if value is None and isinstance(output, dict):
            value = output.get(key)
        if isinstance(value, torch.Tensor):
            found[key] = value
    return found


def _build(name: str, group: str, row: Row) -> tuple[nn.Module, dict[str, torch.Tensor], Any]:
    """The model, its default inputs and autocast's output for them; raises if any of them fails."""
    import transformers

    from amp_fx.testing import with_autocast

    cls = getattr(transformers, name)
    config = tiny_config(cls.config_class)
    torch.manual_seed(0)
    model = cls(config).eval()
    inputs = default_inputs(model, group)
    try:
        reference = with_autocast(model, "cpu", BF16)(**inputs)
    except Exception as error:
        text_only = default_inputs(model, group, with_media=False)
        if text_only.keys() == inputs.keys():
            raise
        row.media_error = f"{_first_line(error)} ({_where(error)})"
        inputs = text_only  # a VLM whose random image does not fit its prompt: its text-only call
        reference = with_autocast(model, "cpu", BF16)(**inputs)
    media = {"pixel_values", "input_features", "input_values", "pixel_values_videos"}
    row.text_only = bool(media & set(inspect.signature(model.forward).parameters)) and not media & set(inputs)
    return model, inputs, reference


def check(name: str, group: str = "causal", timeout: float | None = 120.0) -> Row:
    """Run the default-call check on ``transformers.<name>`` (see the module docstring)."""
    import amp_fx
    from amp_fx.capture.captured_model import capture_states
    from amp_fx.testing import with_autocast

    row = Row(name, group)
    start = time.perf_counter()
    stage = "build"
    try:
        with _time_limit(timeout):
            model, inputs, reference = _build(name, group, row)
            row.builds, stage = True, "convert"
            row.inputs = sorted(inputs)
            row.parameters = sum(p.numel() for p in model.parameters())
            converted = amp_fx.convert(model, "O1", dtype=BF16)
            output = converted(**inputs)
            row.converts, stage = True, "summary"
            states = capture_states(converted)
            row.graphs = sum(len(state.graphs) for _, state in states)
            row.islands = {n or "<model>": list(s.islands.values()) for n, s in states if s.islands}
            mine, theirs = _outputs(output), _outputs(reference)
            row.unequal = [k for k in theirs if k not in mine or not _bits_equal(mine[k], theirs[k])]
            row.bit_equal = bool(theirs) and not row.unequal
            if theirs and row.unequal:
                with _export_code_path():
                    on_export_path = _outputs(with_autocast(model, "cpu", BF16)(**inputs))
                row.export_path_equal = all(_bits_equal(mine[k], on_export_path[k]) for k in row.unequal)
            summary = amp_fx.capture_summary(converted, **inputs)
            row.island_parameters = 1.0 - summary.parameter_coverage
            row.op_share, row.flop_share = summary.op_share, summary.flop_share
    except Exception as error:  # noqa: BLE001  (every failure is a row of the table)
        message = _first_line(error)
        if stage == "build":
            row.build_error = message
        elif stage == "convert":
            row.error = message
        else:
            row.error = f"(after the call) {message}"
        row.where = _where(error)
    row.seconds = time.perf_counter() - start
    return row


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _yes(value: bool | None) -> str:
    return "-" if value is None else ("y" if value else "n")


def table(rows: list[Row]) -> list[str]:
    """A markdown table: one line per class."""
    lines = [
        "| class | group | builds | converts | graphs | islands | island params | ops in graphs "
        "| O1 == autocast | s | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r.builds:
            note = r.build_error
        elif r.error:
            note = f"{r.error} ({r.where})"
        elif r.islands:
            note = "; ".join(f"`{n}`" for n in r.islands)
        else:
            note = ""
        if r.unequal:
            path = {True: "; equal on the export code path", False: "; unequal on the export code path"}
            note = f"unequal: {', '.join(r.unequal)}{path.get(r.export_path_equal, '')}. {note}"
        if r.builds and r.text_only:
            why = f" ({r.media_error})" if r.media_error else ""
            note = f"text only{why}. {note}"
        lines.append(
            f"| {r.name} | {r.group} | {_yes(r.builds)} | {_yes(r.converts if r.builds else None)} "
            f"| {r.graphs if r.converts else '-'} | {len(r.islands) if r.converts else '-'} "
            f"| {_share(r.island_parameters)} | {_share(r.op_share)} | {_yes(r.bit_equal)} "
            f"| {r.seconds:.1f} | {note.replace('|', '/')[:200]} |"
        )
    return lines


def summary_line(rows: list[Row]) -> str:
    built = [r for r in rows if r.builds]
    return (
        f"{len(rows)} classes: {len(built)} built, {sum(r.converts for r in built)} converted, "
        f"{sum(r.whole for r in built)} captured whole (0 islands), "
        f"{sum(bool(r.bit_equal) for r in built)} O1 bit-equal to autocast, "
        f"{sum(bool(r.export_path_equal) for r in built)} more equal to autocast on the code path "
        "torch.export takes"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", choices=[*GROUPS, "all"], default="all")
    parser.add_argument("--only", default="", help="comma-separated class names")
    parser.add_argument("--limit", type=int, default=0, help="at most this many classes per group")
    parser.add_argument("--skip", default="", help="comma-separated class names to leave out")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per class (0: none)")
    parser.add_argument("--markdown", help="write the table (markdown) to this path")
    parser.add_argument("--json", help="write the rows (JSON lines) to this path, one as each finishes")
    args = parser.parse_args(argv)

    groups = GROUPS if args.group == "all" else (args.group,)
    only = [n for n in args.only.split(",") if n]
    skip = {n for n in args.skip.split(",") if n}
    registered = {group: class_names(group) for group in groups}
    todo: list[tuple[str, str]] = []
    if only:  # each in the first group that registers it (else the first group asked for)
        todo = [(n, next((g for g in groups if n in registered[g]), groups[0])) for n in only]
    else:
        for group in groups:
            names = registered[group][: args.limit] if args.limit else registered[group]
            todo += [(n, group) for n in names if n not in skip and all(n != t for t, _ in todo)]

    rows: list[Row] = []
    sink = open(args.json, "a") if args.json else None  # noqa: SIM115
    for index, (name, group) in enumerate(todo, 1):
        row = check(name, group, args.timeout)
        rows.append(row)
        status = "ok" if row.whole and row.bit_equal else (row.build_error or row.error or "islands/unequal")
        print(f"[{index}/{len(todo)}] {group} {name}: {status[:120]} ({row.seconds:.1f} s)", flush=True)
        if sink:
            sink.write(json.dumps(dataclasses.asdict(row)) + "\n")
            sink.flush()
    if sink:
        sink.close()

    lines = table(rows)
    print("\n".join(lines))
    print(summary_line(rows))
    if args.markdown:
        with open(args.markdown, "w") as out:
            out.write("\n".join([summary_line(rows), "", *lines]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
