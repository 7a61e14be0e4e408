"""Asynchronous checkpoints (`checkpoint.async_save`): what is written is the state of the step saved even
while training goes on, a crash in the middle of the background write leaves the previous checkpoint as
the one resumed, and the resumed run continues the uninterrupted (synchronous) run's losses bitwise. On GPUs,
what each save holds once it returns: an asynchronous save's device copies, a synchronous save's host staging
(`checkpoint.pinned_staging`)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import RankError, run_ranks_eager as run_ranks  # every comparison's sides run in ranks
from tests.test_training import ROOT, read_metrics, tiny_overrides

ITERS = 6


def _train(rank, world_size, overrides, hold_save=None, crash_save=None):
    """Train; optionally hold the write of step `hold_save` until training has taken the next step
    (the weights have changed by then), and kill the process in the middle of the write of `crash_save`."""
    import threading

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from pretrain.config import load_config
    from pretrain.training import loop

    stepped = threading.Event()
    real_write = FileSystemWriterAsync.write_preloaded_data

    def write(transform_list, index, bucket, *args, **kwargs):
        path = str(bucket[0])
        if hold_save and f"iter_{hold_save:07d}" in path:
            assert stepped.wait(timeout=300), "training did not go on while the checkpoint was written"
        if crash_save and f"iter_{crash_save:07d}" in path:
            with open(path, "wb") as f:
                f.write(b"half a shard")
            os._exit(17)  # the process dies mid-write, as on a node failure
        return real_write(transform_list, index, bucket, *args, **kwargs)

    FileSystemWriterAsync.write_preloaded_data = staticmethod(write)
    real_step = loop.Trainer.train_step

    def train_step(self):
        values = real_step(self)
        if hold_save and self.iteration >= hold_save:  # the optimizer has updated the weights in place
            stepped.set()
        return values

    loop.Trainer.train_step = train_step
    trainer = loop.Trainer(load_config(str(ROOT / "configs/models/glm5-tiny.yaml"), overrides))
    trainer.train()
    return {"blocked_s": trainer.save_blocked_s}


def _args(data, run_dir, ckpt, *extra):
    return tiny_overrides(data, run_dir, f"train.train_iters={ITERS}", "train.eval_interval=null",
                          f"checkpoint.save={ckpt}", "checkpoint.save_interval=2", *extra)


def test_crash_during_async_save_resumes_the_previous_checkpoint(stdlib_data, tmp_path):
    reference, crashed, ckpt = tmp_path / "reference", tmp_path / "crashed", tmp_path / "ckpt"
    run_ranks(_train, 2, _args(stdlib_data, reference, tmp_path / "ckpt_sync"), timeout=600)
    asynchronous = _args(stdlib_data, crashed, ckpt, "checkpoint.async_save=true")
    with pytest.raises(RankError, match="exited with code 17"):
        run_ranks(_train, 2, asynchronous, 2, 4, timeout=600)
    assert (ckpt / "latest").read_text().count('"iteration": 2') == 1
    assert (ckpt / "iter_0000004.partial").is_dir() and not (ckpt / "iter_0000004").exists()
    run_ranks(_train, 2, asynchronous, timeout=600)
    rows = read_metrics(crashed)
    assert [r["step"] for r in rows] == list(range(1, ITERS + 1))
    # Step 3 onwards were trained again from the step-2 checkpoint, which was written while step 3
    # changed the weights: the same losses as the synchronous run show it holds step 2's state.
    assert [r["loss"] for r in rows] == [r["loss"] for r in read_metrics(reference)]
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000004", "iter_0000006", "latest"]


def test_save_time_splits_into_waiting_for_the_previous_save_and_its_own(monkeypatch, caplog):
    """`Trainer.save` times the wait for the previous background write (`save_waited_s`) apart from this save's own
    work (`save_staged_s`), checked against known sleeps of a fake writer queue and a fake save; a wait of more than
    a second says once that the checkpoint interval is shorter than a write."""
    import logging
    import time
    from types import SimpleNamespace

    from pretrain.notices import forget_said
    from pretrain.training import checkpoint
    from pretrain.training.loop import Trainer

    write_s, stage_s = 1.05, 0.2  # the write just over the warning's 1 s; staging well under the write

    class SlowWriter:
        """One write in flight at a time, which takes `write_s` to finish once waited for."""

        def __init__(self):
            self.in_flight = 0

        def get_num_unfinalized_calls(self):
            return self.in_flight

        def maybe_finalize_async_calls(self, blocking):
            assert blocking
            time.sleep(write_s)
            self.in_flight = 0

    def save_checkpoint(save_dir, iteration, *args, async_queue=None):
        checkpoint.finalize_async_saves(async_queue, blocking=True)  # as the real one: nothing left in flight here
        time.sleep(stage_s)
        async_queue.in_flight = 1  # this save's write goes on in the background
        return f"{save_dir}/iter_{iteration:07d}"

    monkeypatch.setattr(checkpoint, "save_checkpoint", save_checkpoint)
    forget_said()
    trainer = Trainer.__new__(Trainer)  # the save alone: no process group, model or data
    trainer.cfg = SimpleNamespace(checkpoint=SimpleNamespace(save="ckpt", save_interval=2))
    trainer.model = trainer.optimizer = trainer.scheduler = None
    trainer.rank, trainer.skipped_steps, trainer.async_queue = 0, 0, SlowWriter()
    trainer._data_iterators = lambda: [SimpleNamespace(state_dict=dict)]
    seen = []
    with caplog.at_level(logging.WARNING, logger="pretrain.training.loop"):
        for trainer.iteration in (2, 4, 6):
            assert trainer.save() == f"ckpt/iter_{trainer.iteration:07d}"
            seen.append((trainer.save_waited_s, trainer.save_staged_s, trainer.save_blocked_s))
    first, *later = seen
    assert first[0] < 0.1 and stage_s <= first[1] < stage_s + 0.5  # nothing in flight: only its own staging
    for waited, staged, blocked in later:  # the previous write was in flight: waited for it, then staged
        assert write_s <= waited < write_s + stage_s, seen
        assert stage_s <= staged < stage_s + write_s, seen
        assert blocked == pytest.approx(waited + staged)
    warned = [r for r in caplog.records if "checkpoint.save_interval" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING, [r.getMessage() for r in caplog.records]
    assert "step 4 waited 1." in warned[0].getMessage() and "shorter than one background" in warned[0].getMessage()


def test_each_rank_fsyncs_only_the_files_it_wrote(tmp_path):
    """Rank 0 must not touch another rank's files (a rank's state file may still be a .tmp being renamed)."""
    from pretrain.training.checkpoint_files import rank_files

    (tmp_path / "rank_state").mkdir()
    names = ["__0_0.distcp", "__1_0.distcp", "__1_1.distcp", "__10_0.distcp", "common.pt", "metadata.json",
             ".metadata", "config.yaml", "rank_state/rank_00000.pt", "rank_state/rank_00001.tmp",
             "rank_state/rank_00010.pt"]
    for name in names:
        (tmp_path / name).write_text("x")
    mine = {r: sorted(p.relative_to(tmp_path).as_posix() for p in rank_files(tmp_path, r)) for r in (0, 1, 10)}
    assert mine[0] == [".metadata", "__0_0.distcp", "common.pt", "config.yaml", "metadata.json",
                       "rank_state/rank_00000.pt"]
    assert mine[1] == ["__1_0.distcp", "__1_1.distcp", "rank_state/rank_00001.tmp"]
    assert mine[10] == ["__10_0.distcp", "rank_state/rank_00010.pt"]


def test_async_worker_applies_the_writer_patch():
    """megatron's persistent worker is a fresh interpreter: a request it unpickles applies our writer patch."""
    code = (
        "import functools, pickle\n"
        "from pretrain.compat import dist_checkpointing as d\n"
        "assert not d._CKPT_WRITER_PATCHED\n"
        "fn = pickle.loads(pickle.dumps(functools.partial(d.run_in_async_worker, len)))\n"
        "assert fn('abc') == 3 and d._CKPT_WRITER_PATCHED\n"
        "d.patch_async_worker()\n"
        "from megatron.core.dist_checkpointing.strategies import async_utils\n"
        "assert async_utils.PersistentAsyncCaller.schedule_async_call._glm5_patched\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def _stage(buckets):
    """A stand-in for megatron's `FileSystemWriterAsync.preload_tensors`: host copies of the buckets' tensors."""
    return [(name, key, (data, [(item, t.clone()) for item, t in tensors])) for name, key, (data, tensors) in buckets]


def _write(rank, buckets, results):
    results.extend((name, item, t.tolist()) for name, _, (_, tensors) in buckets for item, t in tensors)


def test_async_request_lets_go_of_its_device_tensors_once_staged():
    """The patched persistent caller: once scheduling returns (the worker has staged the tensors), neither the
    trainer's request nor the worker's copy of it (unpickled, as the spawned worker gets it, and held until the write
    ends) references the tensors it staged, so a save's checkpoint-only copies (megatron's transposed experts) are
    freed; the write still gets every staged value, and the bucket count megatron checks is kept."""
    import functools
    import gc
    import pickle
    import weakref

    import torch
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    from pretrain.compat.dist_checkpointing import worker_schedule

    class Worker:
        """megatron's persistent caller and its worker loop, in one process: the request arrives pickled; the
        worker stages it, signals the trainer, and holds the request until its write is done."""

        def schedule_async_call(self, async_req):
            self.held = pickle.loads(pickle.dumps(async_req))
            self.tensor = weakref.ref(self.held.async_fn_args[1][0][2][1][0][1])
            self.args = list(self.held.async_fn_args)
            self.args[1] = self.held.preload_fn()  # then the trainer's wait for staging returns

        def write(self):
            self.held.async_fn(*self.args)

    copy = torch.arange(6.0).view(2, 3).t().contiguous()  # only the request references it: a checkpoint copy
    trainer_tensor = weakref.ref(copy)
    buckets = [("__0_0.distcp", "key", ([], [("expert.weight1", copy)])), ("__0_1.distcp", "key2", ([], []))]
    written = []
    request = AsyncRequest(functools.partial(_write), (0, buckets, written), [],
                           preload_fn=functools.partial(_stage, buckets))
    del copy
    worker = Worker()
    worker_schedule(Worker.schedule_async_call)(worker, request)
    gc.collect()
    assert worker.tensor() is None, "the worker's request still holds the device tensor it staged"
    assert trainer_tensor() is None, "the trainer's request still holds the device tensor the worker staged"
    assert len(request.async_fn_args[1]) == 2  # megatron's retrieve_write_results compares this count
    worker.args[2] = written = []
    worker.write()
    assert written == [("__0_0.distcp", "expert.weight1", [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]])]


@pytest.mark.gpu
def test_async_save_on_gpu_resumes_like_a_synchronous_run(tmp_path):
    """megatron's persistent worker process (spawned, CUDA tensors staged through it): a run resumed from an
    asynchronous checkpoint continues the synchronous run's losses."""
    train = [sys.executable, "-m", "pretrain.train", "--config", "configs/models/glm5-tiny.yaml",
             "train.eval_interval=null", "optimizer.lr_warmup_iters=1", "checkpoint.save_interval=2"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

    def run(run_dir, ckpt, iters, *extra):
        proc = subprocess.run(train + [f"train.train_iters={iters}", f"logging.run_dir={run_dir}",
                                       f"checkpoint.save={ckpt}", *extra], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    run(tmp_path / "sync", tmp_path / "ckpt_sync", ITERS)
    run(tmp_path / "async", tmp_path / "ckpt_async", 4, "checkpoint.async_save=true", "optimizer.lr_decay_iters=6")
    assert (tmp_path / "ckpt_async" / "latest").read_text().count('"iteration": 4') == 1
    out = run(tmp_path / "async", tmp_path / "ckpt_async", ITERS, "checkpoint.async_save=true",
              "optimizer.lr_decay_iters=6")
    assert "at iteration 4" in out
    a = [r["loss"] for r in read_metrics(tmp_path / "sync")]
    b = [r["loss"] for r in read_metrics(tmp_path / "async")]
    assert len(a) == len(b) == ITERS and b == pytest.approx(a, rel=1e-5)


def _memory_held_by_async_save(rank, world_size, overrides, save_dir):
    """Allocated GPU memory the trainer holds after an asynchronous save call returns (before the write is
    finalized), and the bytes of the routed experts' weights, fp32 main weights and Muon momentum."""
    import gc

    import torch

    from pretrain.config import load_config
    from pretrain.training import loop
    from pretrain.training.checkpoint import close_async_saves

    trainer = loop.Trainer(load_config(str(ROOT / "configs/models/glm5-tiny.yaml"), overrides))
    trainer.train()  # one step: the optimizer state exists
    trainer.cfg.checkpoint.save = str(save_dir)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    trainer.save()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    in_flight = trainer.async_queue.get_num_unfinalized_calls()
    close_async_saves(trainer.async_queue)
    experts = sum(p.numel() for chunk in trainer.model for name, p in chunk.named_parameters()
                  if ".experts." in name and "weight" in name)
    del trainer
    gc.collect()  # megatron's async caller logs its rank when collected: while the process group exists
    return {"held": held, "in_flight": in_flight, "expert_state_bytes": experts * (2 + 4 + 4)}


@pytest.mark.gpu
def test_async_save_frees_its_expert_copies_once_staged(tmp_path):
    """megatron-core's `GroupedMLP` checkpoint layout copies every routed expert (transposed, weights and optimizer
    state alike) for each save. An asynchronous save must free those copies once the worker has staged them, as a
    synchronous save does when it returns, not hold them in GPU memory for the whole background write."""
    from tests.distributed import run_ranks

    overrides = ["model.bf16=true", "model.params_dtype=bfloat16", "optimizer.optimizer=muon", "data.mock=true",
                 "model.vocab_size=1024", "data.seq_length=64", "train.micro_batch_size=2",
                 "train.global_batch_size=2", "train.train_iters=1", "train.eval_interval=null",
                 "optimizer.lr_warmup_iters=1", "optimizer.lr_decay_iters=10", "model.hidden_size=256",
                 "model.moe_ffn_hidden_size=512", "model.num_moe_experts=16", "checkpoint.async_save=true", f"logging.run_dir={tmp_path / 'run'}"]
    got = run_ranks(_memory_held_by_async_save, 1, overrides, tmp_path / "ckpt")[0]
    print(got)
    assert got["in_flight"] == 1  # measured while the save was still to be finalized
    assert got["expert_state_bytes"] > 100 * 2**20  # what holding the copies would show
    assert got["held"] < 0.02 * got["expert_state_bytes"], got


def _host_memory_kept_by_sync_save(rank, world_size, overrides, save_dir):
    """The trainer's resident host memory before and after two synchronous saves, and the bytes the saves wrote."""
    import gc

    from pretrain.config import load_config
    from pretrain.training import loop

    from benchmarks.soak import proc_status

    def rss_bytes():
        return proc_status("VmRSS") * 1024

    trainer = loop.Trainer(load_config(str(ROOT / "configs/models/glm5-tiny.yaml"), overrides))
    trainer.train()  # one step: the optimizer state exists
    trainer.cfg.checkpoint.save = str(save_dir)
    gc.collect()
    before = rss_bytes()
    trainer.save()
    trainer.iteration += 1  # a second step dir (the same state), so a save that reuses a kept cache shows too
    trainer.save()
    gc.collect()
    after = rss_bytes()
    written = sum(p.stat().st_size for p in Path(save_dir).rglob("*.distcp"))
    del trainer
    gc.collect()
    return {"before": before, "after": after, "written": written}


@pytest.mark.gpu
def test_sync_save_keeps_pinned_staging_unless_told_not_to(tmp_path):
    """megatron-core stages a synchronous save through PyTorch's pinned host cache, which keeps every staged block:
    by default the trainer's resident memory stays about 1.3x one save's bytes above where it was (fast later saves);
    `checkpoint.pinned_staging=false` stages in pageable memory and returns it. The bytes written to disk are the
    independent measure of the state."""
    from tests.distributed import run_ranks

    overrides = ["model.bf16=true", "model.params_dtype=bfloat16", "optimizer.optimizer=muon", "data.mock=true",
                 "model.vocab_size=1024", "data.seq_length=64", "train.micro_batch_size=2",
                 "train.global_batch_size=2", "train.train_iters=1", "train.eval_interval=null",
                 "optimizer.lr_warmup_iters=1", "optimizer.lr_decay_iters=10", "model.hidden_size=512",
                 "model.moe_ffn_hidden_size=1024", "model.num_moe_experts=48", "checkpoint.keep_last=2"]
    kept, freed = (run_ranks(_host_memory_kept_by_sync_save, 1, [*overrides, f"logging.run_dir={tmp_path / name}", *extra],
                             tmp_path / f"ckpt_{name}")[0]
                   for name, extra in (("pinned", []), ("pageable", ["checkpoint.pinned_staging=false"])))
    print({"pinned": kept, "pageable": freed})
    one_save = kept["written"] / 2
    assert one_save > 2**30 and freed["written"] == pytest.approx(kept["written"], rel=0.01)
    assert kept["after"] - kept["before"] > 0.9 * one_save, kept  # the default's cost, as documented
    assert freed["after"] - freed["before"] < 0.1 * one_save, freed
