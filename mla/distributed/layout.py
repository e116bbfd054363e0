"""Where each token of a request lives under decode context parallelism (vLLM's layout)."""

from __future__ import annotations

import attrs
import torch

from mla.core.errors import InvalidInputError


@attrs.frozen
class DCPLayout:
    """Where each token of a request lives: rank ``(p // I) % W`` at ``(p // (I*W)) * I + p % I``.

    The functions take int64 tensors (host or device) and return int64 tensors of the same shape.
    """

    world_size: int
    rank: int
    interleave: int = 1

    def __attrs_post_init__(self) -> None:
        if self.world_size < 1:
            raise InvalidInputError("world_size", f"must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise InvalidInputError("rank", f"must be in [0, {self.world_size}), got {self.rank}")
        if self.interleave < 1:
            raise InvalidInputError("interleave", f"must be >= 1, got {self.interleave}")

    @property
    def stripe(self) -> int:
        """Tokens in one round over the group (``I * W``)."""
        return self.interleave * self.world_size

    def owner(self, positions: torch.Tensor) -> torch.Tensor:
        """Rank holding each global position."""
        return (positions // self.interleave) % self.world_size

    def local_position(self, positions: torch.Tensor) -> torch.Tensor:
        """Position of each global position inside its owner's cache."""
        return (positions // self.stripe) * self.interleave + positions % self.interleave

    def global_position(self, local: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """The global position of each local position of ``rank``'s cache (default: this rank;
        the inverse of :meth:`local_position`)."""
        rank = self.rank if rank is None else rank
        return (local // self.interleave) * self.stripe + rank * self.interleave + local % self.interleave

    def local_length(self, lengths: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """Tokens of positions ``0 .. length-1`` that ``rank`` (default: this rank) holds."""
        rank = self.rank if rank is None else rank
        rounds = lengths // self.stripe
        rest = lengths - rounds * self.stripe
        return rounds * self.interleave + torch.clamp(rest - rank * self.interleave, 0, self.interleave)

    def max_local_length(self, length: int) -> int:
        """The most tokens of a ``length``-token request any rank holds (rank 0's share)."""
        return int(self.local_length(torch.tensor(length), 0))
