"""Ways a real job died or trained silently wrong (issue 'Fix first'), each pinned by a test."""

from __future__ import annotations

import pytest
import torch

import unifit
from tests.helpers import PROBE_YAML
from tests.probe.probe import ProbeModule
from unifit.config.loading import apply_overrides, load_yaml
from unifit.errors import ConfigError


def _trainer(tmp_path, **kw):
    base = dict(
        max_epochs=3,
        batch_size=8,
        root_dir=str(tmp_path),
        progress_bar=False,
        lr_scaling="none",
        tensorboard={"enabled": False},
        checkpoint={"enabled": False},
    )
    return unifit.Trainer(**{**base, **kw})


class Optimizers(ProbeModule):
    """configure_optimizers returns whatever form `form` names."""

    def __init__(self, form: str, **kw):
        super().__init__(dropout=0.0, **kw)
        self.form = form

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        self.opt = opt
        other = torch.optim.SGD(self.net[0].parameters(), lr=0.01)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=10.0)
        step = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {
            "two_list": lambda: [opt, other],
            "two_tuple": lambda: (opt, other),
            "two_lists": lambda: ([opt, other], []),
            "plateau_no_monitor": lambda: {"optimizer": opt, "lr_scheduler": plateau},
            "plateau_dict": lambda: {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "val/loss"}},
            "plateau_top_monitor": lambda: {"optimizer": opt, "lr_scheduler": plateau, "monitor": "val/loss"},
            "plateau_missing_metric": lambda: {
                "optimizer": opt,
                "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"},
            },
            "lists": lambda: ([opt], [step]),
            "dict_frequency": lambda: {"optimizer": opt, "lr_scheduler": {"scheduler": step, "frequency": 2}},
            "bad_key": lambda: {"optimizer": opt, "lr_scheduler": {"scheduler": step, "every": 2}},
            "bad_interval": lambda: {"optimizer": opt, "lr_scheduler": {"scheduler": step, "interval": "batch"}},
            "monitor_step": lambda: {"optimizer": opt, "lr_scheduler": {"scheduler": step, "monitor": "val/loss"}},
        }[self.form]()


@pytest.mark.parametrize(
    "form, needles",
    [
        ("two_list", ["2 optimizers", "SGD, SGD", "one optimizer"]),
        ("two_tuple", ["2 optimizers", "one optimizer"]),
        ("two_lists", ["2 optimizers"]),
        ("plateau_no_monitor", ["ReduceLROnPlateau needs", "monitor"]),
        ("bad_key", ["'every'", "scheduler"]),
        ("bad_interval", ["'batch'", "'epoch' or 'step'"]),
        ("monitor_step", ["StepLR", "takes no metric"]),
    ],
)
def test_optimizer_forms_refused_at_setup_before_any_step(tmp_path, form, needles):
    module = Optimizers(form)
    with pytest.raises(ConfigError) as error:
        _trainer(tmp_path).fit(module)
    message = str(error.value)
    assert "\n" not in message and "Optimizers.configure_optimizers()" in message
    for needle in needles:
        assert needle in message, message
    assert not module.seen  # refused before the first training step


@pytest.mark.parametrize("form", ["plateau_dict", "plateau_top_monitor"])
def test_reduce_lr_on_plateau_steps_on_the_monitored_metric_and_resumes(tmp_path, form):
    module = Optimizers(form)
    final = _trainer(tmp_path, checkpoint={"enabled": True}).fit(module)
    # threshold=10 (rel): no epoch counts as an improvement, patience 0 -> halved after each epoch
    assert module.opt.param_groups[0]["lr"] == pytest.approx(0.05 * 0.5**3)
    assert final.metrics["lr"] == pytest.approx(0.05 * 0.5**3)  # what the next step uses
    resumed = Optimizers(form)
    _trainer(tmp_path, checkpoint={"enabled": True}, max_epochs=4).fit(resumed, ckpt_path="last")
    assert resumed.opt.param_groups[0]["lr"] == pytest.approx(0.05 * 0.5**4)  # the plateau state came back


def test_monitored_metric_that_is_never_logged_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"monitors 'val_loss', which was not logged; logged metrics: \[.*'val/loss'"):
        _trainer(tmp_path).fit(Optimizers("plateau_missing_metric"))


def test_lightning_list_form_and_scheduler_frequency(tmp_path):
    lists = Optimizers("lists")
    _trainer(tmp_path / "a").fit(lists)
    assert lists.opt.param_groups[0]["lr"] == pytest.approx(0.05 * 0.5**3)
    every_two = Optimizers("dict_frequency")
    _trainer(tmp_path / "b", max_epochs=4).fit(every_two)
    assert every_two.opt.param_groups[0]["lr"] == pytest.approx(0.05 * 0.5**2)


def test_scientific_notation_is_a_float_in_files_and_overrides(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("module:\n  class_path: m.M\n  init_args: {lr: 1e-4, wd: 5E-2, n: 3, tag: 1e}\n")
    data = apply_overrides(load_yaml(path), {"module.init_args.momentum": "9e-1", "trainer.max_epochs": "2"})
    args = data["module"]["init_args"]
    assert args == {"lr": 1e-4, "wd": 0.05, "n": 3, "tag": "1e", "momentum": 0.9}
    assert isinstance(args["lr"], float) and isinstance(data["trainer"]["max_epochs"], int)


@pytest.mark.timeout(120)
def test_digits_example_takes_an_lr_in_scientific_notation(tmp_path, cli):
    result = cli(
        "fit",
        "-c",
        "examples/digits/torch.yaml",
        "--trainer.strategy",
        "single",
        "--trainer.root_dir",
        str(tmp_path),
        "--trainer.checkpoint.dir",
        str(tmp_path / "ckpt"),
        "--trainer.tensorboard.log_dir",
        str(tmp_path / "tb"),
        "--trainer.max_epochs",
        "1",
        "--module.init_args.lr",
        "5e-2",
    )
    assert result.returncode == 0, result.stderr
    assert "lr=0.05" in result.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("root", ["/proc/unifit-cannot-exist/run", "/sys/unifit-run"])
def test_root_dir_that_cannot_be_created_is_one_line(tmp_path, cli, root):
    result = cli("fit", "-c", str(PROBE_YAML), "--trainer.root_dir", root)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("unifit: error")]
    assert "trainer.root_dir" in line and root in line and "writable directory" in line


def test_global_batch_counts_replicas_not_processes(tmp_path, capsys):
    class TwoReplicas(unifit.Callback):
        def on_setup(self, ctx):
            self.global_batch = ctx.global_batch

    seen = TwoReplicas()
    _trainer(tmp_path, max_epochs=1, accumulate_grad_batches=2, callbacks=[seen]).fit(ProbeModule())
    assert seen.global_batch == 16
    assert "global batch 16," in capsys.readouterr().out


class StopAtEpoch(unifit.Callback):
    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_epoch_end(self, ctx):
        if ctx.state.epoch == self.epoch:
            ctx.state.should_stop, ctx.state.stop_reason = True, "user callback"


class Counter(unifit.Callback):
    def __init__(self) -> None:
        self.count = 0

    def on_epoch_end(self, ctx):
        self.count += 1

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state.get("count", 0)


def test_a_user_callback_that_stops_training_is_seen_by_the_checkpoint(tmp_path):
    state = _trainer(
        tmp_path, max_epochs=10, checkpoint={"enabled": True, "every_n_epochs": 5}, callbacks=[StopAtEpoch(3)]
    ).fit(ProbeModule())
    assert state.epoch == 3
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["epoch=0003-step=0000024", "last.json"]


def test_two_instances_of_one_callback_keep_their_own_state(tmp_path):
    first, second = Counter(), Counter()
    second.count = 100
    _trainer(tmp_path, max_epochs=2, checkpoint={"enabled": True}, callbacks=[first, second]).fit(ProbeModule())
    again, again2 = Counter(), Counter()
    _trainer(tmp_path, max_epochs=3, checkpoint={"enabled": True}, callbacks=[again, again2]).fit(
        ProbeModule(), ckpt_path="last"
    )
    assert (again.count, again2.count) == (3, 103)


@pytest.mark.launch
@pytest.mark.timeout(120)
def test_errors_that_are_not_the_users_input_keep_their_type_and_place(tmp_path):
    """A corrupted checkpoint is not a config mistake: exit 1 with the original error, one line per rank."""
    from tests.helpers import launch_probe

    assert launch_probe("ddp", tmp_path, "--trainer.max_epochs", "1").returncode == 0
    (state,) = (tmp_path / "checkpoints").glob("epoch=*/state.pt")
    state.write_bytes(b"not a torch file")
    result = launch_probe("ddp", tmp_path, "--trainer.max_epochs", "2", ckpt="last", timeout=100)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    rank0 = [line for line in result.stderr.splitlines() if line.startswith("unifit: error: ")]
    rank1 = [line for line in result.stderr.splitlines() if line.startswith("unifit: error (rank 1): rank 0 failed")]
    assert rank0 and "Error" in rank0[0] and "(at " in rank0[0] and "UNIFIT_DEBUG=1" in rank0[0], result.stderr
    assert rank1, result.stderr
    debug = launch_probe(
        "ddp", tmp_path, "--trainer.max_epochs", "2", ckpt="last", timeout=100, env={"UNIFIT_DEBUG": "1"}
    )
    assert debug.returncode != 0 and "Traceback" in debug.stderr


@pytest.mark.launch
@pytest.mark.timeout(200)
def test_ckpt_path_auto_starts_fresh_then_continues_and_skips_a_corrupted_newest(tmp_path):
    from tests.helpers import launch_probe, metrics_lines

    first = launch_probe("ddp", tmp_path, "--trainer.max_epochs", "2", ckpt="auto", timeout=100)
    assert first.returncode == 0, first.stderr
    assert "no committed checkpoint in" in first.stderr and "starting fresh" in first.stderr
    second = launch_probe("ddp", tmp_path, "--trainer.max_epochs", "3", "--trainer.resume", "auto", timeout=100)
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stderr and "epoch=0002" in second.stderr
    newest = tmp_path / "checkpoints" / "epoch=0003-step=0000012" / "state.pt"
    newest.write_bytes(b"torn write")
    third = launch_probe("ddp", tmp_path, "--trainer.max_epochs", "4", ckpt="auto", timeout=100)
    assert third.returncode == 0, third.stderr
    assert [
        line
        for line in third.stderr.splitlines()
        if "epoch=0003-step=0000012 cannot be read" in line and "previous committed one" in line
    ], third.stderr
    assert "resumed from" in third.stderr and "epoch=0002-step=0000008" in third.stderr
    assert [m["epoch"] for m in metrics_lines(tmp_path)] == [1, 2, 3, 4]


class SaveNamed(unifit.Callback):
    runs_last = True  # after ModelCheckpoint: "final" is the newest save

    def on_epoch_end(self, ctx):
        if ctx.state.epoch == ctx.config.max_epochs:
            ctx.save_checkpoint("final")


def test_last_follows_a_checkpoint_saved_under_a_custom_name(tmp_path, caplog):
    _trainer(tmp_path, max_epochs=2, checkpoint={"enabled": True, "every_n_epochs": 1}, callbacks=[SaveNamed()]).fit(
        ProbeModule()
    )
    assert (tmp_path / "checkpoints" / "final").is_dir()
    with caplog.at_level("INFO", logger="unifit"):
        _trainer(tmp_path, max_epochs=3, checkpoint={"enabled": True}).fit(ProbeModule(), ckpt_path="last")
    assert any("resumed from" in r.message and r.message.split(" (")[0].endswith("/final") for r in caplog.records)


def test_nan_guard_flags_a_non_finite_loss_before_the_first_optimizer_step():
    from types import SimpleNamespace

    import numpy as np

    from unifit.callbacks.nan_guard import NanGuard
    from unifit.config.schema import NanGuardConfig
    from unifit.errors import NonFiniteLossError

    ctx = SimpleNamespace(
        rank=0,
        world_size=1,
        state=SimpleNamespace(global_step=0),
        last_checkpoint=None,
        finite_probe=lambda loss: lambda: bool(np.isfinite(loss)),
        all_reduce_max=lambda a: a,
        passed_batch=lambda every: True,  # the loop's first batch (0 -> 1)
    )
    guard = NanGuard(NanGuardConfig(check_every_n_steps=1))
    with pytest.raises(NonFiniteLossError, match="non-finite loss at step 0 on rank 0"):
        guard.on_train_batch_end(ctx, float("nan"), 0)
