"""A callback that samples this process's OS threads, RSS and open file descriptors during a fit.

For the soak tests (tests/test_soak.py). Framework-free on purpose (importing torch or TensorFlow
here would change what it measures). Every rank samples itself at fit start and at every epoch
end and rewrites resources_<rank>.json in `out_dir` after each sample, so the samples survive a
run that fails. `max_threads` is a guard for a leaking run: past it the callback records the
sample and stops training with an error, so a leak of thousands of threads fails fast instead
of slowing the machine down for minutes.
"""

from __future__ import annotations

import collections
import json
import os
import time

import unifit


def _status() -> dict[str, int]:
    found = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("Threads", "VmRSS"):
                found[key] = int(value.split()[0])  # VmRSS in kB
    return found


def thread_names() -> dict[str, int]:
    """OS thread names (comm) and how many of each: which pool grew, when something leaked."""
    names: collections.Counter[str] = collections.Counter()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names[f.read().strip()] += 1
        except OSError:  # the thread ended meanwhile
            pass
    return dict(names)


def fd_targets() -> dict[str, int]:
    """What the open descriptors point at, by kind (socket, pipe, anon_inode, or the file path)."""
    kinds: collections.Counter[str] = collections.Counter()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        kinds[target.split(":", 1)[0] if ":" in target else target] += 1
    return dict(kinds)


def sample() -> dict[str, float]:
    status = _status()
    return {
        "threads": status["Threads"],
        "rss_mb": status["VmRSS"] / 1024,
        "fds": len(os.listdir("/proc/self/fd")) - 1,
    }  # minus listdir's own descriptor


class ResourceSampler(unifit.Callback):
    """Writes {"rank", "samples": [{epoch, step, t, wall, threads, rss_mb, fds}, ...], details} per rank."""

    def __init__(self, out_dir: str, max_threads: int = 1000, details_at_epoch: int = 0) -> None:
        self.out_dir, self.max_threads, self.details_at_epoch = out_dir, max_threads, details_at_epoch
        self.samples: list[dict[str, float]] = []
        self.details: dict[str, dict] = {}
        self._t0 = time.monotonic()

    def _take(self, ctx, where: str) -> None:
        row = {
            "epoch": ctx.state.epoch,
            "step": ctx.state.global_step,
            "t": round(time.monotonic() - self._t0, 3),
            "wall": time.time(),
            "where": where,
            **sample(),
        }
        self.samples.append(row)
        if where == "fit_start" or ctx.state.epoch == self.details_at_epoch:
            self.details[f"epoch_{ctx.state.epoch}"] = {"threads": thread_names(), "fds": fd_targets()}
        if row["threads"] > self.max_threads:
            self.details["at_abort"] = {"threads": thread_names(), "fds": fd_targets()}
            self._write(ctx)
            raise RuntimeError(
                f"soak: {row['threads']} threads at epoch {ctx.state.epoch} (step {ctx.state.global_step}) "
                f"on rank {ctx.rank}, more than max_threads={self.max_threads}: threads are leaking"
            )
        self._write(ctx)

    def _write(self, ctx) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        path = os.path.join(self.out_dir, f"resources_{ctx.rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(
                {
                    "rank": ctx.rank,
                    "world_size": ctx.world_size,
                    "pid": os.getpid(),
                    "samples": self.samples,
                    "details": self.details,
                },
                f,
            )
        os.replace(path + ".tmp", path)

    def on_fit_start(self, ctx) -> None:
        self._take(ctx, "fit_start")

    def on_epoch_end(self, ctx) -> None:  # after the built-in checkpoint and TensorBoard callbacks
        self._take(ctx, "epoch_end")

    def on_fit_end(self, ctx) -> None:
        self.details["fit_end"] = {"threads": thread_names(), "fds": fd_targets()}
        self._write(ctx)
