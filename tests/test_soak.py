"""benchmarks/soak.py on CPU with the tiny model and a few steps: it runs, records every step and every
save, and its verdict flags growth (checked on made-up samples against hand-computed windows)."""

import json
import sys
import time

import pytest

from tests.distributed import run_command_line
from tests.test_training import ROOT


def test_soak_smoke_on_cpu(tmp_path):
    out = tmp_path / "soak.json"
    # `python benchmarks/soak.py ...` as its main() in a process forked like a rank (torch and megatron-core imported)
    argv = ["--config", "configs/models/glm5-tiny.yaml", "--steps", "4", "--interval", "2", "--warmup", "1",
            "--out", str(out), "optimizer.lr_warmup_iters=1", "data.seq_length=64"]
    began = time.time()
    proc = run_command_line("benchmarks.soak", argv, {"OMP_NUM_THREADS": "1"}, cwd=str(ROOT))
    ended = time.time()
    assert proc["code"] in (0, 1), proc["stderr"][-3000:]
    result = json.loads(out.read_text())
    assert [s["step"] for s in result["samples"]] == [1, 2, 3, 4]
    assert [s["step"] for s in result["saves"]] == [2, 4] and all(s["blocked_s"] > 0 for s in result["saves"])
    for s in result["saves"]:  # blocked = waiting for the previous save + this save's own (`Trainer.save` splits it)
        assert s["waited_s"] >= 0 and s["staged_s"] > 0
        assert s["blocked_s"] == pytest.approx(s["waited_s"] + s["staged_s"])
    for part in ("waited_s", "staged_s", "blocked_s"):
        values = [s[part] for s in result["saves"]]
        assert result[f"save_{part}"] == {"median": pytest.approx(sum(values) / 2), "all": values}
    assert result["async_save"] is True and result["verdict"]["pass"] == (proc["code"] == 0)
    assert result["complete"] is True and not out.with_name("soak.json.tmp").exists()
    times = [s["unix_time"] for s in result["samples"]]
    assert began < times[0] < times[-1] < ended and times == sorted(times)  # the steps' own clock times
    for s in result["samples"]:
        assert s["host_rss_gib"] == pytest.approx(s["host_rss_anon_gib"] + s["host_rss_file_gib"], rel=0.02)
        assert s["host_rss_gib"] > 0 and s["open_files"] > 0 and s["threads"] > 0 and s["tokens_per_sec"] > 0
        assert isinstance(s["save_in_flight"], bool) and "descriptors" not in s
        assert 0 < s["main_thread_cpu_s"] and 0 < s["wall_s"] and s["gc_s"] >= 0 and s["gc_collections"] >= 0
    # wall seconds between samples add up to the run's clock between the first and last sample
    assert sum(s["wall_s"] for s in result["samples"][1:]) == pytest.approx(times[-1] - times[0], abs=0.05)
    # never before the first save is published (a step after it at the earliest), and 10 steps more
    assert result["warmup"] >= result["saves"][0]["step"] + 1 + 10
    assert "soak PASS" in proc["stdout"] or "soak FAIL" in proc["stdout"]
    assert f"waiting for the previous save {result['save_waited_s']['median']} s" in proc["stdout"]


def test_verdict_windows_and_limits():
    sys.path.insert(0, str(ROOT))
    from benchmarks.soak import verdict

    def samples(rss_last, threads_last, speed_last):
        rows = []
        for step in range(1, 41):  # warm-up 20: windows of 2 steps, 21-22 and 39-40
            late = step >= 39
            rows.append({"step": step, "gpu_allocated_gib": 1.0, "gpu_reserved_gib": 2.0,
                         "host_rss_gib": rss_last if late else 10.0, "open_files": 30,
                         "threads": threads_last if late else 12, "tokens_per_sec": speed_last if late else 100.0})
        return rows

    flat = verdict(samples(10.05, 12, 97.0), 20, 0.01, 0.05)
    assert flat["pass"] and flat["first_window"] == [21, 22] and flat["last_window"] == [39, 40]
    grown = verdict(samples(10.2, 12, 100.0), 20, 0.01, 0.05)
    assert not grown["pass"] and "host_rss_gib grew +2.00%" in grown["why"]
    assert "threads grew" in verdict(samples(10.0, 13, 100.0), 20, 0.01, 0.05)["why"]
    assert "tokens/s fell -10.00%" in verdict(samples(10.0, 12, 90.0), 20, 0.01, 0.05)["why"]


def test_tokens_per_sec_window_medians_show_the_runs_spread():
    sys.path.insert(0, str(ROOT))
    from benchmarks.soak import verdict

    # warm-up 10, then 50 steps: windows of 5; speeds by window 100, 80, 90, ... (the middle ones 80-95), last 85
    by_window = [100, 80, 90, 95, 88, 92, 81, 94, 86, 85]
    rows = [{"step": step, "gpu_allocated_gib": 1.0, "gpu_reserved_gib": 2.0, "host_rss_gib": 1.0, "open_files": 3,
             "threads": 2, "tokens_per_sec": by_window[(step - 11) // 5] + (step % 5) * 0.1 if step > 10 else 1.0}
            for step in range(1, 61)]
    got = verdict(rows, 10, 0.01, 0.05)
    assert got["checks"]["tokens_per_sec"]["window_medians"] == pytest.approx(
        [w + 0.2 for w in by_window])  # the median of w + (0.1, 0.2, 0.3, 0.4, 0.0)
    assert not got["pass"] and "the medians of the windows between ranged 80-95" in got["why"]
    # 52 steps after the warm-up: the verdict's last window is steps 58-62; the windows between end before it
    rows += [{**rows[-1], "step": step, "tokens_per_sec": 85.0} for step in (61, 62)]
    got = verdict(rows, 10, 0.01, 0.05)
    assert got["window_steps"] == 5 and got["last_window"] == [58, 62]
    assert got["checks"]["tokens_per_sec"]["window_medians"] == pytest.approx(
        [w + 0.2 for w in by_window[:-1]] + [85.0])  # 85.3, 85.4, 85.0, 85.0, 85.0 at steps 58-62


def test_partial_result_and_atomic_write(tmp_path):
    sys.path.insert(0, str(ROOT))
    from benchmarks.soak import partial_result, write_json

    samples = [{"step": 1, "open_files": 2, "descriptors": ["pipe:[1]", "/dev/null"]}]
    saves = [{"step": 1, "blocked_s": 0.5}]
    got = partial_result({"config": "c"}, samples, saves)
    assert got == {"config": "c", "complete": False, "saves": saves, "samples": [{"step": 1, "open_files": 2}]}
    assert samples[0]["descriptors"]  # the verdict still needs them
    out = tmp_path / "soak.json"
    write_json(out, got)
    write_json(out, {**got, "complete": True})
    assert json.loads(out.read_text())["complete"] is True and [p.name for p in tmp_path.iterdir()] == ["soak.json"]


def test_warmup_covers_the_first_save_until_it_is_published():
    sys.path.insert(0, str(ROOT))
    from benchmarks.soak import warmup_steps

    def samples(in_flight):  # a save at step 10, written in the background over the steps `in_flight`
        return [{"step": step, "save_in_flight": step in in_flight} for step in range(1, 101)]

    assert warmup_steps(samples(range(11, 48)), [10, 50], 0) == 58  # published after step 47: seen at 48, 10 more
    assert warmup_steps(samples(range(11, 48)), [10, 50], 80) == 80  # --warmup: at least
    assert warmup_steps(samples(()), [10, 50], 0) == 21  # synchronous: published with the save
    assert warmup_steps(samples(range(11, 101)), [10], 0) == 100  # never published: no window after it
    assert warmup_steps(samples(()), [], 7) == 7


def test_descriptor_growth_is_named_by_kind():
    sys.path.insert(0, str(ROOT))
    from benchmarks.soak import descriptor_change, verdict

    before = ["pipe:[11]", "/data/a.bin", "socket:[12]", "/dev/null"]
    after = ["pipe:[21]", "pipe:[22]", "/data/a.bin", "/dev/null", "/ckpt/iter_0000200/__0_0.distcp"]
    assert descriptor_change(before, after) == {
        "added": {"pipe:[]": 1, "/ckpt/iter_0000200/__0_0.distcp": 1}, "removed": {"socket:[]": 1}}
    rows = [{"step": step, "gpu_allocated_gib": 1.0, "gpu_reserved_gib": 2.0, "host_rss_gib": 1.0,
             "threads": 5, "tokens_per_sec": 10.0, "open_files": len(after if step > 30 else before),
             "descriptors": after if step > 30 else before} for step in range(1, 41)]
    grown = verdict(rows, 20, 0.01, 0.05)
    assert not grown["pass"] and "open_files grew" in grown["why"] and "'pipe:[]': 1" in grown["why"]
    assert grown["checks"]["open_files"]["removed"] == {"socket:[]": 1}


def test_host_clock_counts_collections_and_main_thread_cpu():
    """Against what the test itself does between two `take`s: three forced collections, a 0.2 s busy loop, then a
    0.4 s wait in which a helper thread spins for 0.3 s. The main thread's CPU seconds count the loop and not the
    wait nor the helper, whose CPU the process clock does count (other threads of the suite may add to it)."""
    import gc
    import threading

    from benchmarks.soak import HostClock

    def spin(seconds):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    clock = HostClock()
    try:
        clock.take()
        gc.disable()  # only the forced collections are counted
        try:
            begin = time.process_time()
            for _ in range(3):
                gc.collect()
            spin(0.2)
            helper = threading.Thread(target=spin, args=(0.3,))
            helper.start()
            time.sleep(0.4)
            helper.join()
            got = clock.take()
            process = time.process_time() - begin
        finally:
            gc.enable()
        # every generation's collection reports start and stop: gc.collect() is one full (generation 2) collection
        assert got["gc_collections"] == 3 and got["gc_s"] > 0
        assert got["main_thread_cpu_s"] >= 0.05  # the loop: 0.2 s of wall time, on a core most of it even when busy
        assert got["main_thread_cpu_s"] <= process - 0.1  # not the helper's spinning (0.3 s, at least 0.1 on a core)
        assert got["wall_s"] >= 0.6 and got["main_thread_cpu_s"] <= got["wall_s"] - 0.3  # nor the 0.4 s wait
        assert clock.take()["gc_collections"] == 0  # reset by take
    finally:
        clock.close()
    gc.collect()
    assert clock.take()["gc_collections"] == 0  # closed: collections no longer counted


def test_host_speed_writes_a_rate_per_period(tmp_path):
    from benchmarks.host_speed import main

    out = tmp_path / "host.csv"
    assert main(["--seconds", "1.0", "--period", "0.25", "--out", str(out)]) == 0
    rows = out.read_text().splitlines()
    assert rows[0] == "unix_time,units_per_s" and 3 <= len(rows) - 1 <= 5
    times, rates = zip(*((float(a), float(b)) for a, b in (r.split(",") for r in rows[1:])))
    assert list(times) == sorted(times) and min(rates) > 0
    # against the test's own timing of the same unit: within 3x (the core is shared with whatever else runs)
    from benchmarks.host_speed import unit

    start = time.perf_counter()
    for _ in range(200):
        unit()
    own = 200 / (time.perf_counter() - start)
    assert own / 3 < sorted(rates)[len(rates) // 2] < own * 3


def test_recording_a_step_does_not_grow_the_process(tmp_path):
    """The soak's own bookkeeping must not be what it measures: with 100 more descriptors open (a trainer has
    ~140), 200 recorded steps hold at most 1.5 KB each (Python's traced memory), where a new list of the
    descriptors per step measured 13.9 KB."""
    import tracemalloc

    from benchmarks.soak import sample

    files = [open(tmp_path / f"f{i}", "w") for i in range(100)]
    try:
        samples = [{"step": 0, **sample({"tokens_per_sec": 1.0}, False)}]
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for step in range(1, 201):
                samples.append({"step": step, **sample({"tokens_per_sec": 1.0}, False, samples[-1]["descriptors"])})
            per_step = (tracemalloc.get_traced_memory()[0] - before) / 200
        finally:
            tracemalloc.stop()
    finally:
        for f in files:
            f.close()
    assert per_step < 1536, f"{per_step:.0f} bytes a step"
    assert samples[-1]["open_files"] >= 100 and samples[-1]["host_units_per_s"] > 0


def test_heap_window_is_checked_before_the_run(capsys):
    """A bad --heap-window is one line from argparse, before any model or process group."""
    from benchmarks.heap_profile import parse_window
    from benchmarks.soak import main

    assert parse_window("200:450") == (200, 450)
    for bad in ("200", "450:200", "a:b", "-1:5"):
        with pytest.raises(ValueError, match="--heap-window"):
            parse_window(bad)
    for argv, message in ((["--heap-window", "9:3"], "START < STOP"), (["--heap-window", "10:900"], "after --steps 500"),
                          ([], "START:STOP")):
        with pytest.raises(SystemExit):
            main(["--out", "x.json", "--steps", "500", "--heap-profile", "h.bin", *argv])
        assert message in capsys.readouterr().err
