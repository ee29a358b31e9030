"""The ``amp-fx`` command line (also ``python -m amp_fx``).

``amp-fx inspect MODEL --opt-level O2 [--dtype bf16] [--input-shape 1,3,224,224] [--dot out.dot]``
converts MODEL and prints `amp_fx.capture_summary` (how much of a call on the example input ran in
rewritten graphs: its ATen ops and matrix-product FLOPs, and the islands) and `amp_fx.report` of
the rewritten graphs: each node's rule and dtypes, the casts inserted, what stayed FP32 and why.
MODEL is ``torchvision:NAME`` (built with weights=None, nothing is downloaded),
``transformers:ClassName`` (built from its config class with small sizes, random weights, nothing
downloaded), ``path/to/file.py:ClassName`` or ``package.module:ClassName`` (built with no
arguments). A model whose first layer is an ``nn.Embedding`` is given int64 token
ids (not a float input, which the report would show cast to fp16/bf16). A model that torch.fx
cannot trace (every transformers model) is converted by the torch.export front end, which
captures at the first call: it is called on the example input (a transformers model on inputs
made from its forward's parameters and config) and each captured graph is reported. Example::

    $ amp-fx inspect torchvision:resnet18 --opt-level O2 --dtype bf16 --dot resnet18.dot
    $ amp-fx inspect transformers:LlamaForCausalLM --opt-level O2

A model that cannot be found or built, or that convert refuses, ends the command with exit status
1 and one line on stderr that names the problem and the fix; bad arguments exit with status 2.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.util
import inspect as pyinspect
import os
import re
import sys
from collections.abc import Sequence

import torch
import torch.fx

from amp_fx.core.dtypes import LOW_PRECISION_DTYPE_NAMES
from amp_fx.core.opt_levels import OPT_LEVELS
from amp_fx.inspect.capture_summary import CaptureSummary, capture_summary

INPUT_DTYPES = {"float32": torch.float32, "int64": torch.int64, "long": torch.int64}
# torchvision classification models whose stem needs another input size than 224x224.
_TORCHVISION_INPUT_SIZE = {"inception_v3": 299}


class ModelSpecError(ValueError):
    """MODEL names something that cannot be found or built; the message says what to do."""


def parse_shape(text: str) -> tuple[int, ...]:
    """Parse "1,3,224,224" (or "1x3x224x224") into a shape tuple."""
    parts = re.split(r"[,x]", text.strip())
    try:
        shape = tuple(int(part) for part in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"input shape must be integers like 1,3,224,224, got {text!r}"
        ) from None
    if not shape or any(size <= 0 for size in shape):
        raise argparse.ArgumentTypeError(
            f"input shape must be positive integers like 1,3,224,224, got {text!r}"
        )
    return shape


def _build(cls: type, where: str) -> torch.nn.Module:
    try:
        model = cls()
    except Exception as error:  # any failure in user code: report it on one line
        raise ModelSpecError(
            f"could not build {where} with no arguments ({type(error).__name__}: {error}); give the class "
            "defaults for its arguments, or point MODEL at a class that needs none"
        ) from error
    if not isinstance(model, torch.nn.Module):
        raise ModelSpecError(f"{where} built a {type(model).__name__}, not a torch.nn.Module")
    return model


def _module_classes(namespace: object) -> list[str]:
    return sorted(
        name
        for name, value in vars(namespace).items()
        if isinstance(value, type) and issubclass(value, torch.nn.Module) and not name.startswith("_")
    )


def _load_torchvision(name: str) -> torch.nn.Module:
    try:
        import torchvision
    except ImportError:
        raise ModelSpecError(
            "torchvision is not installed: install it (pip install torchvision) to inspect torchvision models"
        ) from None
    available = torchvision.models.list_models()
    if name not in available:
        close = difflib.get_close_matches(name, available, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else "; see torchvision.models.list_models()"
        raise ModelSpecError(f"torchvision has no model {name!r}{hint}")
    try:
        return torchvision.models.get_model(name, weights=None)
    except Exception as error:
        raise ModelSpecError(
            f"could not build torchvision:{name} ({type(error).__name__}: {error})"
        ) from error


def _load_from_file(path: str, class_name: str) -> torch.nn.Module:
    if not os.path.isfile(path):
        raise ModelSpecError(f"no file {path!r}: give the path of a .py file that defines the model class")
    module_name = "amp_fx_cli_model_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ModelSpecError(f"cannot import {path!r}: give the path of a Python (.py) file")
    module = importlib.util.module_from_spec(spec)
    # The file's directory goes on sys.path so that it can import its neighbours.
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    except Exception as error:
        sys.modules.pop(module_name, None)
        raise ModelSpecError(
            f"importing {path} failed ({type(error).__name__}: {error}); fix the file"
        ) from error
    finally:
        sys.path.pop(0)
    return _class_from(module, class_name, path)


def _load_from_module(module_name: str, class_name: str) -> torch.nn.Module:
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ModelSpecError(
            f"cannot import {module_name!r} ({error}); give a path to a .py file, an importable module, "
            "or torchvision:NAME"
        ) from error
    return _class_from(module, class_name, module_name)


def _class_from(module: object, class_name: str, where: str) -> torch.nn.Module:
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        classes = _module_classes(module)
        close = difflib.get_close_matches(class_name, classes, n=3)
        listed = ", ".join(close or classes) or "none"
        what = "is not a torch.nn.Module class" if cls is not None else "is not defined"
        raise ModelSpecError(f"{class_name!r} {what} in {where}; nn.Module classes there: {listed}")
    return _build(cls, f"{where}:{class_name}")


# Sizes for ``transformers:ClassName``: each given to the config class that takes it, and to the
# sub-configs (CLIP's text and vision). Vocabularies keep their size: special token ids index them.
_SMALL_TRANSFORMERS_SIZES = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "intermediate_size": 128, "max_position_embeddings": 128, "n_embd": 64,
    "n_layer": 2, "n_head": 4, "n_positions": 128, "d_model": 64, "d_kv": 16, "d_ff": 128,
    "num_heads": 4, "num_layers": 2, "num_decoder_layers": 2, "encoder_layers": 2,
    "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "max_source_positions": 64,
    "max_target_positions": 64, "image_size": 32, "patch_size": 8, "projection_dim": 32,
}  # fmt: skip
_TRANSFORMERS_SEQUENCE = 8


def _small_config(config_class: type) -> object:
    accepted = pyinspect.signature(config_class.__init__).parameters
    values: dict[str, object] = {k: v for k, v in _SMALL_TRANSFORMERS_SIZES.items() if k in accepted}
    for name, sub_class in getattr(config_class, "sub_configs", {}).items():
        if name in accepted and isinstance(sub_class, type):
            values[name] = _small_config(sub_class).to_dict()
    config = config_class(**values)
    if getattr(config, "kv_lora_rank", None) and hasattr(config, "num_key_value_heads"):
        # Multi-head latent attention expands its keys and values to every head: as in the
        # released configs, as many key/value heads as heads (else they are repeated twice over).
        config.num_key_value_heads = config.num_attention_heads
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    width = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    if isinstance(getattr(config, "rotary_dim", None), int) and heads and width:
        # GPT-J's and CodeGen's rotary width is part of a head: at most the small head's size.
        config.rotary_dim = min(config.rotary_dim, width // heads)
    return config


def _load_transformers(name: str) -> torch.nn.Module:
    try:
        import transformers
    except ImportError:
        raise ModelSpecError(
            "transformers is not installed: install it (pip install transformers) to inspect its models"
        ) from None
    cls = getattr(transformers, name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module) and hasattr(cls, "config_class")):
        models = [n for n in dir(transformers) if n.endswith(("Model", "LMHeadModel")) or "For" in n]
        close = difflib.get_close_matches(name, models, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ModelSpecError(f"transformers has no model class {name!r}{hint}")
    try:
        return cls(_small_config(cls.config_class))
    except Exception as error:
        raise ModelSpecError(
            f"could not build transformers:{name} from a small {cls.config_class.__name__} "
            f"({type(error).__name__}: {error})"
        ) from error


def transformers_inputs(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Keyword inputs for a transformers model, one example of each input its forward takes
    (token ids, images, audio features, decoder token ids), sized from its config.

    >>> import transformers
    >>> model = transformers.BertModel(transformers.BertConfig(num_hidden_layers=1))
    >>> {name: tuple(value.shape) for name, value in transformers_inputs(model).items()}
    {'input_ids': (1, 8)}
    """
    config = model.config
    text = getattr(config, "text_config", None) or config
    vision = getattr(config, "vision_config", None) or config
    accepted = pyinspect.signature(model.forward).parameters
    generator = torch.Generator().manual_seed(0)
    inputs: dict[str, torch.Tensor] = {}
    if "input_ids" in accepted:
        inputs["input_ids"] = torch.randint(
            0, text.vocab_size, (1, _TRANSFORMERS_SEQUENCE), generator=generator
        )
    if "pixel_values" in accepted:
        size = vision.image_size
        inputs["pixel_values"] = torch.randn(1, vision.num_channels, size, size, generator=generator)
    if "input_features" in accepted:
        frames = 2 * config.max_source_positions  # the encoder's two convolutions halve them once
        inputs["input_features"] = torch.randn(1, config.num_mel_bins, frames, generator=generator)
    if "decoder_input_ids" in accepted:
        inputs["decoder_input_ids"] = torch.randint(0, text.vocab_size, (1, 4), generator=generator)
    return inputs


def load_model(spec: str) -> torch.nn.Module:
    """Build the model MODEL names: ``torchvision:NAME``, ``transformers:ClassName``,
    ``file.py:Class`` or ``pkg.module:Class``.

    >>> load_model("torchvision:resnet18").__class__.__name__
    'ResNet'
    """
    source, sep, name = spec.rpartition(":")
    if not sep or not source or not name:
        raise ModelSpecError(
            f"MODEL {spec!r} must be torchvision:NAME, transformers:ClassName, path/to/file.py:ClassName "
            "or package.module:ClassName"
        )
    if source == "torchvision":
        return _load_torchvision(name)
    if source == "transformers":
        return _load_transformers(name)
    if source.endswith(".py") or os.sep in source or "/" in source:
        return _load_from_file(source, name)
    return _load_from_module(source, name)


def default_input_shape(spec: str) -> tuple[int, ...] | None:
    """The input shape used when --input-shape is not given: ImageNet-sized for torchvision models."""
    source, _, name = spec.rpartition(":")
    if source == "torchvision":
        size = _TORCHVISION_INPUT_SIZE.get(name, 224)
        return (1, 3, size, size)
    return None


# Token ids given to a model whose first layer is an nn.Embedding when --input-shape is not given:
# one sequence of 8 (short enough for any positional table).
_TOKEN_INPUT_SHAPE = (1, 8)


def takes_token_ids(model: torch.nn.Module) -> bool:
    """Whether the model's first layer (its first module without children) is an ``nn.Embedding``:
    its input is then integer token ids, not floats.

    >>> takes_token_ids(torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 2)))
    True
    """
    leaves = (m for m in model.modules() if next(m.children(), None) is None)
    return isinstance(next(leaves, None), torch.nn.Embedding)


def _positional_inputs(model: torch.nn.Module) -> int:
    parameters = pyinspect.signature(model.forward).parameters.values()
    return sum(
        1
        for p in parameters
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is pyinspect.Parameter.empty
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="amp-fx", description="amp_fx: mixed precision as torch.fx passes")
    commands = parser.add_subparsers(dest="command", required=True)
    inspect_cmd = commands.add_parser(
        "inspect",
        help="convert a model and print the report of the rewritten graph",
        description="Convert MODEL at an opt level and print each node's rule, dtypes and inserted casts.",
    )
    inspect_cmd.add_argument(
        "model", metavar="MODEL", help="torchvision:NAME, path/to/file.py:Class or pkg.module:Class"
    )
    inspect_cmd.add_argument("--opt-level", default="O2", choices=OPT_LEVELS)
    inspect_cmd.add_argument(
        "--dtype", default="fp16", choices=sorted(LOW_PRECISION_DTYPE_NAMES), help="low-precision dtype"
    )
    inspect_cmd.add_argument(
        "--device-type", default=None, choices=["cuda", "cpu"], help="whose autocast op lists O1 follows"
    )
    inspect_cmd.add_argument(
        "--input-shape",
        type=parse_shape,
        default=None,
        help="shape of one example input, e.g. 1,3,224,224 (exact dtypes in the report); "
        "torchvision models default to 1,3,224,224",
    )
    inspect_cmd.add_argument(
        "--input-dtype",
        default=None,
        choices=sorted(INPUT_DTYPES),
        help="dtype of the example input; default: int64 when the model's first layer is an nn.Embedding "
        f"(token ids, shape {','.join(map(str, _TOKEN_INPUT_SHAPE))} unless --input-shape), else float32",
    )
    inspect_cmd.add_argument(
        "--dot", metavar="PATH", default=None, help="also write the graph as Graphviz DOT"
    )
    inspect_cmd.add_argument(
        "--diff", action="store_true", help="also print the diff against the original graph"
    )
    return parser


def _example(
    args: argparse.Namespace, model: torch.nn.Module
) -> tuple[tuple[object, ...], dict[str, object]]:
    """The call the model is inspected on: keyword inputs for a transformers model, else one
    positional input of --input-shape (none without a shape)."""
    if args.model.startswith("transformers:"):
        inputs = transformers_inputs(model)
        described = ", ".join(f"{name} {'x'.join(map(str, value.shape))}" for name, value in inputs.items())
        print(f"inputs: {described} (sized from the model's config)")
        return (), inputs
    shape = args.input_shape or default_input_shape(args.model)
    input_dtype_name = args.input_dtype
    if input_dtype_name is None and takes_token_ids(model):
        # Without an integer example the input would be taken as float and the report would show
        # a cast of the token ids to fp16/bf16 that never happens.
        input_dtype_name = "int64"
        shape = shape or _TOKEN_INPUT_SHAPE
        print(
            f"input: int64 token ids of shape {','.join(map(str, shape))} (the first layer is an "
            "nn.Embedding;\n  --input-dtype and --input-shape change this)"
        )
    if shape is None:
        return (), {}
    if _positional_inputs(model) > 1:
        raise ModelSpecError(
            f"{args.model} takes several inputs; --input-shape describes one: leave it out "
            "(dtypes are then propagated statically)"
        )
    input_dtype = INPUT_DTYPES[input_dtype_name or "float32"]
    example = (
        torch.zeros(shape, dtype=input_dtype) if not input_dtype.is_floating_point else torch.randn(shape)
    )
    return (example,), {}


def _summary(
    converted: torch.nn.Module, spec: str, call: tuple[tuple[object, ...], dict[str, object]]
) -> CaptureSummary:
    """`amp_fx.capture_summary` of the converted model, counted on the example call when there is
    one (the torch.export front end captures at that call, so it needs one)."""
    args, kwargs = call
    if not args and not kwargs and not isinstance(converted, torch.fx.GraphModule):
        raise ModelSpecError(
            f"{spec} is converted by the torch.export front end, which captures at the first call: give "
            "--input-shape (the input it is called on)"
        )
    try:
        return capture_summary(converted, *args, **kwargs)
    except Exception as error:  # the model's own code on the example: report it on one line
        raise ModelSpecError(
            f"calling the converted {spec} on the example failed ({type(error).__name__}: {error}); "
            "give an --input-shape it takes"
        ) from error


def run_inspect(args: argparse.Namespace) -> int:
    import amp_fx

    model = load_model(args.model).eval()
    call = _example(args, model)
    try:
        converted = amp_fx.convert(
            model,
            args.opt_level,
            dtype=args.dtype,
            device_type=args.device_type,
            example_inputs=call[0] or None,
        )
    except (TypeError, ValueError, RuntimeError) as error:
        raise ModelSpecError(f"converting {args.model} failed: {error}") from error
    print(_summary(converted, args.model, call))
    report = amp_fx.report(converted)
    print(report)
    if args.diff:
        print(report.diff())
    if args.dot:
        for path in report.write_dot(args.dot):
            print(f"wrote {path} (render with: dot -Tsvg {path} -o graph.svg)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``amp-fx`` and ``python -m amp_fx``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            status = run_inspect(args)
            sys.stdout.flush()  # a closed pipe is found here, not in the interpreter's exit
            return status
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, as the Python docs recommend (the note on
        # SIGPIPE in the signal module): point stdout at devnull so that the flush at exit cannot
        # fail again, and exit with 1.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except ModelSpecError as error:
        print(f"amp-fx: error: {error}".splitlines()[0], file=sys.stderr)
        return 1
    except OSError as error:
        print(f"amp-fx: error: {error}", file=sys.stderr)
        return 1
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
