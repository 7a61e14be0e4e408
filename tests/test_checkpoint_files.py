"""Checkpoint files on disk: the `latest` marker, keep_last, a crash mid-save, damaged step dirs (they
fall back to an older checkpoint with a warning), and load failures that are no damage (they raise,
naming the step dir). One rank, the trainer's setup from test_checkpoint.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest

from tests.distributed import run_ranks
from tests.test_checkpoint import RANK_ENV, Setup, config


def _latest(save_dir: Path):
    path = save_dir / "latest"
    return json.loads(path.read_text())["step_dir"] if path.exists() else None


def rank_file_scenarios(rank: int, world_size: int, save_dir: str) -> dict:
    """Saves with keep_last=2, a crash mid-save, and loads from damaged step dirs (one rank)."""
    from megatron.core import dist_checkpointing

    from pretrain.training import checkpoint

    out: dict = {}
    root = Path(save_dir)
    setup = Setup(config(save_dir), seed=1)
    out["empty"] = setup.load()

    seen_during_save = []
    real_save = dist_checkpointing.save

    def watching_save(state, directory, **kwargs):
        request = real_save(state, directory, **kwargs)

        def seen():  # all shards written: the step is still not published
            seen_during_save.append((Path(directory).name, _latest(root), (Path(directory) / "complete.json").exists()))

        request.add_finalize_fn(seen)
        return request

    checkpoint.dist_checkpointing.save = watching_save
    listings = []
    for _ in range(3):
        setup.step()
        setup.save()
        listings.append((_latest(root), sorted(p.name for p in root.iterdir())))
    checkpoint.dist_checkpointing.save = real_save
    out["seen_during_save"], out["listings"] = seen_during_save, listings

    # A crash after the shards and rank files are written, before the config and completion record.
    def crash(*_args, **_kwargs):
        raise KeyboardInterrupt("killed mid-save")

    setup.step()
    checkpoint.save_config, real_save_config = crash, checkpoint.save_config
    try:
        setup.save()
    except KeyboardInterrupt:
        out["crashed"] = True
    checkpoint.save_config = real_save_config
    out["after_crash"] = (_latest(root), sorted(p.name for p in root.iterdir()))
    out["load_after_crash"] = setup.load()
    # Saving the iteration just resumed from replaces its step dir; stale partial dirs are removed.
    setup.save()
    out["resaved"] = (_latest(root), sorted(p.name for p in root.iterdir()))

    # Damage the newest step dir in several ways; each load falls back to the previous one.
    newest = root / "iter_0000003"
    backup = root.parent / "backup"
    shutil.copytree(newest, backup)
    shard = sorted(newest.glob("*.distcp"))[0]

    def damage(what):
        if what == "truncated shard":
            with open(shard, "r+b") as f:
                f.truncate(shard.stat().st_size // 2)
        elif what == "deleted shard":
            shard.unlink()
        elif what == "no completion record":
            (newest / "complete.json").unlink()
        elif what == "garbled metadata":
            meta = newest / ".metadata"
            meta.write_bytes(b"\0" * meta.stat().st_size)
        elif what == "garbled common state":  # same size: only reading it can tell
            common = newest / "common.pt"
            common.write_bytes(b"\0" * common.stat().st_size)
        elif what == "latest names a missing dir":
            (root / "latest").write_text(json.dumps({"step_dir": "iter_0000009", "iteration": 9}))
        elif what == "latest unreadable":
            (root / "latest").write_text("{not json")

    latest_text = (root / "latest").read_text()
    out["damaged"] = {}
    for what in ["truncated shard", "deleted shard", "no completion record", "garbled metadata",
                 "garbled common state", "latest names a missing dir", "latest unreadable"]:
        damage(what)
        out["damaged"][what] = setup.load()
        shutil.rmtree(newest)
        shutil.copytree(backup, newest)
        (root / "latest").write_text(latest_text)

    # Loading fails for a reason other than damage on disk: an error naming the step dir, no fallback
    # (before the fix, any exception fell back to iter_0000002 with a warning). An OS error while the
    # shards are read is damage: it falls back.
    def failing_load(error):
        def load(request, directory, **kwargs):
            if Path(directory).name == "iter_0000003":
                raise error
            return real_load(request, directory, **kwargs)
        return load

    real_load = dist_checkpointing.load
    out["load_errors"] = {}
    for what, error in [("injected KeyError", KeyError("injected: no such tensor")),
                        ("injected OSError", OSError(5, "injected: Input/output error"))]:
        checkpoint.dist_checkpointing.load = failing_load(error)
        try:
            out["load_errors"][what] = setup.load()
        except RuntimeError as exc:
            out["load_errors"][what] = f"RuntimeError: {exc}"
        finally:
            checkpoint.dist_checkpointing.load = real_load

    # A model that does not fit the (valid) checkpoint: a config error, not damage.
    other = Setup(config(save_dir, ["model.ffn_hidden_size=96"]), seed=2)  # the dense MLP is wider
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            other.load()
        except RuntimeError as exc:
            out["other_shape"] = str(exc)
    out["other_shape_warnings"] = [str(w.message) for w in caught if w.category.__name__ == "CheckpointWarning"]

    # Every step dir damaged: an error, not a silent fresh start.
    for step in root.glob("iter_???????"):
        (step / "complete.json").unlink()
    try:
        setup.load()
    except RuntimeError as exc:
        out["all_damaged"] = str(exc)
    return out


# ------------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def file_scenarios(tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("files") / "ckpt"
    return run_ranks(rank_file_scenarios, 1, str(save_dir), env=RANK_ENV)[0]


def test_latest_marker_written_last_and_keep_last(file_scenarios):
    assert file_scenarios["empty"] == (None, [])
    # while a step is written: staged under .partial, no completion record, `latest` still the previous step
    assert file_scenarios["seen_during_save"] == [
        ("iter_0000001.partial", None, False),
        ("iter_0000002.partial", "iter_0000001", False),
        ("iter_0000003.partial", "iter_0000002", False),
    ]
    assert file_scenarios["listings"] == [
        ("iter_0000001", ["iter_0000001", "latest"]),
        ("iter_0000002", ["iter_0000001", "iter_0000002", "latest"]),
        ("iter_0000003", ["iter_0000002", "iter_0000003", "latest"]),  # keep_last=2
    ]


def test_crash_mid_save_keeps_previous_checkpoint(file_scenarios):
    assert file_scenarios["crashed"]
    assert file_scenarios["after_crash"] == (
        "iter_0000003", ["iter_0000002", "iter_0000003", "iter_0000004.partial", "latest"]
    )
    (iteration, _), caught = file_scenarios["load_after_crash"]
    assert iteration == 3 and caught == []
    assert file_scenarios["resaved"] == ("iter_0000003", ["iter_0000002", "iter_0000003", "latest"])


@pytest.mark.parametrize(
    "damage, expected, fallback",
    [
        ("truncated shard", "truncated", 2),
        ("deleted shard", "is missing", 2),
        ("no completion record", "no completion record", 2),
        ("garbled metadata", "unreadable checkpoint metadata", 2),
        ("garbled common state", "common.pt is unreadable", 2),  # same size: found only when read
        ("latest names a missing dir", "does not exist", 3),  # the newest valid one below it
    ],
)
def test_damaged_checkpoint_falls_back_with_warning(file_scenarios, damage, expected, fallback):
    (iteration, _), caught = file_scenarios["damaged"][damage]
    assert iteration == fallback
    assert any(expected in w for w in caught), caught


def test_unreadable_marker_uses_newest_valid_step(file_scenarios):
    (iteration, _), caught = file_scenarios["damaged"]["latest unreadable"]
    assert iteration == 3
    assert any("unreadable" in w for w in caught), caught


def test_no_valid_checkpoint_is_an_error(file_scenarios):
    assert "no usable checkpoint" in file_scenarios["all_damaged"]


def test_injected_load_error_raises_naming_the_step_dir(file_scenarios):
    """A failure that is no damage on disk raises at once, naming the step dir; no older checkpoint."""
    message = file_scenarios["load_errors"]["injected KeyError"]
    assert isinstance(message, str), f"fell back instead of raising: {message}"
    assert "could not load checkpoint" in message and "iter_0000003" in message and "injected" in message
    assert "no older checkpoint was tried" in message


def test_os_error_while_reading_shards_falls_back(file_scenarios):
    (iteration, _), caught = file_scenarios["load_errors"]["injected OSError"]
    assert iteration == 2
    assert any("iter_0000003 is unreadable" in w and "falling back" in w for w in caught), caught



def test_model_shape_mismatch_raises_without_fallback(file_scenarios):
    """A model that does not fit a valid checkpoint is a config error, not damage: the newest step dir
    is named with megatron's reason and nothing older is tried (before the fix: CheckpointException
    escaped the fallback unnamed)."""
    message = file_scenarios.get("other_shape")
    assert message is not None, "loading into a wider model did not raise"
    assert "could not load checkpoint" in message and "iter_0000003" in message and "iter_0000002" not in message
    assert "Global shape mismatch" in message and "linear_fc1" in message
    assert not any("falling back" in w for w in file_scenarios["other_shape_warnings"])
