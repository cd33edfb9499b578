"""Seeds a user may give: whole numbers from 0 to 2^63 - 1, what every generator symfuse seeds accepts.

torch's generators take seeds below 2^64 and Python's ``random`` any integer; a seed derived from a user's seed
(several streams from one seed) is reduced modulo 2^64 where it may grow past that (:func:`torch_seed`).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

MAX_SEED = 2**63 - 1

Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]


def seed_problem(value: int) -> str | None:
    """Why ``value`` cannot be a seed (outside 0 .. 2^63 - 1), else None."""
    if 0 <= value <= MAX_SEED:
        return None
    return f"{value} is not a seed — give a whole number from 0 to 2^63 - 1 ({MAX_SEED}), e.g. 13"


def torch_seed(value: int) -> int:
    """A derived seed as torch's generators take it (below 2^64); seeds that are already there are unchanged."""
    return value % (1 << 64)
