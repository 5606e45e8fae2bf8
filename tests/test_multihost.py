"""Real multi-host runs: every simulated host is a network namespace with its own address.

Two hosts (10.77.0.1 and 10.77.0.2 on a bridge, see tests/netns.py) run `unifit launch` as a user
would on two machines: ddp and smddp-like through torchrun's rendezvous (`--rdzv-endpoint`) and its
static form (`--master-addr/--master-port`), mwms with TF_CONFIG built by `--hosts`, horovod through
horovodrun over ssh (an sshd started inside the second host's namespace). Each run passes the
conformance checks that matter across hosts (disjoint shards, identical weights, exact metrics,
rank-0-only files on the shared directory, resume), and a host whose link goes down mid-run ends
every process of the job with a non-zero exit and one line saying what failed.

Needs root and `ip netns` (CI has both); elsewhere the tests skip with the reason. Marker: multihost,
registered in pyproject.toml
(`pytest -m multihost` runs only these, `-m "not multihost"` leaves them out).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, STRATEGY, metrics_lines, reports
from tests.netns import IFNAME, Cluster, unavailable

UNAVAILABLE = unavailable()
if UNAVAILABLE:
    print(f"tests/test_multihost.py skipped: {UNAVAILABLE}", file=sys.stderr)
pytestmark = [
    pytest.mark.launch,
    pytest.mark.multihost,
    pytest.mark.skipif(UNAVAILABLE is not None, reason=f"multi-host tests: {UNAVAILABLE}"),
]

N_TRAIN, N_VAL, BATCH = 64, 37, 8
PORT = 29400  # every host is a fresh namespace: fixed ports never collide with anything


@pytest.fixture
def cluster():
    with Cluster(2) as c:
        yield c


# ---- running a job on both hosts --------------------------------------------------------------------
def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {
        **os.environ,
        "PYTHONPATH": path,
        "OMP_NUM_THREADS": "1",
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "GLOO_SOCKET_IFNAME": IFNAME,  # gloo advertises this host's address, not 127.0.0.1
        **(extra or {}),
    }


def _fit_args(
    strategy: str,
    root: Path,
    epochs: int,
    callbacks: list[dict] | None = None,
    ckpt: str | None = None,
    extra: tuple[str, ...] = (),
) -> list[str]:
    """The probe of the strategy's row in helpers.STRATEGIES, without its one-host options (the hosts
    are the nodes here)."""
    case = STRATEGY[strategy]
    report = {"class_path": "tests.probe.callbacks.ProbeReport", "init_args": {"out_dir": str(root / "reports")}}
    args = [
        "-c",
        str(case.probe_yaml),
        "--trainer.strategy",
        case.strategy,
        "--trainer.root_dir",
        str(root),
        "--trainer.max_epochs",
        str(epochs),
        "--trainer.callbacks",
        json.dumps([report, *(callbacks or [])]),
        *extra,
    ]
    return args + (["--ckpt-path", ckpt] if ckpt else [])


def start(
    cluster: Cluster,
    root: Path,
    per_host: dict[int, list[str]],
    fit_args: list[str],
    name: str,
    env: dict[str, str] | None = None,
) -> dict[int, subprocess.Popen]:
    """`unifit launch <per_host[h]> <fit_args>` on each host h, its output in root/<name>-h<h>.log."""
    root.mkdir(parents=True, exist_ok=True)
    return {
        host: cluster.popen(
            host,
            [sys.executable, "-m", "unifit", "launch", *launch_args, *fit_args],
            log=root / f"{name}-h{host}.log",
            env=_env(env),
            cwd=REPO,
        )
        for host, launch_args in per_host.items()
    }


def wait(procs: dict[int, subprocess.Popen], timeout: float) -> dict[int, int]:
    deadline = time.monotonic() + timeout
    codes = {}
    for host, proc in procs.items():
        try:
            codes[host] = proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            codes[host] = None
    return codes


def logs(root: Path, name: str) -> str:
    return "\n".join(f"==== {p.name}\n{p.read_text(errors='replace')}" for p in sorted(root.glob(f"{name}-h*.log")))


def run_job(
    cluster: Cluster,
    root: Path,
    per_host: dict[int, list[str]],
    fit_args: list[str],
    name: str,
    timeout: float = 150,
    env: dict[str, str] | None = None,
) -> str:
    """Start the job on every host, wait for all, assert each exited 0; returns the hosts' output."""
    t0 = time.monotonic()
    codes = wait(start(cluster, root, per_host, fit_args, name, env=env), timeout)
    out = logs(root, name)
    print(f"{name}: {time.monotonic() - t0:.1f} s, exit codes {codes}")
    assert all(code == 0 for code in codes.values()), f"{name}: exit codes {codes}\n{out[-8000:]}"
    return out


# ---- the checks that matter across hosts ------------------------------------------------------------
def check_job(root: Path, world: int, epochs: range, checkpoints: list[int]) -> list[dict]:
    """Every rank reported; shards disjoint and complete; weights, metrics and step identical on every
    rank; validation metrics exact; rank-0-only files written once on the shared directory."""
    got = reports(root)
    assert [r["rank"] for r in got] == list(range(world)), [r["rank"] for r in got]
    assert {r["world_size"] for r in got} == {world}
    for epoch in epochs:
        shards = [r["seen"][f"train_epoch_{epoch}"] for r in got]
        assert sorted(i for shard in shards for i in shard) == list(range(N_TRAIN)), f"epoch {epoch}: {shards}"
    per_rank_val = [len(r["seen"]["val"]) // len(epochs) for r in got]
    assert sorted(i for r in got for i in r["seen"]["val"][: per_rank_val[r["rank"]]]) == list(range(N_VAL))
    assert len({r["weights_sha256"] for r in got}) == 1, [r["weights_sha256"] for r in got]
    assert all(r["metrics"] == got[0]["metrics"] for r in got)
    assert len({r["global_step"] for r in got}) == 1
    metrics = got[0]["metrics"]
    assert metrics["val/index_mean"] == pytest.approx((N_VAL - 1) / 2, abs=1e-12)
    expected = sum((rank + 1) * n for rank, n in enumerate(per_rank_val)) / N_VAL
    assert metrics["val/rank_plus_one"] == pytest.approx(expected, abs=1e-12)
    steps = N_TRAIN // (BATCH * world)
    names = sorted(p.name for p in (root / "checkpoints").iterdir())
    assert names == [f"epoch={e:04d}-step={e * steps:07d}" for e in checkpoints] + ["last.json"], names
    lines = metrics_lines(root)
    assert [line["epoch"] for line in lines] == list(range(1, epochs.stop + 1)), lines  # once, not once per host
    assert (root / "config.yaml").is_file()
    return got


def check_resumed(root: Path, out: str, epoch: int) -> None:
    assert "resumed from" in out, out[-4000:]
    assert json.loads((root / "checkpoints" / "last.json").read_text())["epoch"] == epoch


def assert_nothing_left(cluster: Cluster, root: Path, keep: tuple[int, ...] = ()) -> None:
    left = [pid for pid in cluster.pids() if pid not in keep]
    pgrep = subprocess.run(["pgrep", "-f", str(root)], capture_output=True, text=True, timeout=30).stdout.split()
    assert not left and not pgrep, f"processes left: {left} {pgrep}\n" + "\n".join(
        Path(f"/proc/{p}/cmdline").read_text().replace("\0", " ")
        for p in left + [int(p) for p in pgrep]
        if Path(f"/proc/{p}").exists()
    )


# ---- ddp and smddp-like: torchrun on each host -------------------------------------------------------
def torchrun_hosts(cluster: Cluster, nproc: int, form: str) -> dict[int, list[str]]:
    if form == "rdzv":
        rendezvous = ["--rdzv-endpoint", f"{cluster.addresses[0]}:{PORT}"]
    else:
        rendezvous = ["--master-addr", cluster.addresses[0], "--master-port", str(PORT)]
    return {h: ["--nproc-per-node", str(nproc), "--nnodes", "2", "--node-rank", str(h), *rendezvous] for h in (0, 1)}


@pytest.mark.timeout(300)
def test_ddp_two_hosts_rendezvous_then_static_resume(cluster, tmp_path):
    """2 hosts x 2 ranks: trained through the c10d rendezvous, resumed through the static master address."""
    root = tmp_path / "ddp"
    run_job(cluster, root, torchrun_hosts(cluster, 2, "rdzv"), _fit_args("ddp", root, 2), "first")
    check_job(root, 4, range(2), [1, 2])
    shutil.rmtree(root / "reports")  # the resumed run writes its own
    out = run_job(cluster, root, torchrun_hosts(cluster, 2, "static"), _fit_args("ddp", root, 3, ckpt="last"), "resume")
    check_resumed(root, out, 3)
    got = check_job_after_resume(root, 4)
    assert got[0]["global_step"] == 3 * 2
    assert_nothing_left(cluster, root)


def check_job_after_resume(root: Path, world: int) -> list[dict]:
    """The resumed run saw epoch 3 only: its shards and the shared files of all three epochs."""
    got = reports(root)
    assert [r["rank"] for r in got] == list(range(world))
    shards = [r["seen"]["train_epoch_2"] for r in got]
    assert sorted(i for shard in shards for i in shard) == list(range(N_TRAIN))
    assert "train_epoch_1" not in got[0]["seen"]  # continued, not started over
    assert len({r["weights_sha256"] for r in got}) == 1
    assert all(r["metrics"] == got[0]["metrics"] for r in got)
    assert got[0]["metrics"]["val/index_mean"] == pytest.approx((N_VAL - 1) / 2, abs=1e-12)
    assert [line["epoch"] for line in metrics_lines(root)] == [1, 2, 3]
    return got


@pytest.mark.timeout(300)
def test_smddp_like_two_hosts_hierarchy_sees_two_nodes(cluster, tmp_path):
    """2 hosts x 2 ranks: the topology comes from the launcher (LOCAL_WORLD_SIZE 2 on each host). Resume
    across hosts goes through the same torchrun launch as ddp's, tested above."""
    root = tmp_path / "smddp"
    out = run_job(cluster, root, torchrun_hosts(cluster, 2, "static"), _fit_args("smddp-like", root, 2), "first")
    assert "hierarchical allreduce, 2 node(s) x 2 rank(s)" in out, out[-4000:]
    check_job(root, 4, range(2), [1, 2])
    assert_nothing_left(cluster, root)


@pytest.mark.timeout(300)
def test_fsdp_two_hosts_hybrid_then_full_sharding_resume(cluster, tmp_path):
    """2 hosts x 2 ranks: hybrid sharding (shard within a host, replicate across hosts), every rank
    writing its shards to the shared directory; resumed with full sharding over all 4 ranks (DCP reshards)."""
    root = tmp_path / "fsdp"
    hybrid = ("--trainer.strategy_options", "{sharding: hybrid}", "--trainer.export_dir", str(root / "export"))
    out = run_job(cluster, root, torchrun_hosts(cluster, 2, "rdzv"), _fit_args("fsdp", root, 2, extra=hybrid), "first")
    assert "fsdp: hybrid sharding, 2 node(s) x 2 rank(s)" in out, out[-4000:]
    trained = check_job(root, 4, range(2), [1, 2])
    # the export, gathered from the 2-D mesh's shards through host memory: the trained model, whole
    import torch

    from tests.probe.probe import ProbeModule, _digest

    exported = ProbeModule(n_train=64, n_val=37)
    exported.load_state_dict(torch.load(root / "export" / "model.pt", weights_only=True))
    assert _digest(exported) == trained[0]["weights_sha256"]
    assert len(list((root / "checkpoints" / "epoch=0002-step=0000004" / "shards").glob("__*_0.distcp"))) == 4
    shutil.rmtree(root / "reports")
    out = run_job(
        cluster, root, torchrun_hosts(cluster, 2, "static"), _fit_args("fsdp", root, 3, ckpt="last"), "resume"
    )
    assert "fsdp: full sharding, 4 rank(s)" in out, out[-4000:]
    check_resumed(root, out, 3)
    check_job_after_resume(root, 4)
    assert_nothing_left(cluster, root)


@pytest.mark.timeout(420)
def test_model_parallel_two_hosts_splits_layers_inside_each_host(cluster, tmp_path):
    """2 hosts x 2 ranks, tensor_parallel auto: 2 data-parallel x 2 tensor-parallel: each host's ranks split every
    layer of the small GPT (the tensor-parallel collectives stay on a host's own link), the hosts hold the replicas
    (FSDP2 across); then 2 pipeline stages, one per host; both the same weights as ddp on 2 ranks of one host."""
    from tests.helpers import assert_ok, run_unifit
    from tests.probe.tiny_gpt import PLAN
    from tests.test_model_parallel import YAML

    one = tmp_path / "ddp"  # the same replicas on one host, unsplit
    assert_ok(
        run_unifit(
            "launch", "--nproc-per-node", "2", "-c", str(YAML), "--trainer.strategy", "ddp",
            "--trainer.root_dir", str(one), "--trainer.export_dir", str(one / "export"), timeout=120,
        )
    )  # fmt: skip
    root = tmp_path / "tp"
    options = json.dumps({"tensor_parallel": "auto", "plan": PLAN})  # a host's 2 ranks split each layer
    fit_args = ["-c", str(YAML), "--trainer.strategy", "model-parallel", "--trainer.strategy_options", options]
    fit_args += ["--trainer.root_dir", str(root), "--trainer.export_dir", str(root / "export")]
    out = run_job(cluster, root, torchrun_hosts(cluster, 2, "rdzv"), fit_args, "tp")
    assert "4 rank(s) = 2 data-parallel x 2 tensor-parallel" in out, out[-4000:]
    import torch

    split, whole = (torch.load(r / "export" / "model.pt", weights_only=True) for r in (root, one))
    assert max((split[k] - whole[k]).abs().max().item() for k in whole) < 2e-5
    lines = metrics_lines(root)
    assert [line["epoch"] for line in lines] == [1, 2, 3]  # written once, by rank 0's host
    assert all(line["samples_seen"] == 64.0 for line in lines)
    assert_nothing_left(cluster, root)
    # pipeline stages across the hosts (stage 0 on host 0's ranks, stage 1 on host 1's: only activations and their
    # gradients cross), each stage's 2 replicas inside a host
    staged = tmp_path / "pp"
    options = json.dumps({"pipeline_parallel": 2})
    fit_args = ["-c", str(YAML), "--trainer.strategy", "model-parallel", "--trainer.strategy_options", options]
    fit_args += ["--trainer.root_dir", str(staged), "--trainer.export_dir", str(staged / "export")]
    out = run_job(cluster, staged, torchrun_hosts(cluster, 2, "static"), fit_args, "pp")
    assert "4 rank(s) = 2 pipeline stages x 2 data-parallel" in out, out[-4000:]
    split = torch.load(staged / "export" / "model.pt", weights_only=True)
    assert max((split[k] - whole[k]).abs().max().item() for k in whole) < 2e-5
    assert all(line["samples_seen"] == 64.0 for line in metrics_lines(staged))
    assert_nothing_left(cluster, staged)


# ---- a host loses its network mid-run ---------------------------------------------------------------
def cut_mid_run(
    cluster: Cluster,
    root: Path,
    per_host: dict[int, list[str]],
    fit_args: list[str],
    env: dict[str, str] | None = None,
    keep: tuple[int, ...] = (),
    settle_s: float = 1.0,
    after_epoch: int = 1,
) -> str:
    """Start the job, cut host 1's link once epoch `after_epoch`'s checkpoint is written, and require
    every process to end, non-zero, within 60 s, with a line saying what failed."""
    procs = start(cluster, root, per_host, fit_args, "cut", env=env)
    deadline = time.monotonic() + 150
    while not list(root.glob(f"checkpoints/epoch={after_epoch:04d}*")):  # that epoch is over, checkpointed
        assert all(p.poll() is None for p in procs.values()), logs(root, "cut")[-6000:]
        assert time.monotonic() < deadline, "no epoch finished\n" + logs(root, "cut")[-6000:]
        time.sleep(0.1)
    # into the next epoch's training steps, past the checkpoint's barrier: with ddp and smddp-like, a link
    # cut *during* that barrier leaves the cut host's ranks waiting in it for torch's default 30 min (the
    # barrier group is created without a timeout; known limitation, see docs/multi-host.md)
    time.sleep(settle_s)
    cluster.cut(1)
    cut_at = time.monotonic()
    codes = wait(procs, 60)
    took = time.monotonic() - cut_at
    out = logs(root, "cut")
    print(f"cut: every launcher ended {took:.1f} s after the link went down, exit codes {codes}")
    assert all(code not in (None, 0) for code in codes.values()), f"exit codes {codes} ({took:.0f} s)\n{out[-8000:]}"
    deadline = time.monotonic() + 10  # the launchers are gone; give their last children a moment
    while [p for p in cluster.pids() if p not in keep] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert time.monotonic() - cut_at < 60, f"processes still running 60 s after the cut: {cluster.pids()}"
    assert_nothing_left(cluster, root, keep)
    for host in per_host:  # each host's launcher says what failed, in one line
        text = (root / f"cut-h{host}.log").read_text(errors="replace")
        assert "unifit: launch failed" in text, f"host {host}: no failure line\n{text[-4000:]}"
    return out


SLOW = [{"class_path": "tests.probe.callbacks.SlowSteps", "init_args": {"seconds": 1.0}}]
TIMEOUT = ("--trainer.collective_timeout_s", "10")


@pytest.mark.timeout(300)
def test_ddp_host_cut_mid_run_ends_every_process_with_one_line(cluster, tmp_path):
    root = tmp_path / "ddp-cut"
    # gloo's timeout (twice this) is most of the wait after the cut: 5 s ends it ~10 s sooner than 10 s does
    fast = ("--trainer.collective_timeout_s", "5")
    cut_mid_run(
        cluster, root, torchrun_hosts(cluster, 2, "rdzv"), _fit_args("ddp", root, 50, callbacks=SLOW, extra=fast)
    )


# ---- mwms: one TF_CONFIG worker per host, the same port on both ---------------------------------------
def mwms_hosts(cluster: Cluster) -> dict[int, list[str]]:
    return {
        h: ["--hosts", ",".join(cluster.addresses), "--node-rank", str(h), "--master-port", str(PORT)] for h in (0, 1)
    }


def resume_then_cut(
    cluster: Cluster,
    root: Path,
    per_host: dict[int, list[str]],
    strategy: str,
    world: int,
    env: dict[str, str] | None = None,
    keep: tuple[int, ...] = (),
) -> None:
    """Two launches: 2 epochs, checked; then a resumed run that continues (epoch 3 follows epoch 2)
    until host 1's link is cut in its second epoch, which must end every process with one line."""
    run_job(cluster, root, per_host, _fit_args(strategy, root, 2, extra=TIMEOUT), "first", env=env)
    check_job(root, world, range(2), [1, 2])
    out = cut_mid_run(
        cluster,
        root,
        per_host,
        _fit_args(strategy, root, 500, ckpt="last", extra=TIMEOUT),
        env=env,
        keep=keep,
        settle_s=0.5,
        after_epoch=4,
    )
    assert "resumed from" in out, out[-4000:]
    epochs = [line["epoch"] for line in metrics_lines(root)]
    assert epochs[:4] == [1, 2, 3, 4], epochs  # continued from the checkpoint of epoch 2, once per job
    assert json.loads((root / "checkpoints" / "last.json").read_text())["epoch"] >= 4


@pytest.mark.tf
@pytest.mark.timeout(300)
def test_mwms_two_hosts_same_port_resume_and_cut(cluster, tmp_path):
    """One worker per host on the same port; resumed; then host 1 loses its network mid-run."""
    resume_then_cut(cluster, tmp_path / "mwms", mwms_hosts(cluster), "mwms", 2)


# ---- horovod: horovodrun on the first host, over ssh to the second ----------------------------------
def sshd_path() -> str | None:
    return shutil.which("sshd") or next(
        (p for p in ("/usr/sbin/sshd", "/usr/local/sbin/sshd") if Path(p).exists()), None
    )


def start_sshd(cluster: Cluster, host: int, where: Path) -> tuple[dict[str, str], int]:
    """An sshd inside `host`'s namespace that accepts a throwaway key; returns the environment that makes
    plain `ssh ADDRESS` use that key (an `ssh` wrapper first on PATH, standing in for ~/.ssh/config)
    and the sshd's pid. horovodrun starts the remote host's ranks with `ssh ADDRESS 'cd DIR; ... python ...'`."""
    sshd = sshd_path()
    where.mkdir(parents=True, exist_ok=True)
    for key in ("host_key", "id"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(where / key)], check=True, timeout=30)
    (where / "authorized_keys").write_text((where / "id.pub").read_text())
    (where / "sshd_config").write_text(
        f"ListenAddress {cluster.addresses[host]}\nPort 22\nHostKey {where / 'host_key'}\n"
        f"AuthorizedKeysFile {where / 'authorized_keys'}\nPidFile {where / 'sshd.pid'}\n"
        "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "UsePAM no\nStrictModes no\nPrintMotd no\n"
        "ClientAliveInterval 2\nClientAliveCountMax 3\n"
    )  # a session whose client is cut off ends
    (where / "ssh_config").write_text(
        f"Host *\n  IdentityFile {where / 'id'}\n  IdentitiesOnly yes\n  UserKnownHostsFile {where / 'known_hosts'}\n"
        "  StrictHostKeyChecking no\n  BatchMode yes\n  LogLevel ERROR\n"
    )
    bin_dir = where / "bin"
    bin_dir.mkdir(exist_ok=True)
    wrapper = bin_dir / "ssh"
    wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {where / "ssh_config"} "$@"\n')
    wrapper.chmod(0o755)
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
    proc = cluster.popen(host, [sshd, "-D", "-e", "-f", str(where / "sshd_config")], log=where / "sshd.log")
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    deadline = time.monotonic() + 20
    while True:  # wait until the key is accepted, from the first host
        probe = cluster.run(0, str(wrapper), cluster.addresses[host], "true", check=False)
        if probe.returncode == 0:
            return env, proc.pid
        assert proc.poll() is None and time.monotonic() < deadline, (
            f"sshd in {cluster.namespaces[host]} did not accept the key: {probe.stderr}\n"
            f"{(where / 'sshd.log').read_text()}"
        )
        time.sleep(0.3)


HOROVOD_SKIP = (
    None
    if sshd_path() and shutil.which("ssh") and shutil.which("ssh-keygen")
    else (
        "horovodrun reaches the second host over ssh and no sshd/ssh/ssh-keygen is installed here "
        "(Debian: apt-get install openssh-server openssh-client)"
    )
)
if HOROVOD_SKIP:
    print(f"tests/test_multihost.py: horovod cases skipped: {HOROVOD_SKIP}", file=sys.stderr)


def horovod_hosts(cluster: Cluster) -> dict[int, list[str]]:
    return {0: ["--hosts", ",".join(cluster.addresses), "--nproc-per-node", "1"]}  # horovodrun starts both


@pytest.mark.timeout(300)
@pytest.mark.skipif(HOROVOD_SKIP is not None, reason=HOROVOD_SKIP or "")
def test_horovod_two_hosts_over_ssh_resume_and_cut(tmp_path):
    """horovodrun on host 0 starts host 1's rank over ssh; resumed; then host 1 loses its network mid-run."""
    # Horovod 0.28.1 (gloo) binds its process-set contexts to the address of the machine's host name,
    # not HOROVOD_GLOO_IFACE: each host's name must resolve to its own address, as on real machines
    with Cluster(2, own_hosts_file=True) as cluster:
        env, sshd = start_sshd(cluster, 1, tmp_path / "ssh")
        resume_then_cut(cluster, tmp_path / "horovod", horovod_hosts(cluster), "horovod", 2, env=env, keep=(sshd,))
