"""The C++ ops' helper team (kernels/csrc/team.h), through its probe: every index of a step runs exactly once, on
the caller or a helper; errors reach the caller; steps inside a step stay on their thread; two threads' calls at
once, and a forked child, each get whole answers."""

import multiprocessing
import threading

import pytest
import torch

from silverrec.kernels.library import host

EXT = host()


@pytest.fixture
def pin():
    yield EXT.set_team_pin
    EXT.set_team_pin(-1)


@pytest.mark.parametrize("n, grain", [(1, 1), (2, 1), (7, 3), (100, 1), (1000, 64), (4097, 1)])
def test_every_index_runs_once(n, grain, pin):
    for mode in (-1, 1, 2):  # as the policy says, the team, OpenMP
        pin(mode)
        assert set(EXT.team_probe(n, grain)) <= set(range(torch.get_num_threads())), mode
    pin(0)
    assert EXT.team_probe(n, grain) == [0] * n


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one intra-op thread: the team has no helpers")
def test_a_shared_step_runs_on_a_helper(pin):
    pin(1)  # each step waits until a helper has taken a chunk (the caller takes the rest, if any is left)
    ran = EXT.team_probe(64, 1)
    assert -1 not in ran and -2 not in ran
    assert any(r >= 1 for r in ran), ran


@pytest.mark.parametrize("mode", [-1, 0, 1, 2])
def test_an_error_in_any_chunk_reaches_the_caller(mode, pin):
    pin(mode)
    for at in (0, 31, 63):
        with pytest.raises(ValueError, match=f"index {at}"):
            EXT.team_probe(64, 1, at)
    assert EXT.team_probe(64, 1) != []  # the team still answers after errors


@pytest.mark.parametrize("mode", [1, 2])
def test_two_threads_at_once_each_get_every_index(mode, pin):
    pin(mode)
    results, errors = [], []

    def run():
        try:
            for _ in range(200):
                ran = EXT.team_probe(256, 1)
                results.append(-1 not in ran and -2 not in ran and len(ran) == 256)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and len(results) == 400 and all(results)


def _child(queue):
    EXT.set_team_pin(1)
    ran = EXT.team_probe(512, 1)
    queue.put(-1 not in ran and -2 not in ran)


def test_a_forked_child_gets_its_own_team(pin):
    pin(1)
    EXT.team_probe(512, 1)  # the parent's helpers are running
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child, args=(queue,))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0 and queue.get(timeout=5) is True
