"""PortionQueue decisions: affinity, stealing, backup tasks, first-result-wins, re-queues on failure."""

import itertools
import random

import pytest

from distbelief.sandblaster.portions import PortionQueue, PortionState


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 1.0
        return self.t


def test_portions_cover_the_batch_exactly():
    q = PortionQueue(100, 16, [0])
    assert [(p.lo, p.hi) for p in q.portions][-2:] == [(80, 96), (96, 100)]
    assert sum(p.size for p in q.portions) == 100 and len(q) == 7


def test_consecutive_portions_go_to_the_same_replica():
    q = PortionQueue(160, 10, [0, 1], backup_tasks=False)  # 16 portions, replicas start at 0 and 8
    got = {0: [], 1: []}
    for _ in range(4):
        for rid in (0, 1):
            got[rid].append(q.next_for(rid).portion_id)
    assert got == {0: [0, 1, 2, 3], 1: [8, 9, 10, 11]}


def test_a_replica_whose_run_is_exhausted_steals_the_back_half_of_the_longest_pending_run():
    q = PortionQueue(100, 10, [0, 1], backup_tasks=False)  # replica 0 starts at 0, replica 1 at 5
    for _ in range(5):
        q.next_for(1)  # replica 1 takes 5..9 and runs out
    assert q.next_for(1).portion_id == 2  # pending run 0..4: take its second half
    assert q.next_for(1).portion_id == 3  # ... and keep walking forward from there
    assert q.next_for(0).portion_id == 0


def test_backups_only_when_nothing_is_pending_and_never_to_the_same_replica():
    q = PortionQueue(30, 10, [0, 1, 2], clock=FakeClock())
    p0, _ = q.next_for(0), q.next_for(1)
    assert q.next_for(2).portion_id == 2 and q.backups_issued == 0
    assert q.result(2, 2) is True
    b = q.next_for(2)  # nothing pending: a backup of the longest-running portion
    assert b.portion_id == p0.portion_id and q.backups_issued == 1
    assert q.next_for(0) is not None and q.backups_issued == 2  # replica 0 backs up portion 1, not its own 0
    assert q.portions[1].running_on == {0, 1}
    assert q.next_for(0) is None  # it already runs every portion with room for a copy


def test_no_backups_when_disabled():
    q = PortionQueue(20, 10, [0, 1, 2], backup_tasks=False)
    q.next_for(0), q.next_for(1)
    assert q.next_for(2) is None


def test_first_result_wins_and_the_duplicate_is_discarded():
    q = PortionQueue(10, 10, [0, 1])
    q.next_for(0)
    q.next_for(1)  # backup
    assert q.result(0, 1) is True  # the backup finished first: it wins
    assert q.result(0, 0) is False and q.duplicates == 1
    assert q.portions[0].winner == 1 and q.won_by(1) == [0]
    q.pushing([0])
    q.committed([0])
    assert q.all_committed()


def test_a_dead_replicas_running_and_unpushed_portions_are_requeued_but_pushed_ones_are_not():
    q = PortionQueue(40, 10, [0, 1], backup_tasks=False)
    a = q.next_for(0).portion_id
    q.result(a, 0)
    b = q.next_for(0).portion_id
    q.result(b, 0)
    q.pushing([b])  # b's gradient has left replica 0
    c = q.next_for(0).portion_id  # running
    d = q.next_for(1).portion_id
    back = q.replica_failed(0)
    assert sorted(back) == sorted([a, c])
    assert q.portions[a].state is PortionState.PENDING and q.portions[c].state is PortionState.PENDING
    assert q.portions[b].state is PortionState.PUSHING and q.portions[d].state is PortionState.RUNNING


def test_won_portion_of_a_dead_winner_stays_running_while_a_backup_computes_it():
    q = PortionQueue(10, 10, [0, 1])
    q.next_for(0)
    q.next_for(1)
    q.result(0, 0)  # 0 wins, 1 still computing its copy
    q.replica_failed(0)
    assert q.portions[0].state is PortionState.RUNNING and q.portions[0].running_on == {1}
    assert q.result(0, 1) is True  # the copy now counts


def test_lost_push_is_computed_again():
    q = PortionQueue(10, 10, [0])
    q.next_for(0)
    q.result(0, 0)
    q.pushing([0])
    q.lost([0])
    assert q.portions[0].state is PortionState.PENDING
    assert q.next_for(0).portion_id == 0


def test_forced_backups_give_every_portion_a_second_copy():
    q = PortionQueue(50, 10, [0, 1], force_backups=True)
    handed = []
    while True:
        moves = [(rid, q.next_for(rid)) for rid in (0, 1)]
        moves = [(rid, p) for rid, p in moves if p is not None]
        if not moves:
            break
        for rid, p in moves:
            handed.append(p.portion_id)
            q.result(p.portion_id, rid)
    assert sorted(handed) == sorted(list(range(5)) * 2)
    assert q.duplicates == 5


@pytest.mark.parametrize("seed", range(20))
def test_random_schedules_commit_every_portion_exactly_once(seed):
    """Random completions, duplicates and failures: each portion ends committed exactly once."""
    rng = random.Random(seed)
    q = PortionQueue(97, 7, [0, 1, 2], force_backups=seed % 2 == 0)
    running: dict[int, int | None] = {0: None, 1: None, 2: None}
    held: dict[int, list[int]] = {0: [], 1: [], 2: []}  # won, not yet pushed
    commits = []
    next_id = itertools.count(3)
    for _ in range(10_000):
        if q.all_committed():
            break
        for rid in list(running):
            if running[rid] is None:
                p = q.next_for(rid)
                running[rid] = None if p is None else p.portion_id
        rid = rng.choice(list(running))
        event = rng.random()
        if event < 0.03:  # the replica dies; a new one replaces it
            q.replica_failed(rid)
            del running[rid], held[rid]
            new = next(next_id)
            running[new], held[new] = None, []
            q.add_replica(new)
        elif event < 0.2 and held[rid]:  # push what it holds
            q.pushing(held[rid])
            q.committed(held[rid])
            commits += held[rid]
            held[rid] = []
        elif running[rid] is not None:
            if q.result(running[rid], rid):
                held[rid].append(running[rid])
            running[rid] = None
        elif held[rid]:
            q.pushing(held[rid])
            q.committed(held[rid])
            commits += held[rid]
            held[rid] = []
    assert q.all_committed()
    assert sorted(commits) == list(range(len(q)))
