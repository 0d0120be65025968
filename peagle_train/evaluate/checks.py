"""The checks of a ``peagle-eval`` run that need no verifier weights (docs/design.md §2)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peagle_train.evaluate.prompts import Prompt, read_prompts
from peagle_train.generate.checks import check_drafter_tokenizer, check_verifier_config, trained_template_kwargs
from peagle_train.generate.speculative import checked_num_draft_tokens
from peagle_train.generate.verifier import config_recurrent_layers
from peagle_train.train.kinds import DrafterKind, check_any_servable, checkpoint_kind
from runtime.chat.chat_template import chat_template_kwargs_record, describe_kwargs
from stores.errors import StoreMismatchError
from stores.features.feature_store import check_layer_convention, FeatureStore
from runtime.chat.setting_mixtures import Mixture
from runtime.model_cache import model_files
from runtime.verifier_match import check_store_verifier


@dataclass(frozen=True)
class CheckedInputs:
    """What :func:`check_before_weights` read and resolved.

    Attributes:
        prompts: the prompts read (``num_prompts`` of them), None without a prompts file.
        online_verifier: the online verifier MODEL (given, else the drafter's), None without a prompts file.
        store: the offline store opened, None without one.
        offline_verifier: the offline verifier MODEL (given, else the store's; None: the store names none).
        kind: the drafter checkpoint's kind (:func:`~peagle_train.train.kinds.checkpoint_kind`).
        recurrent_layers: per verifier MODEL checked, its layers with a recurrent state
            (:func:`~peagle_train.generate.verifier.config_recurrent_layers` of its config).
        num_draft_tokens: K, ``num_draft_tokens`` or the drafter's ``num_depths``, checked.
    """

    prompts: list[Prompt] | None
    online_verifier: str | None
    store: FeatureStore | None
    offline_verifier: str | None
    kind: DrafterKind | None = None
    num_draft_tokens: int | None = None
    recurrent_layers: dict[str, list[int]] = field(default_factory=dict)


def check_before_weights(drafter_dir: str | Path, verifier_name: str | None = None,
                         prompts_file: str | Path | None = None, store: str | Path | None = None,
                         num_prompts: int | None = None, num_draft_tokens: int | None = None) -> CheckedInputs:
    """Every check of a ``peagle-eval`` run that needs no verifier weights (docs/design.md §2): the
    prompts file, the drafter checkpoint (vLLM's rules: :func:`peagle_train.model.checkpoint.vllm_problems`),
    ``num_draft_tokens`` against its trained ``num_depths``, the
    store against the drafter, the online verifier's tokenizer against the drafter's training data
    (:func:`~peagle_train.generate.checks.check_drafter_tokenizer`), the offline verifier against the store
    (content fingerprint and the tokenizer of its ids: :func:`runtime.verifier_match.check_store_verifier`), and each
    verifier's config (online: ``verifier_name`` or the drafter's; offline: ``verifier_name`` or the store's).

    Returns:
        What the checks resolved (:class:`CheckedInputs`), for the run to take instead of resolving it again.

    Raises:
        InputError, StoreFormatError, StoreMismatchError, ModelNotFoundError: as the run would, later;
        InputError for a drafter vLLM would not serve as trained; StoreFormatError for a store whose aux
        layer L is the normed final state (an older peagle's).
    """
    prompts = read_prompts(prompts_file, num_prompts) if prompts_file is not None else None
    check_any_servable(drafter_dir)  # vLLM's rules for its kind, for a drafter of any origin
    kind = checkpoint_kind(drafter_dir)
    drafter = kind.load(drafter_dir)
    K = checked_num_draft_tokens(num_draft_tokens, drafter)
    names, online, fs, offline, files = [], None, None, None, None
    if prompts_file is not None:
        online = verifier_name or drafter.config.verifier_name_or_path
        if online:  # none named: refused with the online plan (InputError, --verifier)
            files = model_files(online)  # its directory and tokenizer, resolved once for both checks
            check_drafter_tokenizer(drafter_dir, files)
        names.append(online)
    if store is not None:
        fs = FeatureStore.open(store)
        check_layer_convention(fs.attrs, str(fs.path))
        check_store_fits(fs, drafter)
        offline = verifier_name or fs.attrs.get("verifier", {}).get("name_or_path")
        if offline:
            check_store_verifier(fs, files if files is not None and files.name == offline else model_files(offline))
        names.append(offline)
    recurrent = {name: config_recurrent_layers(check_verifier_config(name, drafter))
                 for name in dict.fromkeys(n for n in names if n)}
    return CheckedInputs(prompts=prompts, online_verifier=online, store=fs, offline_verifier=offline, kind=kind,
                         num_draft_tokens=K, recurrent_layers=recurrent)


def check_store_fits(store, drafter) -> None:
    cfg = drafter.config
    if list(store.layers) != list(cfg.aux_layer_ids) or store.hidden_size != cfg.hidden_size \
            or store.vocab_size != cfg.vocab_size:
        raise StoreMismatchError(
            f"{store.path}: store layers {store.layers}, hidden {store.hidden_size}, vocab {store.vocab_size}; "
            f"the drafter wants layers {cfg.aux_layer_ids}, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}. "
            "Evaluate on a store extracted from the drafter's verifier with its layers")


def template_mode(drafter_dir: str | Path, requested: dict | None, allow_mismatch: bool = False,
                  store: str | Path | None = None, variables: dict[str, Any] | None = None,
                  seed: int | None = None) -> dict:
    """The chat template variables a ``peagle-eval`` run renders its prompts with, checked against the mode
    the drafter was trained in and the one the STORE was made in (docs/design.md §9).

    Args:
        requested: ``--chat-template-kwargs``; None: the drafter's own (none for a checkpoint that
            records none).
        allow_mismatch: ``--allow-template-mode-mismatch``: report a mismatch instead of refusing it.
        store: the offline STORE, whose ``tokenizer`` record holds the variables its data was rendered with.
        variables: the variables each prompt draws (``EvalConfig.mode_variables``: a value or a
            :class:`~runtime.chat.setting_mixtures.Mixture` each): a drawn value other than the one the drafter's
            data fixes is a mismatch; the checkpoint records only the fixed variables, so drawn ones it
            does not fix are not checked (the training mixture is in the tokenize/pack manifests).
        seed: the seed the prompts draw with (recorded).

    Returns:
        The report's ``template_mode``: ``chat_template_kwargs`` (used: the fixed variables, without the
        drawn ones), ``trained_chat_template_kwargs`` (None: not recorded), ``store_chat_template_kwargs``
        (with a store), with a mixture ``mixture`` (``{variable: value or {value: weight}}``) and ``seed``,
        ``mismatches`` (sentences; empty when all agree) and ``mismatch_allowed``.

    Raises:
        StoreMismatchError: the modes differ and ``allow_mismatch`` is false (names both).
    """
    trained = trained_template_kwargs(drafter_dir)
    used = chat_template_kwargs_record(requested if requested is not None else (trained or {}))
    mismatches = []
    if trained is not None and used != trained:
        mismatches.append(f"the drafter {drafter_dir} was trained on data rendered with chat template kwargs "
                          f"{describe_kwargs(trained)}, but --chat-template-kwargs gives {describe_kwargs(used)}")
    variables = variables or {}
    for name, setting in variables.items():
        values = [setting.values[k] for k, w in setting.weights.items() if w > 0] \
            if isinstance(setting, Mixture) else [setting]
        if trained is not None and name in trained and any(v != trained[name] for v in values):
            mismatches.append(f"the drafter {drafter_dir} was trained on data rendered with {name} "
                              f"{json.dumps(trained[name])} (chat template kwargs {describe_kwargs(trained)}), but "
                              f"the mixture draws {name} from {json.dumps(values)}")
    used = {k: v for k, v in used.items() if k not in variables}
    out = {"chat_template_kwargs": used, "trained_chat_template_kwargs": trained}
    if variables:
        out["mixture"] = {name: setting.weights if isinstance(setting, Mixture) else setting
                          for name, setting in variables.items()}
        out["seed"] = seed
    if store is not None:
        recorded = FeatureStore.open(store).attrs.get("tokenizer") or {}
        made = chat_template_kwargs_record(recorded.get("chat_template_kwargs")) if recorded else None
        out["store_chat_template_kwargs"] = made
        if made is not None and trained is not None and made != trained:
            mismatches.append(f"the store {store} holds data rendered with chat template kwargs "
                              f"{describe_kwargs(made)}, but the drafter was trained with {describe_kwargs(trained)}")
    if mismatches and not allow_mismatch:
        raise StoreMismatchError(
            "; ".join(mismatches) + ": a drafter's acceptance holds for the mode it was trained in (the verifier "
            "answers another prompt in each). Evaluate in the drafter's mode (omit --chat-template-kwargs, or pass "
            "the recorded one; a STORE extracted from data in that mode), or pass --allow-template-mode-mismatch "
            "to measure it in another mode (the report's template_mode says so)")
    return {**out, "mismatches": mismatches, "mismatch_allowed": bool(mismatches)}
