"""Ray Train runs an experiment unchanged (unifit.ray): Ray's TorchTrainer starts 2 workers on gloo (ray.init with
2 CPUs), each runs `unifit fit` on Ray's ranks and process group, and the weights equal `unifit launch`'s of the
same experiment, bit for bit, under ddp and fsdp. Under ddp one worker is killed (kill -9) in the second epoch:
Ray's FailureConfig restarts the group, which continues from the last checkpoint reported and still ends with the
uninterrupted run's weights; the checkpoints Ray lists are unifit's, where unifit committed them.

Ray's own start-up costs ~6 s, each TorchTrainer's ~10-20 s on this 2-core machine: one driver process runs both."""

from __future__ import annotations

import json

import pytest

from tests.helpers import KERAS_PROBE_YAML, PROBE_YAML, reports, start_python, stop

pytest.importorskip("ray.train", reason="unifit[ray] (ray[train]) is not installed")


def _run(tmp_path, strategy: str, callbacks: list[dict], config=PROBE_YAML, **options) -> dict:
    report = {
        "class_path": "tests.probe.callbacks.ProbeReport",
        "init_args": {"out_dir": str(tmp_path / strategy / "reports")},
    }
    overrides = ["--trainer.strategy", strategy, "--trainer.callbacks", json.dumps([report, *callbacks])]
    return {
        "config": str(config),
        "overrides": overrides,
        "num_workers": 2,
        "storage_path": str(tmp_path / "storage"),
        "name": strategy,
        **options,
    }


def _drive(tmp_path, runs: list[dict], timeout: float) -> list[dict]:
    """Ray's results of `runs`, made by one driver process."""
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    driver = start_python("-m", "tests.probe.ray_driver", str(tmp_path / "runs.json"), str(tmp_path / "out.json"))
    out, err = stop(driver, timeout=timeout)
    assert driver.returncode == 0, err[-6000:]
    return json.loads((tmp_path / "out.json").read_text()) + [{"log": out + err}]


@pytest.mark.launch
@pytest.mark.timeout(600)
def test_ray_train_workers_equal_a_launch_and_a_killed_worker_resumes(tmp_path, reference_run, s3_endpoint, bucket):
    """ddp with a worker killed, its storage path on this machine; fsdp with its storage path on S3 (a moto server
    on 127.0.0.1: Ray and unifit both write there)."""
    reference_run.prefetch(["ddp", "fsdp"])
    kill = {"class_path": "tests.probe.callbacks.KillOnce", "init_args": {"marker": str(tmp_path / "killed")}}
    on_s3 = f"s3://{bucket}/ray-runs"
    runs = [_run(tmp_path, "ddp", [kill], max_failures=1), _run(tmp_path, "fsdp", [], storage_path=on_s3)]
    *results, log = _drive(tmp_path, runs, timeout=540)
    assert (tmp_path / "killed").exists(), "the worker was not killed"
    run_dirs = {"ddp": str(tmp_path / "storage" / "ddp"), "fsdp": f"{bucket}/ray-runs/fsdp"}  # pyarrow's S3 paths
    for strategy, result in zip(("ddp", "fsdp"), results, strict=True):
        assert result["error"] is None, result
        mine, theirs = reports(tmp_path / strategy), reports(reference_run(strategy))
        assert [r["weights_sha256"] for r in mine] == [r["weights_sha256"] for r in theirs], strategy
        assert result["metrics"]["epoch"] == 3 and result["metrics"]["val/loss"] == theirs[0]["metrics"]["val/loss"]
        # the checkpoints Ray lists: unifit's own, committed in the run directory on Ray's storage path
        names = [path.rsplit("/", 1)[-1] for path in result["checkpoints"]]
        assert all(path.startswith(f"{run_dirs[strategy]}/checkpoints/") for path in result["checkpoints"]), result
        assert names[-1] == "epoch=0003-step=0000012" and len(set(names)) == len(names), names
        assert result["checkpoint"] == result["checkpoints"][-1]
    stored = s3_endpoint.fs().ls(f"{bucket}/ray-runs/fsdp/checkpoints")
    assert {path.rsplit("/", 1)[-1] for path in stored} >= {"epoch=0003-step=0000012"}, stored
    assert s3_endpoint.fs().exists(f"{bucket}/ray-runs/fsdp/metrics.jsonl")
    assert "resumed from" in log["log"], log["log"][-4000:]  # the restarted group continued from the epoch-1 checkpoint


@pytest.mark.launch
@pytest.mark.tf
@pytest.mark.timeout(400)
def test_keras_mwms_on_ray_tensorflow_trainer_equals_a_launch(tmp_path, reference_run):
    """Keras' mwms under Ray's TensorflowTrainer (it sets each worker's TF_CONFIG): the weights of `unifit launch`."""
    reference_run.prefetch(["mwms"])
    [result, _] = _drive(tmp_path, [_run(tmp_path, "mwms", [], config=KERAS_PROBE_YAML)], timeout=360)
    assert result["error"] is None, result
    mine, theirs = reports(tmp_path / "mwms"), reports(reference_run("mwms"))
    assert [r["weights_sha256"] for r in mine] == [r["weights_sha256"] for r in theirs]
    assert [p.rsplit("/", 1)[-1] for p in result["checkpoints"]][-1] == "epoch=0003-step=0000012", result


@pytest.mark.launch
@pytest.mark.timeout(400)
def test_an_elastic_group_grows_and_resumes_at_the_new_world_size(tmp_path):
    """num_workers (1, 2) on a Ray cluster of one node with 1 CPU: the group starts with 1 worker; once the epoch-1
    checkpoint is committed a second node joins, Ray re-forms the group with 2 workers (its autoscaling coordinator
    sees new nodes every 20 s), which resume from the newest checkpoint on a world of 2 and finish."""
    slow = {"class_path": "tests.probe.callbacks.SlowSteps", "init_args": {"seconds": 1.0}}
    run = _run(tmp_path, "ddp", [slow])
    run["overrides"] += ["--trainer.max_epochs", "5"]
    run.pop("num_workers")
    first = str(tmp_path / "storage" / "ddp" / "checkpoints" / "epoch=0001-*" / "COMMITTED.json")
    run |= {"scaling": {"num_workers": [1, 2], "elastic_resize_monitor_interval_s": 1}, "grow_when": first}
    [result, log] = _drive(tmp_path, [run], timeout=360)
    assert result["error"] is None, result
    log = log["log"]
    assert "world size 1" in log and "world size 2" in log, log[-4000:]
    assert log.index("world size 1") < log.index("world size 2") and "resumed from" in log, log[-4000:]
    ends = [tuple(int(part.split("=")[1]) for part in p.rsplit("/", 1)[-1].split("-")) for p in result["checkpoints"]]
    assert ends[-1][0] == 5 and result["metrics"]["epoch"] == 5, ends
    # steps an epoch: 8 on the world of 1 (64 samples, batch 8), then 4 on the world of 2, each epoch once
    steps = [b - a for (_, a), (_, b) in zip([(0, 0), *ends], ends)]
    assert [epoch for epoch, _ in ends] == [1, 2, 3, 4, 5] and 8 in steps and steps[-1] == 4, ends
    assert steps == sorted(steps, reverse=True), ends  # never back to 8 once the group grew


def test_a_strategy_with_a_launcher_of_its_own_is_refused_before_ray_starts(tmp_path):
    import unifit.ray
    from unifit.errors import ConfigError

    with pytest.raises(ConfigError, match=r"trainer.strategy: horovod under Ray Train: .*run one of single, ddp"):
        unifit.ray.loop_config(KERAS_PROBE_YAML, ["--trainer.strategy", "horovod"], storage_path=str(tmp_path))
    assert unifit.ray.loop_config(KERAS_PROBE_YAML, ["--trainer.strategy", "mwms"])["backend"] == "tensorflow"
    assert unifit.ray.loop_config(PROBE_YAML, ["--trainer.strategy", "fsdp"])["backend"] == "torch"
    with pytest.raises(ConfigError, match=r"module.init_args.n_trian"):  # a mistake in the experiment: one line
        unifit.ray.loop_config(PROBE_YAML, ["--module.init_args.n_trian", "3"], storage_path=str(tmp_path))


def test_ray_trains_ranks_and_its_process_group_are_read_as_ray_s():
    from unifit.strategies.environment import RAY_TRAIN_MARKER, detect

    ray_worker = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "1"}
    ray_worker |= {"MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "41000"}
    env = detect({**ray_worker, RAY_TRAIN_MARKER: "1"})
    assert (env.source, env.rank, env.world_size, env.local_rank, env.node_rank) == ("ray", 3, 4, 1, 1)
    assert detect(ray_worker).source == "torchrun"  # without unifit.ray's marker: torchrun's variables
