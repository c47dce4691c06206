"""Models for the command line: a factory named by file or module, or a Hugging Face config.

    --model examples/gpt.py:factory         a file, then the function in it
    --model mypackage.models:small_gpt      an importable module, then the function
    --hf llama --config hidden_size=64 num_hidden_layers=2

A factory takes keyword arguments (`--config key=value ...`, values read as Python literals:
`n_layer=4`, `bias=False`, `name='x'`) and returns `(model, example_inputs)`: the model and
one global batch, a tuple of tensors (passed positionally) or a dict (by keyword), as
`fxpar.compile` takes them. `--hf FAMILY` builds `transformers.AutoConfig.for_model(FAMILY,
**config)` and its causal-LM model (a masked-LM one for encoders such as BERT) with no weights
downloaded, on the meta device: nothing is allocated, which is all that planning, checking,
estimating and drawing need; its example batch is random `input_ids` of `batch x seq` with
`labels` equal to them.

Every mistake raises `ModelSpecError` (a ValueError) that names what was given and the fix;
the command line turns it into exit status 2.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from fxpar.errors import clipped, shown

ENCODERS = ("bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2")


class ModelSpecError(ValueError):
    """A --model, --hf or --config that does not give a model and its example inputs."""


def parse_config(entries: Sequence[str]) -> dict[str, object]:
    """`["n_layer=4", "bias=False"]` -> `{"n_layer": 4, "bias": False}`; a value that is not
    a Python literal stays text."""
    config: dict[str, object] = {}
    for entry in entries:
        key, sep, text = entry.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ModelSpecError(f"--config {entry!r}: expected KEY=VALUE, e.g. n_layer=4 or bias=False")
        try:
            config[key.strip()] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            config[key.strip()] = text
    return config


def load_factory(spec: str) -> Callable:
    """The function `spec` ("path/to/file.py:name" or "package.module:name") names."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ModelSpecError(
            f"--model {spec!r}: expected FILE.py:FACTORY or package.module:FACTORY, e.g. "
            "examples/gpt.py:factory"
        )
    module = _load_file(spec, Path(where)) if where.endswith(".py") or "/" in where else _import(spec, where)
    factory = getattr(module, name, None)
    if not callable(factory):
        found = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_")
                       and v.__module__ == module.__name__)
        raise ModelSpecError(
            f"--model {spec!r}: {where} has no function {name!r}. Its functions: "
            f"{', '.join(found) or 'none'}. Fix: name the function that returns (model, example_inputs)"
        )
    return factory


def _load_file(spec: str, path: Path):
    if not path.is_file():
        raise ModelSpecError(f"--model {spec!r}: no file {path} (relative to {Path.cwd()}). Fix: give "
                             "the path of a Python file, e.g. examples/gpt.py:factory")
    name = f"_fxpar_model_{path.stem}"
    loader = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(loader)
    sys.modules[name] = module  # dataclasses and pickling look their module up there
    sys.path.insert(0, str(path.resolve().parent))  # the file's sibling modules import as in a script
    try:
        loader.loader.exec_module(module)
    except Exception as error:
        del sys.modules[name]
        raise ModelSpecError(f"--model {spec!r}: running {path} failed: {type(error).__name__}: "
                             f"{_first_line(error)}. Fix: run `python {path}` to see the traceback") from error
    finally:
        sys.path.remove(str(path.resolve().parent))
    return module


def _import(spec: str, name: str):
    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise ModelSpecError(
            f"--model {spec!r}: cannot import module {name!r} ({_first_line(error)}). Fix: install it, "
            "run from the folder that holds it, or give a file path such as path/to/models.py:factory"
        ) from error
    except Exception as error:  # the module's own code failed while it was imported
        raise ModelSpecError(f"--model {spec!r}: importing {name} failed: {type(error).__name__}: "
                             f"{_first_line(error)}. Fix: run `python -c 'import {name}'` to see the "
                             "traceback") from error


def build_from_factory(spec: str, config: Mapping[str, object]) -> tuple[torch.nn.Module, object]:
    """Call the factory `spec` names with `config` and check what it returns."""
    factory = load_factory(spec)
    try:
        inspect.signature(factory).bind(**config)
    except TypeError as error:
        names = ", ".join(inspect.signature(factory).parameters) or "no arguments"
        raise ModelSpecError(f"--model {spec!r}: --config {dict(config)} does not fit {factory.__name__}() "
                             f"({error}); it takes {names}. Fix: pass only the arguments it names") from None
    call = f"{factory.__name__}({', '.join(f'{k}={v!r}' for k, v in config.items())})"
    try:
        result = factory(**config)
    except Exception as error:  # the user's code: any error is theirs to fix, shown in one line
        raise ModelSpecError(
            f"--model {spec!r}: {clipped(call)} raised {type(error).__name__}: "
            f"{_first_line(error)}. Fix: correct the factory or its --config values (call it in "
            "Python to see the traceback)"
        ) from error
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.nn.Module)):
        raise ModelSpecError(
            f"--model {spec!r}: {factory.__name__}() returned {_returned(result)}, not (model, "
            "example_inputs). Fix: return the nn.Module and one batch: a tuple of tensors or a dict"
        )
    model, inputs = result
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else inputs
    values = list(inputs.values()) if isinstance(inputs, Mapping) else inputs
    keys_ok = not isinstance(inputs, Mapping) or all(isinstance(k, str) for k in inputs)
    if not (isinstance(inputs, (tuple, list, Mapping)) and keys_ok
            and all(isinstance(x, torch.Tensor) for x in values)):
        raise ModelSpecError(
            f"--model {spec!r}: {factory.__name__}() returned ({type(model).__name__}, "
            f"{_returned(inputs)}): its example_inputs are not one batch of tensors. Fix: return "
            "(model, inputs) with inputs a tensor, a tuple of tensors (passed in order) or a dict "
            "of name -> tensor (passed by keyword)"
        )
    return model, inputs


def _returned(value: object) -> str:
    """What a factory returned, for a message: "a tuple of 3 items", "an int (5)"."""
    kind = type(value).__name__
    article = "an" if kind[:1].lower() in "aeiou" else "a"
    if isinstance(value, (tuple, list, dict)):
        inner = ", ".join(type(v).__name__ for v in (value.values() if isinstance(value, dict) else value))
        return f"{article} {kind} of {len(value)} item{'' if len(value) == 1 else 's'} ({clipped(inner)})"
    if isinstance(value, torch.nn.Module):
        return f"{article} {kind} model alone"
    return f"{article} {kind} ({' '.join(shown(value).split())})"


def _innermost(error: BaseException) -> BaseException:
    """The exception at the bottom of `error`'s chain of `raise ... from cause`."""
    seen = {id(error)}
    while error.__cause__ is not None and id(error.__cause__) not in seen:
        error = error.__cause__
        seen.add(id(error))
    return error


def _first_line(error: BaseException) -> str:
    """An exception's message in one line: its first, at most `_MESSAGE_CHARACTERS` long."""
    lines = str(error).strip().splitlines()
    if not lines:
        return "(no message)"
    first, more = lines[0].rstrip(". "), len(lines) - 1
    if len(first) > _MESSAGE_CHARACTERS:
        first = f"{first[:_MESSAGE_CHARACTERS - 24]}… ({len(first):,} characters)"
    return first + (f" (and {more} more line{'s' * (more > 1)})" if more else "")


_MESSAGE_CHARACTERS = 240  # of an error the user's code or transformers raised, in one line


def build_hugging_face(family: str, config: Mapping[str, object], *, batch: int, seq: int):
    """A random-weight (meta-device) transformers model of `family` and its example batch."""
    try:
        import transformers
    except ImportError:
        raise ModelSpecError("--hf needs the transformers package. Fix: pip install 'transformers>=5'") from None
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for flag, size in (("--batch", batch), ("--seq", seq)):
        if size < 1:
            raise ModelSpecError(f"--hf {family!r}: {flag} {size}: the example batch needs at least one "
                                 f"row and one token. Fix: {flag} 8, or leave {flag} out")
    if family not in CONFIG_MAPPING:
        raise ModelSpecError(f"--hf {family!r}: transformers does not know this model type. Fix: a "
                             "model_type such as llama, gpt2, mistral, qwen2, gpt_neox or bert")
    try:  # transformers validates the fields (hidden_size divisible by the heads, ...)
        settings = transformers.AutoConfig.for_model(family, **{"use_cache": False, **config})
    except Exception as error:
        cause = _innermost(error)  # huggingface_hub wraps the field's own error in its validator's
        raise ModelSpecError(f"--hf {family} --config {clipped(str(dict(config)))}: {type(cause).__name__}: "
                             f"{_first_line(cause)}. Fix: correct the --config fields it names") from None
    auto = transformers.AutoModelForMaskedLM if family in ENCODERS else transformers.AutoModelForCausalLM
    with torch.device("meta"):
        try:
            model = auto.from_config(settings)
        except ValueError as error:
            raise ModelSpecError(f"--hf {family!r}: no causal or masked language model for it "
                                 f"({_first_line(error)})") from None
        except Exception as error:  # a config transformers accepted but cannot build
            raise ModelSpecError(f"--hf {family} --config {clipped(str(dict(config)))}: building the model "
                                 f"raised {type(error).__name__}: {_first_line(error)}. Fix: correct "
                                 "the --config fields it names") from None
    vocab = int(getattr(settings, "vocab_size", 256))
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    return model.train(), {"input_ids": ids, "labels": ids.clone()}
