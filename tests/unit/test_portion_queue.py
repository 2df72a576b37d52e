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
    assert q.next_for(0).portion_id == 1 and q.backups_issued == 2  # replica 0 backs up portion 1, not its 0
    assert q.portions[1].running_on == {0, 1}
    assert q.next_for(0) is None  # it already runs every portion with room for a copy


def test_no_backups_when_disabled():
    q = PortionQueue(20, 10, [0, 1, 2], backup_tasks=False)
    q.next_for(0), q.next_for(1)
    assert q.next_for(2) is None


def test_a_result_held_by_a_busy_straggler_is_backed_up():
    q = PortionQueue(20, 10, [0, 1])
    q.next_for(0), q.next_for(1)
    q.result(1, 1)  # replica 1 holds portion 1 ...
    q.next_for(1)  # ... and is busy with a backup of portion 0
    q.result(0, 0)
    # Replica 0 pushes portion 0; portion 1 sits in busy replica 1: replica 0 may compute it again.
    assert q.claim(0) == ([0], [])
    assert q.next_for(0, busy={1}).portion_id == 1
    assert q.next_for(0, busy=set()) is None  # were replica 1 idle, its own push would be awaited instead


def test_claims_are_exclusive_and_the_other_copies_are_dropped():
    q = PortionQueue(10, 10, [0, 1])
    q.next_for(0)
    q.next_for(1)  # backup
    assert q.result(0, 1) is True  # the backup finished first
    assert q.result(0, 0) is False and q.duplicates == 1
    assert q.held_by(0) == [0] and q.held_by(1) == [0] and q.claimable(0) == 1
    assert q.claim(1) == ([0], [])  # whoever pushes first carries it
    assert q.claimable(0) == 0 and q.portions[0].state is PortionState.PUSHING
    assert q.claim(0) == ([], [0])  # replica 0's copy is dropped
    q.committed([0])
    assert q.all_committed()


def test_release_names_copies_claimed_elsewhere():
    q = PortionQueue(10, 10, [0, 1], force_backups=True)
    q.next_for(0), q.next_for(1)
    q.result(0, 0), q.result(0, 1)
    q.claim(0)
    assert q.release(1) == [0] and q.held_by(1) == []


def test_a_dead_replicas_running_and_held_portions_are_requeued_but_claimed_ones_are_not():
    q = PortionQueue(50, 10, [0, 1], backup_tasks=False)
    e = q.next_for(1).portion_id
    a = q.next_for(0).portion_id
    q.result(a, 0)
    b = q.next_for(0).portion_id
    q.result(b, 0)
    q.claim(0)  # a and b are on their way to the shards
    c = q.next_for(0).portion_id
    q.result(c, 0)  # held
    d = q.next_for(0).portion_id  # running
    back = q.replica_failed(0)
    assert sorted(back) == sorted([c, d])
    assert q.portions[a].state is PortionState.PUSHING and q.portions[b].state is PortionState.PUSHING
    assert q.portions[e].state is PortionState.RUNNING


def test_held_portion_of_a_dead_replica_stays_running_while_a_backup_computes_it():
    q = PortionQueue(10, 10, [0, 1])
    q.next_for(0)
    q.next_for(1)
    q.result(0, 0)  # 0 holds it, 1 still computing its copy
    q.replica_failed(0)
    assert q.portions[0].state is PortionState.RUNNING and q.portions[0].running_on == {1}
    q.result(0, 1)
    assert q.claim(1) == ([0], [])


def test_lost_push_falls_back_to_another_copy_or_is_computed_again():
    q = PortionQueue(20, 10, [0, 1], force_backups=True)
    q.next_for(0), q.next_for(1)
    for rid in (0, 1):
        q.result(0, rid)
    q.claim(0)
    q.lost([0])
    assert q.portions[0].state is PortionState.HELD and q.claim(1) == ([0], [])
    q.lost([0])
    assert q.portions[0].state is PortionState.PENDING


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
    """Random completions, pushes, duplicates, lost pushes and failures: each portion is committed once."""
    rng = random.Random(seed)
    q = PortionQueue(97, 7, [0, 1, 2], force_backups=seed % 2 == 0)
    running: dict[int, int | None] = {0: None, 1: None, 2: None}
    commits = []
    next_id = itertools.count(3)
    for _ in range(20_000):
        if q.all_committed():
            break
        busy = {r for r, p in running.items() if p is not None}
        for rid in list(running):
            if running[rid] is None and not q.claimable(rid):
                p = q.next_for(rid, busy)
                running[rid] = None if p is None else p.portion_id
        rid = rng.choice(list(running))
        event = rng.random()
        if event < 0.03:  # the replica dies; a new one replaces it
            q.replica_failed(rid)
            del running[rid]
            new = next(next_id)
            running[new] = None
            q.add_replica(new)
        elif running[rid] is not None and event < 0.7:
            q.result(running[rid], rid)
            running[rid] = None
        elif running[rid] is None and q.claimable(rid):
            include, _ = q.claim(rid)
            if event < 0.8:  # the push is lost on its way
                q.lost(include)
            else:
                q.committed(include)
                commits += include
    assert q.all_committed()
    assert sorted(commits) == list(range(len(q)))
