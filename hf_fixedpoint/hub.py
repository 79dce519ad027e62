"""Export fixed-point models as self-contained checkpoints: merge LoRA, fold parametrizations, check that the saved
code and weights load with torch + transformers only, write a model card, push to the Hub.

    from hf_fixedpoint import hub

    card = hub.model_card(model, model_id="me/deq-lm-tiny", datasets=["wikitext"])
    hub.export(model, "runs/deq-lm-tiny", model_card=card)   # or: hub.push_to_hub(model, "me/deq-lm-tiny")
    # anywhere, without hf-fixedpoint installed:
    # AutoModelForCausalLM.from_pretrained("runs/deq-lm-tiny", trust_remote_code=True)

``export`` and ``push_to_hub`` change the model in place (a PEFT model is merged, parametrizations are folded); pass
``copy.deepcopy(model)`` to keep the original. peft and huggingface_hub are imported by the functions that use them.
"""

import copy
import importlib
import inspect
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import torch
from transformers import PreTrainedModel
from transformers.dynamic_module_utils import get_imports, get_relative_import_files, get_relative_imports

# Config keys whose value is a name in a registry of a vendored core file: key -> (sibling module, registry).
_REGISTRY_KEYS = {
    "fp_solver": ("fp_solvers", "SOLVERS"),
    "fp_backward_solver": ("fp_solvers", "SOLVERS"),
    "fp_backward": ("fp_backward", "BACKWARDS"),
}
# Auto class a family is registered for -> Hub pipeline tag.
_PIPELINE_TAGS = {
    "AutoModelForCausalLM": "text-generation",
    "AutoModelForMaskedLM": "fill-mask",
    "AutoModelForSequenceClassification": "text-classification",
    "AutoModelForImageClassification": "image-classification",
}
_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
_OWN_PACKAGES = ("hf_fixedpoint",)  # absolute imports a checkpoint's code must not make

_CARD_TEMPLATE = """---
{{ card_data }}
---

# {{ model_id }}
{% if description %}
{{ description }}
{% endif %}
`{{ model_class }}` (`model_type: {{ model_type }}`) is a fixed-point model built with hf-fixedpoint: its forward pass
solves `z* = f(z*; x)` with an iterative solver instead of stacking layers. The modeling code and the vendored solver
files ship with this checkpoint, so it loads with torch and transformers only (hf-fixedpoint need not be installed).

## How to load

```python
from transformers import {{ auto_class }}

model = {{ auto_class }}.from_pretrained("{{ model_id }}", trust_remote_code=True)
# Any fp_* setting can be overridden at load time, e.g. a larger iteration budget at inference:
model = {{ auto_class }}.from_pretrained("{{ model_id }}", trust_remote_code=True, fp_eval_max_iter=64)
```

## Fixed-point settings

| setting | value |
|---|---|
{% for key, value in fp_settings %}| `{{ key }}` | `{{ value }}` |
{% endfor %}
{%- if compat %}
## transformers releases

Measured by hf-fixedpoint's compatibility check (`make compat`, {{ compat.date }}): a tiny checkpoint of this family
saved by hf-fixedpoint (transformers {{ compat.saved_with }}) is loaded with `trust_remote_code=True` in a clean
environment (torch {{ compat.torch }} CPU, one transformers release, safetensors) and its outputs compared.

{{ compat.table }}
{% endif %}
{%- if results %}
## Evaluation

| task | dataset | split | metric | value |
|---|---|---|---|---|
{% for r in results %}| {{ r.task_type }} | {{ r.dataset_name }} | {{ r.dataset_split or "" }} | {{ r.metric_type }} \
| {{ r.metric_value }} |
{% endfor %}
{%- endif %}
"""


SUPPORT_FILE = Path(__file__).resolve().parent / "compat_support.json"


def support_cell(status: str) -> str:
    """A table cell for one family on one release: ``ok``, ``refused: ...`` or ``failed: ...`` (tools/compat_check)."""
    if status == "ok":
        return "yes"
    needed = re.search(r"needs transformers>=([\w.]+)", status)
    if status.startswith("refused") and needed:
        return f"no: refuses at load, needs >= {needed.group(1)}"
    return "**fails**"


def support_table(support: dict = None, family: str = None) -> str:
    """The measured support table (``compat_support.json``, written by ``make compat``) as markdown: every family
    by release, or with ``family`` one family's status per release. Empty when the file is absent."""
    if support is None:
        if not SUPPORT_FILE.is_file():
            return ""
        support = json.loads(SUPPORT_FILE.read_text())
    releases = support["releases"]
    names = [r["transformers"] + (" (newest)" if r.get("newest") else "") for r in releases]
    if family is not None:
        if any(family not in r["families"] for r in releases):
            return ""
        rows = ["| transformers | loads and reproduces the outputs |", "|---|---|"]
        rows += [f"| {n} | {support_cell(r['families'][family])} |" for n, r in zip(names, releases)]
        return "\n".join(rows)
    rows = ["| family | " + " | ".join(names) + " |", "|---" * (len(releases) + 1) + "|"]
    for fam in releases[0]["families"]:
        rows.append(f"| `{fam}` | " + " | ".join(support_cell(r["families"][fam]) for r in releases) + " |")
    rows.append("| classes that load and match | " + " | ".join(f"{r['ok']} / {r['total']}" for r in releases) + " |")
    return "\n".join(rows)


def export(model, output_dir, *, merge_lora=True, fold_parametrizations=True, model_card=None,
           safe_serialization=True) -> Path:
    """Save ``model`` as a checkpoint that loads with ``trust_remote_code=True`` and no hf-fixedpoint or peft.

    Args:
        model: a registered family model, or a ``peft.PeftModel`` around one.
        output_dir: folder to write (created if needed).
        merge_lora: merge a PEFT adapter into the weights (``merge_and_unload``). Without it a PEFT model is rejected:
            its ``save_pretrained`` writes an adapter that needs peft to load.
        fold_parametrizations: replace torch parametrizations (``torch.nn.utils.parametrizations.spectral_norm``,
            ``weight_norm``, ...) by the plain weight they compute in ``eval()`` mode.
        model_card: a ``huggingface_hub.ModelCard`` (see ``model_card``) or markdown text, written as README.md.
        safe_serialization: kept for the usual signature; transformers 5 writes safetensors only.

    Returns:
        ``Path(output_dir)``. Raises ``ValueError`` (see ``verify_self_contained``) if the model fails the checks
        (before anything is written) or the written folder does.
    """
    if not safe_serialization:
        raise ValueError("safe_serialization=False is not supported: transformers 5 saves safetensors only.")
    if merge_lora:
        model = _merge_peft(model)
    if fold_parametrizations:
        _fold_parametrizations(model)
    verify_self_contained(model)
    output_dir = Path(output_dir)
    model.save_pretrained(output_dir)
    if model_card is not None:
        from huggingface_hub import ModelCard

        card = model_card if isinstance(model_card, ModelCard) else ModelCard(str(model_card))
        card.save(output_dir / "README.md")
    verify_self_contained(output_dir)
    return output_dir


def _peft_model_class():
    # A PeftModel can exist only if peft was imported already; looking it up in sys.modules keeps peft optional and
    # unimported for models that never used it.
    peft = sys.modules.get("peft")
    return peft.PeftModel if peft is not None else None


def _merge_peft(model):
    peft_model_class = _peft_model_class()
    if peft_model_class is not None and isinstance(model, peft_model_class):
        return model.merge_and_unload()
    return model


def _fold_parametrizations(model) -> None:
    from torch.nn.utils import parametrize

    was_training = model.training
    model.eval()  # spectral_norm runs a power-iteration step on every access in train mode: fold the inference weight
    for module in list(model.modules()):
        if parametrize.is_parametrized(module):
            for name in list(module.parametrizations):
                parametrize.remove_parametrizations(module, name, leave_parametrized=True)
    model.train(was_training)


def verify_self_contained(model_or_dir) -> None:
    """Raise ``ValueError`` listing every reason a checkpoint would not load with torch + transformers only.

    For a model (before saving):
      * the model and config classes are registered for auto classes, so ``save_pretrained`` writes code + auto_map;
      * each solver / backward name in the config (``fp_solver``, ``fp_backward_solver``, ``fp_backward``) exists in
        the registries of the vendored ``fp_solvers.py`` / ``fp_backward.py`` next to the modeling file, is defined
        there (not registered at run time from elsewhere), and that file is imported by the modeling code;
      * the state dict has the keys of a fresh ``type(model)(config)`` (no PEFT layers, no unfolded parametrizations).
    For a directory (after saving):
      * ``config.json`` has an ``auto_map`` and every file it names exists;
      * every sibling import (``from .x import y``) of those files resolves to a file in the directory, transitively;
      * no code file imports hf_fixedpoint, and there are no PEFT adapter files.
    """
    if isinstance(model_or_dir, (str, os.PathLike)):
        what, problems = f"The checkpoint folder {model_or_dir}", _folder_problems(Path(model_or_dir))
    else:
        what, problems = f"The model {type(model_or_dir).__name__}", _model_problems(model_or_dir)
    if problems:
        raise ValueError(
            f"{what} is not self-contained: it would not load with torch + transformers and trust_remote_code=True.\n"
            + "\n".join(f"  - {p}" for p in problems)
        )


def _model_problems(model) -> list:
    cls = type(model)
    peft_model_class = _peft_model_class()
    if peft_model_class is not None and isinstance(model, peft_model_class):
        return [f"{cls.__name__} is a PEFT wrapper; its save_pretrained writes an adapter that needs peft to load. "
                "Merge it first: export(..., merge_lora=True) or model.merge_and_unload()."]
    if not isinstance(model, PreTrainedModel):
        return [f"{cls.__name__} is not a transformers PreTrainedModel."]
    problems = []
    for klass, example in ((cls, f"{cls.__name__}.register_for_auto_class('AutoModelForCausalLM')"),
                           (type(model.config), f"{type(model.config).__name__}.register_for_auto_class()")):
        if getattr(klass, "_auto_class", None) is None:
            problems.append(f"{klass.__name__} is not registered for an auto class, so save_pretrained writes neither "
                            f"its code nor auto_map. `import hf_fixedpoint.modeling` registers every family; for "
                            f"another class call {example}.")
    return problems + _registry_problems(model) + _state_dict_problems(model)


def _registry_problems(model) -> list:
    cls, config = type(model), model.config
    package = cls.__module__.rpartition(".")[0]
    modeling_file = Path(inspect.getfile(cls))
    if not package:
        return [f"{cls.__name__} is defined in module {cls.__module__!r}, not in a model family folder."]
    shipped = {Path(f).name for f in get_relative_import_files(modeling_file)}
    problems = []
    for key, (module_name, registry_name) in _REGISTRY_KEYS.items():
        name = getattr(config, key, None)
        if name is None:
            continue
        source = modeling_file.parent / f"{module_name}.py"
        if f"{module_name}.py" not in shipped:
            problems.append(f"config.{key}={name!r} needs {source}, but {modeling_file.name} does not import it "
                            "(directly or through its siblings), so save_pretrained would not copy it.")
            continue
        registry = getattr(importlib.import_module(f"{package}.{module_name}"), registry_name)
        if name not in registry:
            problems.append(f"config.{key}={name!r} is not in the vendored {registry_name} registry of {source}. "
                            f"Valid names: {', '.join(map(repr, registry.names()))}. New ones go into "
                            f"hf_fixedpoint/core/{module_name}.py, then `python -m hf_fixedpoint.vendor`.")
            continue
        owner = getattr(registry.get(name), "__module__", "") or ""
        if owner.rpartition(".")[0] != package:
            problems.append(f"config.{key}={name!r} was registered at run time from {owner!r}, which does not ship "
                            f"with the checkpoint. Add it to hf_fixedpoint/core/{module_name}.py, then "
                            "`python -m hf_fixedpoint.vendor`.")
    return problems


def _state_dict_problems(model) -> list:
    with torch.device("meta"):
        fresh = type(model)(copy.deepcopy(model.config))
    have, want = set(model.state_dict()), set(fresh.state_dict())
    if have == want:
        return []

    def preview(keys):
        keys = sorted(keys)
        return ", ".join(keys[:4]) + (f" (+{len(keys) - 4} more)" if len(keys) > 4 else "") if keys else "none"

    return [f"the state dict differs from a fresh {type(model).__name__}(config), so the reloaded model would drop "
            f"or re-initialize weights. Unexpected keys: {preview(have - want)}; missing keys: "
            f"{preview(want - have)}. Merge adapters (merge_lora=True) and fold parametrizations "
            "(fold_parametrizations=True) before saving."]


def _folder_problems(folder: Path) -> list:
    config_file = folder / "config.json"
    if not config_file.is_file():
        return [f"{config_file} does not exist."]
    problems, todo = [], []
    for json_name in ("config.json", "tokenizer_config.json"):
        path = folder / json_name
        auto_map = json.loads(path.read_text()).get("auto_map") if path.is_file() else None
        if json_name == "config.json" and not auto_map:
            problems.append("config.json has no auto_map, so transformers cannot find the model code; register the "
                            "classes for auto classes before save_pretrained (`import hf_fixedpoint.modeling`).")
        for auto_class, refs in (auto_map or {}).items():
            for ref in refs if isinstance(refs, (list, tuple)) else [refs]:
                if ref is None:
                    continue
                if "--" in ref:
                    problems.append(f"{json_name} auto_map[{auto_class!r}] = {ref!r} points to code in another "
                                    "repository.")
                else:
                    todo.append((ref.rpartition(".")[0], f"{json_name} auto_map[{auto_class!r}]"))
    needed_by = {}  # module name -> the files (or auto_map entries) that need it, closed over sibling imports
    while todo:
        module, referrer = todo.pop()
        if module in needed_by:
            needed_by[module].add(referrer)
            continue
        needed_by[module] = {referrer}
        path = folder / f"{module}.py"
        if path.is_file():
            todo.extend((dep, path.name) for dep in get_relative_imports(path))
            own = sorted(set(get_imports(path)) & set(_OWN_PACKAGES))
            if own:
                problems.append(f"{path.name} imports {', '.join(own)}, which the loading side need not have; "
                                "import the vendored sibling files (`from .fp_x import y`) instead.")
    for module, referrers in sorted(needed_by.items()):
        if not (folder / f"{module}.py").is_file():
            problems.append(f"{module}.py is missing (needed by {', '.join(sorted(referrers))}).")
    for name in _ADAPTER_FILES:
        if (folder / name).is_file():
            problems.append(f"{name} is present: from_pretrained would treat the folder as a PEFT adapter (needs "
                            "peft). Export a merged model into a clean folder.")
    return problems


def model_card(model, *, model_id, base_model=None, datasets=None, eval_results=None, description=None,
               license="apache-2.0"):
    """A ``huggingface_hub.ModelCard`` for a fixed-point model.

    Args:
        model: the model (a PEFT wrapper is looked through).
        model_id: Hub id (or name) shown in the card and in the loading snippet.
        base_model: Hub id of the model this one was fine-tuned or retrofitted from.
        datasets: Hub dataset ids used for training.
        eval_results: dicts with the ``huggingface_hub.EvalResult`` fields: ``task_type``, ``dataset_type``,
            ``dataset_name``, ``metric_type``, ``metric_value`` and optionally ``dataset_split`` etc.; they become
            the card's ``model-index``.
        description: free text placed under the title.
        license: SPDX-style license id for the Hub metadata.

    The metadata carries the tags ``hf-fixedpoint``, ``fixed-point``, ``custom_code`` and the ``model_type``,
    ``library_name: transformers`` and a pipeline tag inferred from the auto class (``text-generation`` for causal
    LMs); the body lists the config's ``fp_*`` settings, how to load the model with ``trust_remote_code=True`` and the
    family's measured transformers support table (``support_table``).
    """
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    peft_model_class = _peft_model_class()
    if peft_model_class is not None and isinstance(model, peft_model_class):
        model = model.get_base_model()
    cls, config = type(model), model.config
    auto_class = getattr(cls, "_auto_class", None) or "AutoModel"
    pipeline_tag = _PIPELINE_TAGS.get(auto_class)
    if pipeline_tag is None and cls.__name__.endswith("ForCausalLM"):
        pipeline_tag = "text-generation"
    results = [EvalResult(**r) for r in eval_results or []]
    card_data = ModelCardData(
        license=license,
        library_name="transformers",
        base_model=base_model,
        datasets=datasets,
        tags=["hf-fixedpoint", "fixed-point", "custom_code", config.model_type],
        pipeline_tag=pipeline_tag,
        model_name=model_id,
        eval_results=results or None,
    )
    fp_settings = [(k, json.dumps(v)) for k, v in sorted(config.to_dict().items()) if k.startswith("fp_")]
    compat = None
    table = support_table(family=config.model_type)
    if table:
        support = json.loads(SUPPORT_FILE.read_text())
        compat = {"table": table, **{k: support[k] for k in ("date", "saved_with", "torch")}}
    return ModelCard.from_template(
        card_data, template_str=_CARD_TEMPLATE, model_id=model_id, description=description,
        model_class=cls.__name__, model_type=config.model_type, auto_class=auto_class, fp_settings=fp_settings,
        results=results, compat=compat,
    )


_make_model_card = model_card  # push_to_hub's `model_card` argument shadows the function


# A recipe's output_dir holds the export and, beside it, what only resuming the training needs: its checkpoints
# (``checkpoints/step_<n>``, or ``step_<n>`` at the top in the FPSA recipes, and the hidden ``.step_<n>.tmp`` being
# written) and a half-written export stage.
TRAINING_STATE = ["checkpoints/*", "step_*/*", ".step_*/*", ".staging/*"]


def push_to_hub(model, repo_id, *, tokenizer=None, model_card=None, commit_message="Upload model with hf-fixedpoint",
                private=None, token=None, revision=None):
    """Upload a model or an export folder to ``repo_id``.

    ``model`` is a model, exported (merged, folded, verified) into a temporary folder first, or the folder of an
    export (a recipe's ``output_dir``): verified, then uploaded without its training state (``TRAINING_STATE``:
    the resumable ``checkpoints/`` or ``step_<n>/`` with optimizer and RNG states, a half-written ``.staging/``).
    ``model_card`` defaults to ``model_card(model, model_id=repo_id)`` for a model (a folder keeps its README.md);
    ``tokenizer`` (or image processor) is saved next to an exported model. ``revision`` names a branch (created if
    missing). Returns the ``huggingface_hub.CommitInfo`` of the upload.
    """
    if isinstance(model, (str, os.PathLike)):
        if tokenizer is not None or model_card is not None:
            raise ValueError("tokenizer= and model_card= are for a model being exported; an export folder holds its "
                             "own tokenizer or processor (and README.md, if any).")
        verify_self_contained(model)
        return _upload(Path(model), repo_id, commit_message, private, token, revision, TRAINING_STATE)
    card = model_card if model_card is not None else _make_model_card(model, model_id=repo_id)
    with tempfile.TemporaryDirectory(prefix="hf_fixedpoint_push_") as tmp:
        folder = export(model, tmp, model_card=card)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
            verify_self_contained(folder)  # a custom tokenizer adds its own auto_map and code
        return _upload(folder, repo_id, commit_message, private, token, revision, None)


def _upload(folder, repo_id, commit_message, private, token, revision, ignore_patterns):
    from huggingface_hub import HfApi
    from huggingface_hub.errors import OfflineModeIsEnabled

    api = HfApi(token=token)
    try:
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        if revision is not None:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        return api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message=commit_message,
                                 revision=revision, ignore_patterns=ignore_patterns)
    except OfflineModeIsEnabled as err:
        raise OfflineModeIsEnabled(
            f"Cannot push to {repo_id!r}: the Hugging Face Hub client is in offline mode (HF_HUB_OFFLINE=1, or "
            "TRANSFORMERS_OFFLINE=1). Unset HF_HUB_OFFLINE to upload, or save the checkpoint locally with "
            f"hf_fixedpoint.hub.export(model, output_dir) and upload it later with "
            f"hf_fixedpoint.hub.push_to_hub(output_dir, {repo_id!r})."
        ) from err


__all__ = ["TRAINING_STATE", "export", "model_card", "push_to_hub", "verify_self_contained"]
