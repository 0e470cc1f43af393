"""Balance of sorted_greedy (torch's partition) and flat for GPT-2 small at 2, 8 and 64 ranks.

Run: ``python benchmarks/partition_report.py``.
"""

from __future__ import annotations

from zero_functional.partition import balance_report, flat, sorted_greedy


def gpt2_small_numels() -> list[int]:
    """Parameter sizes of GPT-2 small (124M) in ``named_parameters()`` order, wte tied to lm_head."""
    d, vocab, ctx, layers = 768, 50257, 1024, 12
    numels = [vocab * d, ctx * d]  # wte (shared with lm_head), wpe
    for _ in range(layers):
        numels += [d, d]  # ln_1 weight, bias
        numels += [d * 3 * d, 3 * d]  # attn.c_attn weight, bias
        numels += [d * d, d]  # attn.c_proj weight, bias
        numels += [d, d]  # ln_2 weight, bias
        numels += [d * 4 * d, 4 * d]  # mlp.c_fc weight, bias
        numels += [4 * d * d, d]  # mlp.c_proj weight, bias
    numels += [d, d]  # ln_f weight, bias
    return numels


def main() -> None:
    numels = gpt2_small_numels()
    print(
        f"GPT-2 small: {len(numels)} parameters, {sum(numels):,} elements, largest {max(numels):,}"
    )
    for world_size in (2, 8, 64):
        for label, part in (
            ("sorted_greedy", sorted_greedy(numels, world_size)),
            ("flat", flat(numels, world_size)),
        ):
            print(f"{label:>13}: {balance_report(numels, part)}")


if __name__ == "__main__":
    main()
