"""A first run: fit the tiny GLM-5 on byte tokens of the Python standard library's source.

    python launch/quickstart.py --config configs/models/glm5-tiny.yaml --steps 150

Builds the model from the config (MLA, MoE with a shared expert, 3-depth shared MTP, DSA
indexer), trains it with AdamW on CPU or one GPU, prints loss and throughput as it goes, and
writes the weights (safetensors) and the resolved config to the run directory.
"""

from __future__ import annotations

import argparse
import glob
import os
import sysconfig
import time

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm


def stdlib_bytes(limit: int = 8 * 2**20) -> np.ndarray:
    """UTF-8 bytes of the running Python's standard-library sources (a corpus on every machine)."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    chunks, total = [], 0
    for path in files:
        with open(path, "rb") as f:
            data = f.read()
        chunks.append(np.frombuffer(data, dtype=np.uint8))
        total += len(data)
        if total >= limit:
            break
    return np.concatenate(chunks).astype(np.int64)


def main() -> None:
    from parallel.initialize import initialize_parallel
    from pretrain.config import load_config, save_config
    from pretrain.model.builder import build_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/models/glm5-tiny.yaml")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    torch.manual_seed(cfg.train.seed)
    initialize_parallel(cfg.parallel, seed=cfg.train.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(cfg).train()
    tokens = torch.from_numpy(stdlib_bytes())
    seq, batch = cfg.data.seq_length, cfg.train.micro_batch_size
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr, betas=(cfg.optimizer.adam_beta1, cfg.optimizer.adam_beta2),
                            weight_decay=cfg.optimizer.weight_decay)
    pos = torch.arange(seq, device=device).unsqueeze(0).expand(batch, -1)
    gen = torch.Generator().manual_seed(cfg.train.seed)
    history, start = [], time.time()
    bar = tqdm(range(args.steps), desc="quickstart", unit="step")
    for step in bar:
        lr = cfg.optimizer.lr * min(1.0, (step + 1) / max(1, cfg.optimizer.lr_warmup_iters))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(tokens) - seq - 1, (batch,), generator=gen)
        window = torch.stack([tokens[s : s + seq + 1] for s in starts]).to(device)
        loss = model(window[:, :-1], pos, None, labels=window[:, 1:]).float().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.clip_grad)
        opt.step()
        history.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr:.1e}", gnorm=f"{grad_norm:.2f}",
                        tok_s=f"{(step + 1) * batch * seq / (time.time() - start):,.0f}")
    run_dir = cfg.logging.run_dir
    os.makedirs(run_dir, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if torch.is_tensor(v)},
              os.path.join(run_dir, "model.safetensors"))
    save_config(cfg, os.path.join(run_dir, "config.yaml"))
    first, last = np.mean(history[:10]), np.mean(history[-10:])
    print(f"\nloss {first:.3f} -> {last:.3f} over {args.steps} steps "
          f"({'falling' if last < first else 'NOT falling'}); weights and config in {run_dir}/")
    if last >= first:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
