"""Random inputs of the state ops and mixed steps over them, shared by the reference and kernel tests.

A *step* is several sequences' tokens flattened into one T dimension: a sequence may start (context
0), continue a prefill chunk, or decode one token, each with its own state slot; padding sequences
(slot -1, no tokens) and padding tokens (no sequence) as in a padded CUDA-graph step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autodeploy.ops import state_reference as ref


@dataclass(frozen=True)
class Shapes:
    heads: int = 4
    groups: int = 2  # SSM groups / delta-rule key heads
    head_dim: int = 8  # P (SSM) / V (delta)
    state: int = 16  # N (SSM) / K (delta)
    channels: int = 24  # conv channels
    kernel: int = 4


def ssm_inputs(length: int, s: Shapes, gen: torch.Generator, dtype=torch.float32) -> dict:
    return {
        "x": torch.randn(length, s.heads, s.head_dim, generator=gen).to(dtype),
        "dt": torch.nn.functional.softplus(torch.randn(length, s.heads, generator=gen)).to(dtype),
        "A": -torch.rand(s.heads, generator=gen) * 2 - 0.1,
        "B": torch.randn(length, s.groups, s.state, generator=gen).to(dtype),
        "C": torch.randn(length, s.groups, s.state, generator=gen).to(dtype),
    }


def delta_inputs(length: int, s: Shapes, gen: torch.Generator, dtype=torch.float32) -> dict:
    q = torch.nn.functional.normalize(torch.randn(length, s.groups, s.state, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(length, s.groups, s.state, generator=gen), dim=-1)
    return {
        "q": (q * s.state**-0.5).to(dtype),
        "k": k.to(dtype),
        "v": torch.randn(length, s.heads, s.head_dim, generator=gen).to(dtype),
        "g": -torch.rand(length, s.heads, generator=gen).to(dtype),
        "beta": torch.rand(length, s.heads, generator=gen).to(dtype),
    }


def conv_inputs(length: int, s: Shapes, gen: torch.Generator, dtype=torch.float32) -> dict:
    return {"x": torch.randn(length, s.channels, generator=gen).to(dtype)}


def conv_params(s: Shapes, gen: torch.Generator, dtype=torch.float32) -> dict:
    return {"weight": torch.randn(s.channels, s.kernel, generator=gen).to(dtype),
            "bias": torch.randn(s.channels, generator=gen).to(dtype)}


@dataclass(frozen=True)
class Step:
    """One step: per sequence (slot, context length, tokens in this step); ``pad_tokens`` trailing
    tokens of no sequence; ``pad_seqs`` trailing sequences with no tokens."""

    seqs: tuple[tuple[int, int, int], ...]
    pad_tokens: int = 0
    pad_seqs: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(n for _, _, n in self.seqs) + self.pad_tokens

    def metadata(self, device="cpu") -> dict[str, torch.Tensor]:
        lens = [n for _, _, n in self.seqs] + [0] * self.pad_seqs
        cu = torch.tensor([0] + lens).cumsum(0)
        return {
            "state_slots": torch.tensor([s for s, _, _ in self.seqs] + [-1] * self.pad_seqs, device=device),
            "cu_seqlens": cu.to(device),
            "context_lens": torch.tensor([c for _, c, _ in self.seqs] + [0] * self.pad_seqs, device=device),
        }


def split_rows(inputs: dict, step: Step) -> list[dict]:
    """The per-sequence rows of flattened ``inputs`` (token-shaped tensors only)."""
    out, start = [], 0
    for _, _, n in step.seqs:
        out.append({k: v[start : start + n] for k, v in inputs.items()})
        start += n
    return out


REFERENCE = {"ssm": ref.ssm_recurrent, "delta": ref.delta_recurrent}
