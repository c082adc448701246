"""A two-rank process group per pair of a pipeline's ranks, for the executor's messages.

Why not the pipeline's own group: NCCL runs every operation of a communicator on one stream, in
posting order, and ``batch_isend_irecv`` returns one work for its whole batch. With all of a
pipeline's messages on one communicator, a stage's wait for a gradient from the next rank queues
behind an activation still on its way from the previous rank. A group per pair keeps each pair's
messages in one order (the lowering guarantees the same order on both sides per pair, and checks
it on simulated per-pair in-order queues) and lets different peers' messages run side by side.

Cost: a communicator per other rank of the pipeline (DIP's separated layout sends to all of
them; the co-located layout uses two). Groups are made once per process and pair with local
synchronisation (only the two ranks meet), in the rounds of a round-robin tournament: in every
round each rank makes exactly one group (a rank without a partner, in pipelines of odd size, makes
one of itself). torch names such groups by their ranks and the number of groups the rank already
holds, so the two members of a pair must hold equally many: equal rounds keep them equal, where
making each rank's pairs in sorted order does not (measured: a hang at the second pair).
"""

from __future__ import annotations

from datetime import timedelta
from itertools import combinations

import torch.distributed as dist

_MADE: dict[tuple[int, int, int], dist.ProcessGroup] = {}


class PeerGroups:
    """``of(peer)``: the group this rank shares with ``peer`` (a rank of ``group``, the pipeline;
    default: the world) and the peer's rank in it. ``make()`` creates the groups; every rank of the
    pipeline must call it at the same point (the executor does, right after a step's consistency
    check)."""

    def __init__(self, group=None, *, timeout: timedelta | None = None):
        self.group, self.timeout = group, timeout
        self._peers: dict[int, tuple[dist.ProcessGroup, int]] | None = None

    def make(self) -> None:
        if self._peers is not None:
            return
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None else list(range(dist.get_world_size()))
        me, world = ranks.index(dist.get_rank()), id(dist.group.WORLD)
        self._peers = {}
        for pairs in round_robin(len(ranks)):
            peer = next(b if a == me else a for a, b in pairs if me in (a, b))
            members = sorted(ranks[k] for k in (me, peer) if k is not None)
            key = (world, *members)
            if key not in _MADE:
                _MADE[key] = dist.new_group(members, timeout=self.timeout, use_local_synchronization=True)
            if peer is not None:
                self._peers[peer] = (_MADE[key], members.index(ranks[peer]))

    def of(self, peer: int) -> tuple[dist.ProcessGroup, int]:
        return self._peers[peer]


def round_robin(n: int) -> list[list[tuple[int | None, int | None]]]:
    """Rounds in which every pair of ``range(n)`` meets once, each index once per round (``None``:
    no partner this round, for odd ``n``): the circle method."""
    ids: list[int | None] = [*range(n), *([None] if n % 2 else [])]
    rounds = []
    for _ in range(len(ids) - 1):
        rounds.append([(ids[i], ids[-1 - i]) for i in range(len(ids) // 2)])
        ids = [ids[0], ids[-1], *ids[1:-1]]
    return rounds
