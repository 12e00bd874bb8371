"""PEFT's greedy tokens for the live adapter tests, run in the main venv (PEFT and transformers;
no vLLM): ``python peft_reference.py SPEC.json`` with SPEC {"base": dir, "adapters": {key: dir},
"prompts": [[ids]], "new_tokens": n, "out": path}; writes {key: tokens} ("base": no adapter)."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    import peft
    import torch
    import transformers

    import toy
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    out = {}
    base = transformers.AutoModelForCausalLM.from_pretrained(spec["base"], dtype=torch.float32)
    out["base"] = toy._generate(base, spec["prompts"], spec["new_tokens"])
    for key, directory in spec["adapters"].items():
        model = transformers.AutoModelForCausalLM.from_pretrained(spec["base"],
                                                                  dtype=torch.float32)
        adapted = peft.PeftModel.from_pretrained(model, directory)
        out[key] = toy._generate(adapted, spec["prompts"], spec["new_tokens"])
    with open(spec["out"], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
