#!/usr/bin/env python3
"""Write src/reshard/hf/tp_plans.json: the tensor-parallel plans of the installed transformers.

    .venv/bin/python scripts/gen_tp_plans.py [-o PATH] [--check]

The degree planner and the model-map generator (src/reshard/hf) read this file, compiled into
the binary, instead of importing transformers. It records, from the installed package:

  transformers_version     the release it was read from
  load_renames             the renamings transformers applies to every model at load (legacy)
  input_embedding          the entry transformers adds to a base model's plan for its input
                           embedding ({"module", "style", "applies": "always" | "tied"}), found
                           by building a small model on the meta device and reading its plan
  styles                   every style name registered in transformers' parallel-style registry
                           (a plan entry naming anything else fails at load in transformers)
  distributed_config_keys  the fields of transformers' DistributedConfig (the dict form it accepts)
  model_types              per model type with a plan of its own or through its text sub-config:
    tp_plan, ep_plan       the config class's base_model_tp_plan / base_model_ep_plan, in order
    head_plan              the plan the task head class adds (the LM head): the class's
                           `_tp_plan` attribute, inherited ones included
    attribute_map          the config's aliases (standard name -> key stored in config.json)
    defaults               the config class's defaults for the keys the counts need
    text_config            {"key", "model_type"} of the text sub-config of a composite model
    embed_tokens           true when the model type's base model holds an nn.Embedding named
                           `embed_tokens` (read from its __init__ source), the module the
                           input-embedding entry names
    load_renames           the checkpoint renamings transformers applies at load, in order, as
                           ECMAScript regular expressions: {"pattern", "replacement"}
    load_conversions       the checkpoint conversions transformers applies at load (tensors
                           merged, split or permuted): {"sources", "target", "operations"}

--check compares a fresh generation with the file and exits 1 on any difference (drift after a
transformers upgrade: regenerate and commit).
"""

import argparse
import ast
import dataclasses
import json
import pathlib
import re
import sys

import transformers
from transformers.models.auto import configuration_auto, modeling_auto

REPO = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "src" / "reshard" / "hf" / "tp_plans.json"

# The config keys the divisibility counts are read from (standard names; attribute_map aliases
# are resolved by the reader).
COUNT_KEYS = (
    "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "intermediate_size_mlp", "moe_intermediate_size",
    "shared_expert_intermediate_size", "n_shared_experts", "num_experts", "num_local_experts",
    "n_routed_experts", "tie_word_embeddings", "num_shared_experts", "moe_num_shared_experts",
    "moe_shared_expert_intermediate_size",
)

# Head classes whose `_tp_plan` is the LM head's entry, most specific first.
HEAD_MAPPINGS = (
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES",
)


def registered_styles():
    from transformers.distributed import expert_parallel, tensor_parallel  # noqa: F401 (registers)
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
    return sorted(ALL_PARALLEL_STYLES.keys())


def distributed_config_keys():
    from transformers.distributed.configuration_utils import DistributedConfig
    return [f.name for f in dataclasses.fields(DistributedConfig)]


def input_embedding_rule():
    """The entry transformers adds for the input embedding, and when: built on the meta device."""
    import torch
    from transformers import LlamaConfig, LlamaModel
    found = {}
    for tied in (False, True):
        config = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=2,
                             tie_word_embeddings=tied)
        with torch.device("meta"):
            model = LlamaModel(config)
        plan = dict(model.tp_plan or {})
        found[tied] = plan.get("embed_tokens")
    if found[False]:
        return {"module": "embed_tokens", "style": found[False], "applies": "always"}
    if found[True]:
        return {"module": "embed_tokens", "style": found[True], "applies": "tied"}
    return None


def has_embed_tokens(model_type):
    """Whether the base model's __init__ assigns an nn.Embedding (or a subclass) to embed_tokens."""
    import importlib
    import inspect
    import textwrap
    import torch
    name = modeling_auto.MODEL_MAPPING_NAMES.get(model_type)
    if isinstance(name, (tuple, list)):
        name = name[0] if name else None
    if not name:
        return False
    try:
        cls = getattr(transformers, name)
        init = next(c.__dict__["__init__"] for c in cls.__mro__ if "__init__" in c.__dict__)
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        namespace = vars(importlib.import_module(init.__module__))
    except Exception:  # a model whose module or source cannot be read: no claim
        return False
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
            continue
        if not any(isinstance(t, ast.Attribute) and t.attr == "embed_tokens"
                   and isinstance(t.value, ast.Name) and t.value.id == "self" for t in node.targets):
            continue
        try:
            callee = eval(compile(ast.Expression(node.value.func), "<callee>", "eval"), namespace)
        except Exception:
            continue
        if isinstance(callee, type) and issubclass(callee, torch.nn.Embedding):
            return True
    return False


def checkpoint_transforms(model_type):
    """The weight transforms transformers applies when it loads the model type's causal-LM class
    (its class-name mapping first, else the model type's); the legacy ones, which follow them
    for every model, are recorded once at the top level."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    transforms = None
    name = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if isinstance(name, (tuple, list)):
        name = name[0] if name else None
    if name:
        transforms = get_checkpoint_conversion_mapping(name)
    if transforms is None:
        transforms = get_checkpoint_conversion_mapping(model_type)
    return transforms or []


def load_conversions(transforms):
    """The WeightConverter entries: tensors merged, split or permuted at load."""
    from transformers.core_model_loading import WeightConverter
    out = []
    for c in transforms:
        if not isinstance(c, WeightConverter):
            continue
        out.append({"sources": list(c.source_patterns), "target": ", ".join(c.target_patterns),
                    "operations": [type(op).__name__ for op in c.operations]})
    return out


def load_renames(transforms):
    """The plain renamings, as ECMAScript regular expressions and replacements, built the way
    transformers builds its own (`*.` spans any run, a pattern ending in a word character ends
    at a name boundary; `\\1` in a target is the first group). Patterns using Python-only
    syntax are left out."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming
    out = []
    for c in transforms:
        if not isinstance(c, WeightRenaming) or isinstance(c, WeightConverter):
            continue
        replacement = re.sub(r"\\(\d)", r"$\1", c.target_patterns[0])
        for source in c.source_patterns:
            pattern = source.replace("*.", r".*\.")
            if re.search(r"[a-zA-Z0-9]$", pattern):
                pattern += r"(?!\w)"
            if "(?P" in pattern or "(?<" in pattern or "(?i" in pattern:
                continue
            out.append({"pattern": pattern, "replacement": replacement})
    return out


def class_default(cls, stored_key):
    value = getattr(cls, stored_key, None)
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value
    return None  # a property, a descriptor or a non-integer: no usable default


def head_class_plan(model_type, models_dir):
    """The `_tp_plan` of the model type's LM-head class (as a class attribute, inherited ones
    included; from its source when the class cannot be imported)."""
    for mapping_name in HEAD_MAPPINGS:
        mapping = getattr(modeling_auto, mapping_name, {})
        name = mapping.get(model_type)
        if isinstance(name, (tuple, list)):
            name = name[0] if name else None
        if not name:
            continue
        try:  # the class attribute transformers reads, inherited or not
            plan = getattr(getattr(transformers, name), "_tp_plan", None)
            return dict(plan) if plan else None
        except Exception:  # not importable here: read the literal from the source
            pass
        module = configuration_auto.model_type_to_module_name(model_type)
        for path in sorted((models_dir / module).glob("modeling_*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in tree.body:
                if isinstance(node, ast.ClassDef) and node.name == name:
                    for stmt in node.body:
                        targets = (stmt.targets if isinstance(stmt, ast.Assign)
                                   else [stmt.target] if isinstance(stmt, ast.AnnAssign) else [])
                        if any(isinstance(t, ast.Name) and t.id == "_tp_plan" for t in targets):
                            plan = ast.literal_eval(stmt.value)
                            return dict(plan) if plan else None
                    return None
    return None


def text_sub_config(cls):
    """(key, model_type) of a composite config's text sub-config, or None."""
    subs = dict(getattr(cls, "sub_configs", None) or {})
    if not subs:
        return None
    try:
        config = cls()
        text = config.get_text_config()
    except Exception:  # a composite that cannot be built from defaults alone
        text = None
    if text is not None and text is not config:
        for key in subs:
            if getattr(config, key, None) is text:
                return key, text.model_type
    for key in ("text_config", "language_config", "llm_config"):
        if key in subs and getattr(subs[key], "model_type", ""):
            return key, subs[key].model_type
    return None


def generate():
    models_dir = pathlib.Path(transformers.__file__).parent / "models"
    entries = {}
    composites = {}
    for model_type in sorted(configuration_auto.CONFIG_MAPPING_NAMES):
        cls = configuration_auto.CONFIG_MAPPING[model_type]
        tp_plan = getattr(cls, "base_model_tp_plan", None) or {}
        ep_plan = getattr(cls, "base_model_ep_plan", None) or {}
        entry = {}
        if tp_plan:
            entry["tp_plan"] = dict(tp_plan)
        if ep_plan:
            entry["ep_plan"] = dict(ep_plan)
        head = head_class_plan(model_type, models_dir)
        if head:
            entry["head_plan"] = head
        attribute_map = dict(getattr(cls, "attribute_map", None) or {})
        aliases = {k: v for k, v in attribute_map.items() if k in COUNT_KEYS}
        if aliases:
            entry["attribute_map"] = aliases
        entry["defaults"] = {k: class_default(cls, attribute_map.get(k, k)) for k in COUNT_KEYS
                             if hasattr(cls, attribute_map.get(k, k))}
        sub = text_sub_config(cls)
        if sub and sub[1] != model_type:
            entry["text_config"] = {"key": sub[0], "model_type": sub[1]}
            composites[model_type] = sub[1]
        entries[model_type] = entry
    with_plan = {mt for mt, e in entries.items() if "tp_plan" in e or "ep_plan" in e}
    keep = set(with_plan)
    keep |= {mt for mt, text in composites.items() if text in with_plan}
    model_types = {mt: entries[mt] for mt in sorted(keep)}
    for mt, entry in model_types.items():
        if "tp_plan" in entry and has_embed_tokens(mt):
            entry["embed_tokens"] = True
        transforms = checkpoint_transforms(mt)
        renames = load_renames(transforms)
        if renames:
            entry["load_renames"] = renames
        conversions = load_conversions(transforms)
        if conversions:
            entry["load_conversions"] = conversions
    registry = {
        "generator": "scripts/gen_tp_plans.py",
        "transformers_version": transformers.__version__,
    }
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    legacy = load_renames(get_checkpoint_conversion_mapping("legacy") or [])
    if legacy:
        registry["load_renames"] = legacy
    rule = input_embedding_rule()
    if rule:
        registry["input_embedding"] = rule
    return {
        **registry,
        "styles": registered_styles(),
        "distributed_config_keys": distributed_config_keys(),
        "model_types": model_types,
    }


def dump(registry):
    return json.dumps(registry, indent=1, sort_keys=False, ensure_ascii=True) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", type=pathlib.Path, default=DEFAULT_OUT)
    parser.add_argument("--check", action="store_true",
                        help="compare with the file instead of writing it; exit 1 on drift")
    args = parser.parse_args()
    text = dump(generate())
    if args.check:
        old = args.output.read_text(encoding="utf-8") if args.output.exists() else ""
        if old != text:
            print(f"{args.output} is out of date for transformers {transformers.__version__}: "
                  f"run scripts/gen_tp_plans.py and commit the result", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text, encoding="utf-8")
    reg = json.loads(text)
    print(f"wrote {args.output}: transformers {reg['transformers_version']}, "
          f"{len(reg['model_types'])} model types, {len(reg['styles'])} styles")
    return 0


if __name__ == "__main__":
    sys.exit(main())
