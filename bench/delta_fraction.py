"""How much of a bf16 model changes per optimizer step (docs/benchmarks.md, design.md's delta
pushes): a 4-layer Llama-shaped transformers model (hidden 256, random init) trained with AdamW
(weight decay 0.01) on random tokens, fp32 master weights; after each step, the fraction of the
bf16 copy's elements whose bits differ from the step before: what a delta push sends.

    .venv/bin/python bench/delta_fraction.py [--steps 10] [--lr 1e-6 1e-5]
"""

from __future__ import annotations

import argparse


def fractions(lr: float, steps: int) -> list[float]:
    import torch
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688,
                                      num_hidden_layers=4, num_attention_heads=8,
                                      num_key_value_heads=4)
    model = transformers.LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    before = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    out = []
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, config.vocab_size, (4, 64), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        changed = total = 0
        for n, p in model.named_parameters():
            now = p.detach().to(torch.bfloat16)
            changed += int((now.view(torch.int16) != before[n].view(torch.int16)).sum())
            total += now.numel()
            before[n] = now
        out.append(changed / total)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5])
    args = parser.parse_args()
    for lr in args.lr:
        print(f"lr {lr:g}: " + " ".join(f"{100 * f:.2f}%" for f in fractions(lr, args.steps)))


if __name__ == "__main__":
    main()
