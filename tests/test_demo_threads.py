"""``mmgrpo demo`` runs its warm start and evaluations alone in its own process, before and after GRPO's
processes: those stages take the cores the GRPO processes will take, unless the user chose the threads."""

from __future__ import annotations

import pytest


@pytest.fixture
def torch_threads(monkeypatch):
    import torch

    import mmgrpo.train.threads as threads

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(threads, "cpu_cores", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    yield torch
    torch.set_num_threads(before)


def test_the_demos_alone_stages_use_the_cores_of_its_grpo_processes(torch_threads, capsys):
    from mmgrpo.cli.demo import _threads_for_alone_stages

    _threads_for_alone_stages(None, 2)
    assert torch_threads.get_num_threads() == 2
    assert "demo: warm start and evaluations on 2 threads" in capsys.readouterr().out


def test_more_processes_than_cores_take_no_more_threads_than_cores(torch_threads, capsys):
    from mmgrpo.cli.demo import _threads_for_alone_stages

    _threads_for_alone_stages(None, 4)
    assert torch_threads.get_num_threads() == 2


@pytest.mark.parametrize(
    ("requested", "processes", "omp"),
    [(1, 2, ""), (None, 1, ""), (None, 2, "1")],
    ids=["--threads 1", "GRPO in this process", "OMP_NUM_THREADS=1"],
)
def test_the_users_threads_or_one_process_leave_the_threads_alone(
    torch_threads, capsys, monkeypatch, requested, processes, omp
):
    from mmgrpo.cli.demo import _threads_for_alone_stages

    if omp:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    _threads_for_alone_stages(requested, processes)
    assert torch_threads.get_num_threads() == 1
    assert capsys.readouterr().out == ""
