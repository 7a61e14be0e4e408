"""Data loading in worker processes (`data.num_workers`): the same stream, an exact resume, the wait measured.

The reference is the in-process iterator (num_workers=0) and the dataset indexed directly: with workers every
micro-batch must hold the same tensors in the same order, and a position saved with workers must resume to
the same next samples with or without them.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from data_pipeline.sampler import DataIterator, data_wait_metrics
from tests.test_datasets import build, make_cfg, random_documents, write_dataset

MICRO, STEPS = 2, 12


@pytest.fixture(scope="module")
def train_ds(tmp_path_factory):
    root = tmp_path_factory.mktemp("workers")
    prefix = write_dataset(str(root / "docs"), random_documents(200, 10, 3000, seed=3))
    cfg = make_cfg(root, [prefix], split="100,0,0")
    train, _, _ = build(cfg, MICRO * STEPS * 2)
    return train


def _equal(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_workers_give_the_in_process_stream_sample_by_sample(train_ds):
    plain = [next(DataIterator(train_ds, MICRO, consumed_samples=i * MICRO)) for i in range(STEPS)]
    for i, batch in enumerate(plain):  # the in-process stream is the dataset in sampler order
        assert torch.equal(batch["tokens"][1], train_ds[i * MICRO + 1]["tokens"])
    workers = DataIterator(train_ds, MICRO, num_workers=2)
    for i in range(STEPS):
        assert _equal(next(workers), plain[i]), i


@pytest.mark.parametrize("before, after", [(2, 2), (2, 0), (0, 2)])
def test_a_position_saved_with_workers_resumes_to_the_same_samples(train_ds, before, after):
    reference = DataIterator(train_ds, MICRO)
    stream = [next(reference) for _ in range(STEPS)]
    first = DataIterator(train_ds, MICRO, num_workers=before)
    for i in range(5):  # its workers have prefetched further than this
        assert _equal(next(first), stream[i])
    state = first.state_dict()
    del first
    resumed = DataIterator(train_ds, MICRO, num_workers=after)
    resumed.load_state_dict(state)
    for i in range(5, STEPS):
        assert _equal(next(resumed), stream[i]), i


def test_trainer_hands_data_num_workers_to_the_loader(train_ds, monkeypatch, tmp_path):
    """`data.num_workers` reaches the train iterator (it used to be validated and then dropped)."""
    import data_pipeline.datasets
    from pretrain.config import GLM5Config
    from pretrain.training.loop import Trainer

    cfg = GLM5Config()
    cfg.data.num_workers, cfg.train.micro_batch_size = 2, MICRO
    monkeypatch.setattr(data_pipeline.datasets, "build_datasets", lambda *_args: (train_ds, None, None))
    trainer = SimpleNamespace(cfg=cfg, model=[torch.nn.Linear(1, 1)], dp_rank=0, dp_size=1)
    Trainer._build_data(trainer)
    assert trainer.train_iter.num_workers == 2
    plain = DataIterator(train_ds, MICRO)
    try:
        assert all(_equal(next(trainer.train_iter), next(plain)) for _ in range(3))
    finally:
        trainer.train_iter.close()  # its workers ignore SIGTERM: stop them before this process exits


class SlowDataset(torch.utils.data.Dataset):
    """Each sample takes `delay` seconds to read."""

    def __init__(self, base, delay):
        self.base, self.delay = base, delay

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        time.sleep(self.delay)
        return self.base[i]


def test_data_wait_is_the_time_blocked_on_the_next_batch(train_ds, monkeypatch):
    import data_pipeline.sampler as sampler

    monkeypatch.setattr(sampler, "dataset_fingerprint", lambda _ds: {})
    it = DataIterator(SlowDataset(train_ds, 0.05), MICRO)
    next(it), next(it)
    waited = data_wait_metrics([it, None], step_time_s=1.0)
    assert 4 * 0.05 <= waited["data_wait_s"] < 4 * 0.05 + 2.0 and waited["data_wait_frac"] == waited["data_wait_s"]
    assert data_wait_metrics([it], step_time_s=1.0)["data_wait_s"] == 0.0  # taken: the next step starts at 0


def test_workers_outlive_a_preemption_signal(train_ds):
    """Slurm's SIGTERM (or --signal USR1) reaches every process of the step; the trainer still needs its
    batches until it has saved, so the loader's workers ignore both."""
    import os
    import signal

    stream = [next(DataIterator(train_ds, MICRO, consumed_samples=i * MICRO)) for i in range(6)]
    it = DataIterator(train_ds, MICRO, num_workers=2)
    it._start_loader()  # signalled the moment they are forked, before their worker_init_fn has run (a race the
    for worker in it._batches._workers:  # full suite once lost: a worker killed by SIGUSR1 while starting)
        os.kill(worker.pid, signal.SIGTERM)
        os.kill(worker.pid, signal.SIGUSR1)
    assert _equal(next(it), stream[0])
    for worker in it._batches._workers:  # and once they run
        os.kill(worker.pid, signal.SIGTERM)
        os.kill(worker.pid, signal.SIGUSR1)
    time.sleep(0.5)
    try:
        for i in range(1, 6):
            assert _equal(next(it), stream[i]), i
    finally:
        it.close()


EXIT_SCRIPT = """
import sys
from pathlib import Path
from data_pipeline.sampler import DataIterator
from tests.test_datasets import build, make_cfg, random_documents, write_dataset
root = Path(sys.argv[1])
cfg = make_cfg(root, [write_dataset(str(root / "docs"), random_documents(50, 10, 300, seed=1))], split="100,0,0")
train, _, _ = build(cfg, 16)
KEPT = DataIterator(train, 2, num_workers=2)  # open at exit, as a trainer's iterator is
next(KEPT)
print("read a batch", flush=True)
"""


def test_a_process_with_an_open_worker_loader_exits(tmp_path):
    """The workers ignore SIGTERM (preemption), and multiprocessing stops daemonic children at exit by SIGTERM and
    then joins them: before the loader was closed at exit, a process whose iterator was still open never ended
    (CI's pytest hung after its last test)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    try:
        done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(tmp_path)], cwd=root, capture_output=True,
                              text=True, timeout=120)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the process did not exit within 120 s of its last statement: {err.stdout!r}")
    assert done.returncode == 0 and "read a batch" in done.stdout, done.stderr[-2000:]
