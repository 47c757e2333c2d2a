"""File-access traces for the dataset cache's policy and pattern tests (pure), and a
simulated cache that replays one through a policy object with no I/O."""

from __future__ import annotations

import random

from metalguard.agent.cache.policy import AutoPolicy, LruPolicy, PinPolicy


def dataset(n: int, rng: random.Random, lo: int = 100, hi: int = 1000) -> dict[str, int]:
    """``n`` files ``train/000000``... with sizes in [lo, hi]."""
    return {f"train/{i:06d}": rng.randint(lo, hi) for i in range(n)}


def shuffled_epochs(keys: list[str], epochs: int, rng: random.Random) -> list[str]:
    """Every key once per epoch, each epoch a fresh shuffle."""
    order = list(keys)
    trace: list[str] = []
    for _ in range(epochs):
        rng.shuffle(order)
        trace.extend(order)
    return trace


def sequential_epochs(keys: list[str], epochs: int) -> list[str]:
    """Every key once per epoch, in name order."""
    return sorted(keys) * epochs


def skewed(
    keys: list[str], n: int, rng: random.Random, hot: float = 0.1, share: float = 0.9
) -> list[str]:
    """``n`` accesses: ``share`` of them to the first ``hot`` fraction of the keys."""
    k = max(1, int(len(keys) * hot))
    hot_keys, cold_keys = keys[:k], keys[k:]
    return [
        rng.choice(hot_keys) if rng.random() < share else rng.choice(cold_keys) for _ in range(n)
    ]


class Simulated:
    """A cache of ``capacity`` bytes driven by a policy the way CacheStore drives it."""

    def __init__(self, policy: LruPolicy | PinPolicy | AutoPolicy, capacity: int) -> None:
        self.policy = policy
        self.capacity = capacity
        self.resident: dict[str, int] = {}
        self.used = 0
        self.evictions = 0

    def access(self, key: str, size: int) -> bool:
        """One access; True for a hit."""
        hit = key in self.resident
        self.policy.access(key, size, hit)
        if hit:
            return True
        victims = self.policy.make_room(key, size, self.used + size - self.capacity)
        if victims is None:
            return False
        for victim in victims:
            self.used -= self.resident.pop(victim)
            self.evictions += 1
        assert self.used + size <= self.capacity, "the policy freed too little"
        self.resident[key] = size
        self.used += size
        self.policy.insert(key, size)
        return False

    def replay(self, trace: list[str], sizes: dict[str, int]) -> list[bool]:
        """Hits of each access of ``trace``."""
        return [self.access(key, sizes[key]) for key in trace]
