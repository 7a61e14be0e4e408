"""Hand-built Chrome-trace events (Kineto's layout) for the profile tools' tests."""


def host_event(name, ts, dur, tid=1, cat="cpu_op", pid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}


def kernel_event(name, ts, dur, corr, stream=7):
    return host_event(name, ts, dur, tid=stream, cat="kernel", pid=0, correlation=corr, device=0, stream=stream)


def launch_event(ts, corr, tid=1, with_corr=True):
    return host_event("cudaLaunchKernel", ts, 2, tid=tid, cat="cuda_runtime",
                      **({"correlation": corr} if with_corr else {}))
