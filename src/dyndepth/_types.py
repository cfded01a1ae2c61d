"""Names shared by the public functions: the strategy vocabulary, defined once."""

from __future__ import annotations

from typing import Literal, get_args

Strategy = Literal["auto", "masked", "while", "checkpointed"]
STRATEGIES: tuple[str, ...] = get_args(Strategy)
