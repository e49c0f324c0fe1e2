"""Two drafters of one target compared on named prompt sets (context lengths, templates, ...): each
prompt's greedy tau and per-position acceptance at every depth, from one greedy text per prompt
(parity/chains.py), summarized as mean ± standard error over prompts, with the paired difference of
the two drafters (the same prompts, so prompt-to-prompt spread cancels).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from eagle31_export.parity.chains import DepthAcceptance, acceptance_by_depth, greedy_text
from eagle31_export.reference.pair import ReferencePair
from eagle31_export.reference.statistics import per_position_acceptance


@dataclass(frozen=True)
class MeanSe:
    mean: float
    se: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> "MeanSe":
        n = len(values)
        mean = sum(values) / n
        var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else float("nan")
        return cls(mean, math.sqrt(var / n), n)

    def __format__(self, spec: str) -> str:
        return f"{self.mean:{spec or '.3f'}} ± {self.se:.3f}"

    def __str__(self) -> str:
        return format(self)


@dataclass
class SetResult:
    """One prompt set: per drafter, per prompt, the acceptance at each depth."""

    label: str
    prompt_tokens: list[int]
    runs: dict[str, list[dict[int, DepthAcceptance]]] = field(default_factory=dict)

    def tau(self, drafter: str, depth: int) -> MeanSe:
        return MeanSe.of([run[depth].tau for run in self.runs[drafter]])

    def difference(self, first: str, second: str, depth: int) -> MeanSe:
        """Paired tau difference second - first over the set's prompts."""
        return MeanSe.of([b[depth].tau - a[depth].tau for a, b in zip(self.runs[first], self.runs[second])])

    def acceptance(self, drafter: str, depth: int) -> list[float]:
        """Per draft position, accepted rounds over all rounds of all the set's prompts."""
        return per_position_acceptance([a for run in self.runs[drafter] for a in run[depth].accepted_per_step], depth)

    def to_json(self, depths) -> dict:
        return {"label": self.label, "prompts": len(self.prompt_tokens),
                "mean_prompt_tokens": sum(self.prompt_tokens) / len(self.prompt_tokens),
                "tau_per_prompt": {name: {d: [r[d].tau for r in runs] for d in depths}
                                   for name, runs in self.runs.items()},
                "acceptance_pooled": {name: {d: self.acceptance(name, d) for d in depths} for name in self.runs}}


def measure_sets(pairs: dict[str, ReferencePair], prompt_sets: dict[str, list[list[int]]], depths,
                 new_tokens: int, progress: Callable[[str], None] = lambda what: None) -> list[SetResult]:
    """Every drafter of `pairs` (label -> pair over one target) on every prompt set, greedy. Drafters
    tapping the same layers share one greedy text per prompt."""
    results = []
    for label, prompts in prompt_sets.items():
        result = SetResult(label, [len(p) for p in prompts], {name: [] for name in pairs})
        for i, prompt in enumerate(prompts):
            texts: dict[tuple, object] = {}
            for name, pair in pairs.items():
                key = pair.aux_layer_ids
                if key not in texts:
                    texts[key] = greedy_text(pair.target, prompt, new_tokens + max(depths) + 1)
                result.runs[name].append(acceptance_by_depth(pair.drafter.drafter, texts[key], depths, new_tokens))
            progress(f"{label}: prompt {i + 1}/{len(prompts)}")
        results.append(result)
    return results


def plot_sets(results: list[SetResult], depth: int, path, title: str, xlabel: str, log2_x: bool = False) -> None:
    """tau ± standard error of each drafter per set; sets on a log2 axis of their labels' numbers when
    `log2_x` (context lengths), else as categories."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(results[0].runs)
    for j, name in enumerate(names):
        taus = [r.tau(name, depth) for r in results]
        if log2_x:
            xs = [float(r.label) * (1 + 0.02 * (j - (len(names) - 1) / 2)) for r in results]
        else:
            xs = [i + 0.08 * (j - (len(names) - 1) / 2) for i in range(len(results))]
        ax.errorbar(xs, [t.mean for t in taus], yerr=[t.se for t in taus], fmt="o-" if log2_x else "o",
                    capsize=3, label=name)
    if log2_x:
        ax.set_xscale("log", base=2)
        ax.set_xticks([float(r.label) for r in results], [r.label for r in results])
    else:
        ax.set_xticks(range(len(results)), [r.label for r in results], rotation=12, fontsize=8)
    ax.set(xlabel=xlabel, ylabel=f"tau at depth {depth} (mean ± s.e.)", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
