"""Pure compute: paged attention and KV cache operations (no state, nothing of ours imported)."""

__all__ = ["is_power_of_two"]


def is_power_of_two(value: object) -> bool:
    """Whether `value` is a positive integer power of two (1, 2, 4, ...); bools are not."""
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and value > 0
        and not value & (value - 1)
    )
