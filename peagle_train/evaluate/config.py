"""``EvalConfig``: what ``peagle-eval`` measures and on how much (docs/design.md §9)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """What ``peagle-eval`` measures and on how much."""

    max_new_tokens: int = 128
    """Most tokens generated per prompt turn (--max-new-tokens)."""
    num_prompts: int | None = None
    """Prompts read from the file, from the top; None = all (--num-prompts)."""
    num_draft_tokens: int | None = None
    """K drafts per verifier step; None = the drafter's num_depths (--num-draft-tokens)."""
    max_blocks: int | None = None
    """Offline: most validation blocks scored; None = all."""
    chunk_anchors: int = 256
    """Offline: anchors whose chains run through the drafter at once (bounds memory)."""
    warmup: bool = True
    """Online: one short untimed generation first, so one-time costs do not count in tokens/s."""
    temperature: float = 0.0
    """Online: 0 = greedy (checked token for token); T > 0 = sampling at T, with rejection sampling (--temperature)."""
    seed: int = 0
    """Online, T > 0: prompt turn i samples with generators seeded ``(seed, i)`` (--seed)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if self.num_draft_tokens is not None and self.num_draft_tokens < 1:
            raise ValueError(f"--num-draft-tokens must be >= 1, got {self.num_draft_tokens}")
        if self.max_blocks is not None and self.max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {self.max_blocks}")
        if self.chunk_anchors < 1:
            raise ValueError(f"chunk_anchors must be >= 1, got {self.chunk_anchors}")
        if not self.temperature >= 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
