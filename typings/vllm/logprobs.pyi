from abc import ABCMeta

class Logprob:
    logprob: float
    rank: int | None
    decoded_token: str | None

# A MutableSequence of per-position dicts at runtime; genworker reads only the flat lists.
class FlatLogprobs(metaclass=ABCMeta):
    """Position p owns entries [start_indices[p], end_indices[p]), the sampled token first."""

    start_indices: list[int]
    end_indices: list[int]
    token_ids: list[int]
    logprobs: list[float]
    def __len__(self) -> int: ...
