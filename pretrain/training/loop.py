"""The training loop over megatron-core: DDP, pipeline schedules, optimizer, checkpoints, metrics.

Per iteration: `global_batch_size / (micro_batch_size * DP)` micro-batches go through
`get_forward_backward_func()` (no pipelining, 1F1B, or interleaved 1F1B with virtual stages),
`finalize_model_grads` reduces gradients and updates the MoE routers' correction biases, and the
optimizer steps unless the loss or the gradient norm is not finite (then the step is skipped,
logged, and the run stops after `train.max_consecutive_nan_steps` skips in a row).

The loop knows no technique's internals: auxiliary losses (MoE load balancing, MTP depths, the DSA
indexer) come as a list of `pretrain.model.aux_losses.AuxLoss`, which scale their gradients before
each schedule and report their numbers after each step; what a stage trains
(`train.trainable_params`) is `pretrain.model.stages.freeze_for_stage`; step timing and throughput
are `pretrain.training.metrics.StepTimer`.
"""

from __future__ import annotations

import logging
import math
import os
import time
from functools import partial
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import unwrap_model

from parallel.initialize import initialize_parallel
from pretrain.config.schema import GLM5Config, TrainConfig
from pretrain.model.aux_losses import ReduceGroups, aux_losses_for
from pretrain.model.builder import build_model_chunks as build_rank_chunks
from pretrain.model.stages import freeze_for_stage
from pretrain.notices import first_time
from pretrain.optim.build import build_optimizer, build_scheduler, wrap_model_chunks
from pretrain.optim.clipped_step import step_with_norm
from pretrain.training.metrics import synchronize
from pretrain.training.preflight import preflight
from pretrain.training.profile_scopes import scope
from pretrain.training.step import forward_step

log = logging.getLogger(__name__)
SAVE_WAIT_WARN_S = 1.0  # a save that waited longer for the previous one says so (once): the interval is too short


class TrainingStopped(RuntimeError):
    """Raised when too many consecutive steps had a non-finite loss or gradient norm."""


def microbatches_per_step(train: TrainConfig, dp_size: int) -> int:
    """Micro-batches each data-parallel rank runs per optimizer step."""
    return train.global_batch_size // (train.micro_batch_size * dp_size)


def build_model_chunks(cfg: GLM5Config) -> List[DistributedDataParallel]:
    chunks = build_rank_chunks(cfg)
    freeze_for_stage(chunks, cfg.train.trainable_params)
    if cfg.model.bf16:
        chunks = [Float16Module(chunk.config, chunk) for chunk in chunks]
    return wrap_model_chunks(chunks, cfg.parallel, cfg.optimizer, cfg.model)


class Trainer:
    def __init__(self, cfg: GLM5Config):
        preflight(cfg)  # before any process group or GPU memory
        self.cfg = cfg
        initialize_parallel(cfg.parallel, seed=cfg.train.seed)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.dp_size, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.num_microbatches = microbatches_per_step(cfg.train, self.dp_size)
        self.model = build_model_chunks(cfg)
        self.aux_losses = aux_losses_for(cfg.model)
        self.optimizer = build_optimizer(cfg, self.model)
        self.scheduler = build_scheduler(cfg, self.optimizer)
        self._configure_schedule()
        self.iteration, self.nan_streak, self.skipped_steps = 0, 0, 0
        self._build_data()
        self._resume()
        self.async_queue = None  # checkpoint.async_save: saves written in the background
        if cfg.checkpoint.async_save:
            from pretrain.training.checkpoint import async_save_queue

            self.async_queue = async_save_queue()
        self.saved_iteration, self.saved_path = None, None
        self.save_blocked_s = self.save_waited_s = self.save_staged_s = None  # seconds, of the last save
        from pretrain.training.flops import configured_flops_per_step
        from pretrain.training.metrics import MetricsLogger, StepTimer, flops_caveat

        tokens = cfg.train.global_batch_size * cfg.data.seq_length
        self.timer = StepTimer(configured_flops_per_step(cfg.model, cfg.data.seq_length, tokens), tokens,
                               self.world_size)
        self.metrics = MetricsLogger(cfg, self.rank, self.world_size, resume_step=self.iteration)
        caveat = flops_caveat(cfg)
        if caveat and self.rank == 0:
            log.info(caveat)

    # ----------------------------------------------------------------------------- setup
    def _configure_schedule(self) -> None:
        config = unwrap_model(self.model[0]).config
        config.finalize_model_grads_func = _finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss
        no_sync = [m.no_sync for m in self.model]
        config.no_sync_func = no_sync if len(no_sync) > 1 else no_sync[0]
        self.schedule = get_forward_backward_func()

    def _build_data(self) -> None:
        from data_pipeline.datasets import build_datasets
        from data_pipeline.sampler import DataIterator

        from pretrain.training.preflight import sample_counts  # the counts preflight checked the files for

        t = self.cfg.train

        self.train_ds, self.valid_ds, _ = build_datasets(self.cfg, None, *sample_counts(self.cfg))

        def iterators(dataset, consumed=0):
            if dataset is None:
                return None
            its = [DataIterator(dataset, t.micro_batch_size, self.dp_rank, self.dp_size, consumed,
                                num_workers=self.cfg.data.num_workers) for _ in self.model]
            return its if len(its) > 1 else its[0]

        self._make_iterators = iterators
        self.train_iter = iterators(self.train_ds)

    def _data_iterators(self):
        return self.train_iter if isinstance(self.train_iter, list) else [self.train_iter]

    def _resume(self) -> None:
        c = self.cfg.checkpoint
        from pretrain.training.checkpoint import load_checkpoint

        # This run's own checkpoints first (a restarted run continues where it stopped), then the
        # one it was started from.
        candidates = ([c.save] if c.auto_resume and c.save else []) + ([c.load] if c.load else [])
        restored = None
        for load_dir in candidates:
            if os.path.isdir(load_dir):
                restored = load_checkpoint(load_dir, self.model, self.optimizer, self.scheduler)
                if restored is not None:
                    break
        if restored is None:
            if c.pretrained and c.pretrained_optimizer:
                from pretrain.training.pretrained import load_pretrained_with_optimizer

                source = load_pretrained_with_optimizer(c.pretrained, self.model, self.optimizer)
                self._log(f"started from the weights and optimizer state of {source}")
            elif c.pretrained:
                from pretrain.training.pretrained import load_pretrained_weights

                fresh = load_pretrained_weights(c.pretrained, self.model)
                # bf16 training keeps fp32 main copies made when the optimizer was built: refresh them.
                self.optimizer.reload_model_params()
                note = f"; {len(fresh)} DSA indexer tensors initialized fresh" if fresh else ""
                self._log(f"started from the weights of {c.pretrained}{note}")
            return
        self.iteration, extra = restored
        for it in self._data_iterators():
            it.load_state_dict(extra["data"])
        self.skipped_steps = extra.get("skipped_steps", 0)
        self._log(f"resumed from {load_dir} at iteration {self.iteration}")

    def _log(self, message: str) -> None:
        if self.rank == 0:
            print(message, flush=True)

    # ----------------------------------------------------------------------------- steps
    def _run_schedule(self, data_iterator, forward_only: bool):
        seq = self.cfg.data.seq_length
        # Auxiliary gradients are averaged over micro-batches like the LM loss's and carry the fp16
        # loss scale.
        loss_scale = self.optimizer.scale_loss(torch.ones(1, device=_device()))
        for aux in self.aux_losses:
            aux.prepare(loss_scale, self.num_microbatches)
        return self.schedule(
            forward_step_func=partial(forward_step, cp_group=ps.get_context_parallel_group(),
                                      cp_chunk_assignment=self.cfg.parallel.cp_chunk_assignment,
                                      cp_chunks_per_rank=self.cfg.parallel.cp_chunks_per_rank),
            data_iterator=data_iterator,
            model=self.model if len(self.model) > 1 else self.model[0],
            num_microbatches=self.num_microbatches,
            seq_length=seq,
            micro_batch_size=self.cfg.train.micro_batch_size,
            decoder_seq_length=seq,
            forward_only=forward_only,
        )

    def _loss_total(self, losses: List[Dict[str, torch.Tensor]]) -> torch.Tensor:
        """(LM loss sum, token count) over the global batch (counted once per model replica), summed and
        all-reduced on the device: nothing waits for it until `_mean` reads it."""
        total = torch.zeros(2, dtype=torch.float64, device=_device())
        if losses:
            total += torch.stack([item["lm loss"].detach().reshape(2) for item in losses]).double().sum(0)
        dist.all_reduce(total)
        return total

    @staticmethod
    def _mean(total: torch.Tensor) -> float:
        total_sum, count = total.tolist()  # one host read of both
        return total_sum / count if count > 0 else float("nan")

    def _global_mean(self, losses: List[Dict[str, torch.Tensor]]) -> float:
        """Token-mean LM loss over the global batch."""
        return self._mean(self._loss_total(losses))

    def _auxiliary_losses(self) -> Dict[str, float]:
        """This step's auxiliary losses (MTP depths, MoE balancing, DSA indexer, ...), for logging."""
        # Context-parallel ranks hold equal shares of each sequence: averaging over DP x CP is the token mean.
        groups = ReduceGroups(pp=ps.get_pipeline_model_parallel_group(),
                              dp=ps.get_data_parallel_group(with_context_parallel=True), device=_device())
        out: Dict[str, float] = {}
        for aux in self.aux_losses:
            out.update(aux.collect(groups))
        return out

    def train_step(self) -> Dict[str, float]:
        # `scope`s name the step's parts for the profiler (`pretrain.tools.step_breakdown`); no-ops
        # outside a profile window.
        with scope("grad_reduce"):
            for chunk in self.model:
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
        losses = self._run_schedule(self.train_iter, forward_only=False)
        loss_total = self._loss_total(losses)  # queued behind the backward, read after the norm's wait
        with scope("optimizer"):
            self.optimizer.prepare_grads()
            # The step's one wait for the device: the norm is read on the host (a non-finite one skips the
            # step), and the update is clipped by this same norm rather than megatron's step computing it again.
            grad_norm = self.optimizer.get_grad_norm()
        optimizer_start = time.perf_counter()  # the backward has ended on the device
        loss = self._mean(loss_total)
        finite = math.isfinite(loss) and grad_norm is not None and math.isfinite(grad_norm)
        if finite:
            with scope("optimizer"):
                finite = self.optimizer_step(grad_norm)
        synchronize()
        optimizer_seconds = time.perf_counter() - optimizer_start
        if finite:
            self.scheduler.step(increment=1)
            self.nan_streak = 0
        else:
            self.nan_streak += 1
            self.skipped_steps += 1
        values = {"loss": loss, "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                  "lr": self.optimizer.param_groups[0]["lr"], "skipped": not finite,
                  "optimizer_time_s": optimizer_seconds}
        values.update(self._auxiliary_losses())
        return values

    def optimizer_step(self, grad_norm: float) -> bool:
        """Clip by `grad_norm` and update (`pretrain.optim.step_with_norm`); False if the update did not happen."""
        return step_with_norm(self.optimizer, grad_norm)

    @torch.no_grad()
    def evaluate(self) -> float:
        t = self.cfg.train
        consumed = (self.iteration // t.eval_interval - 1) * t.eval_iters * t.global_batch_size
        data = self._make_iterators(self.valid_ds, max(consumed, 0))
        for chunk in self.model:
            chunk.eval()
        losses: List[dict] = []
        for _ in range(t.eval_iters):
            losses += self._run_schedule(data, forward_only=True) or []
        for chunk in self.model:
            chunk.train()
        for aux in self.aux_losses:
            aux.reset()
        return self._global_mean(losses)

    def save(self) -> Optional[str]:
        c = self.cfg.checkpoint
        if not c.save:
            return None
        from pretrain.training.checkpoint import finalize_async_saves, save_checkpoint, wait_for_pruning

        extra = {"data": self._data_iterators()[0].state_dict(), "skipped_steps": self.skipped_steps}
        began = time.perf_counter()
        # The previous save's tail first (its background write, then its pruning), timed apart from this save's own
        # work, so `save_blocked_s` (all that training waited) splits into `save_waited_s` (for the previous save)
        # and `save_staged_s` (this save: staging the tensors when async, the whole write when synchronous).
        finalize_async_saves(self.async_queue, blocking=True)
        wait_for_pruning()
        waited = time.perf_counter()
        self.saved_path = save_checkpoint(c.save, self.iteration, self.model, self.optimizer, self.scheduler, self.cfg,
                                          extra, async_queue=self.async_queue)
        done = time.perf_counter()
        self.saved_iteration = self.iteration
        self.save_waited_s, self.save_staged_s, self.save_blocked_s = waited - began, done - waited, done - began
        if self.rank == 0 and self.save_waited_s > SAVE_WAIT_WARN_S and first_time("checkpoint interval too short"):
            log.warning("checkpoint.save_interval=%s steps is shorter than one background checkpoint write: the save "
                        "at step %d waited %.1f s for the previous save's background work (its write, then the "
                        "pruning of older checkpoints) to finish (training blocked); a longer "
                        "checkpoint.save_interval avoids the wait (said once)", c.save_interval, self.iteration,
                        self.save_waited_s)
        return self.saved_path

    def _stop_on_signal(self, signal_name: str, profiler, exit_signals) -> None:
        """Every rank agreed on a signal after this step: save it, log one line, raise `Preempted`."""
        from pretrain.training.checkpoint import close_async_saves
        from pretrain.training.preemption import Preempted

        if self.cfg.checkpoint.save and self.saved_iteration != self.iteration:
            self.save()
        close_async_saves(self.async_queue)  # the checkpoint is complete on disk before the process exits
        exit_signals.uninstall()  # until here a repeated signal does not cut the save short
        profiler.close()
        self.metrics.close()
        stopped = Preempted(signal_name, self.iteration, self.saved_path if self.cfg.checkpoint.save else None)
        self._log(f"preempted: {stopped}")
        raise stopped

    # ----------------------------------------------------------------------------- loop
    def train(self) -> Dict[str, float]:
        from data_pipeline.sampler import data_wait_metrics
        from pretrain.training.profiler import ProfilerWindow

        t, c = self.cfg.train, self.cfg.checkpoint
        first_iteration = self.iteration
        last: Dict[str, float] = {}
        profiler = ProfilerWindow(self.cfg, model=self.model)
        from pretrain.training.checkpoint import close_async_saves, finalize_async_saves
        from pretrain.training.preemption import ExitSignals

        exit_signals = ExitSignals(t.exit_signals).install()  # train.exit_signals: preemption, `preemption.py`
        while self.iteration < t.train_iters:
            self.timer.start()
            with profiler.step(self.iteration + 1):
                values = self.train_step()
            values.update(self.timer.stop())
            values.update(data_wait_metrics(self._data_iterators(), values["step_time_s"]))
            self.iteration += 1
            if t.eval_interval and self.iteration % t.eval_interval == 0 and self.valid_ds is not None:
                values["valid_loss"] = self.evaluate()
            self.metrics.log_step(self.iteration, values)
            last = values
            if self.nan_streak >= t.max_consecutive_nan_steps:
                self.metrics.close()
                raise TrainingStopped(f"{self.nan_streak} consecutive steps had a non-finite loss or gradient norm "
                                      f"(last at iteration {self.iteration}); stopping")
            if c.save and c.save_interval and self.iteration % c.save_interval == 0:
                self.save()
            finalize_async_saves(self.async_queue)  # publishes a background save once every rank has written it
            stopped_by = exit_signals.agreed(_device())  # the ranks agree, so all stop after the same step
            if stopped_by:
                self._stop_on_signal(stopped_by, profiler, exit_signals)
        if c.save and self.iteration > first_iteration and (not c.save_interval or self.iteration % c.save_interval):
            self.save()
        exit_signals.uninstall()
        close_async_saves(self.async_queue)
        profiler.close()
        self.metrics.close()
        return last


def _finalize_model_grads(*args, **kwargs):
    """megatron-core's gradient reduction (and MoE router bias update), named for the profiler."""
    with scope("grad_reduce"):
        return finalize_model_grads(*args, **kwargs)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

