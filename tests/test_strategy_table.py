"""The (strategy, framework) table: every registered strategy's frameworks and training parts come from
its one registry row, and a strategy of the user's own is one file with no row."""

from __future__ import annotations

import pytest

from unifit.errors import ConfigError
from unifit.strategies import registry
from unifit.strategies.environment import ClusterEnvironment

OWN = "tests.probe.own_strategy:OneProcessOfMyOwn"


def test_every_row_names_its_frameworks_parts_and_launcher_once():
    for name in registry.names():
        row = registry.entry(name)
        assert row.frameworks == frozenset(row.trainings) and row.frameworks <= {"torch", "tensorflow"}, name
        assert row.launcher.startswith("unifit.strategies.launchers."), name
    assert registry.entry("single").frameworks == {"torch", "tensorflow"}
    assert registry.entry("ddp").trainings == {"torch": registry.ITSELF}
    assert registry.entry("horovod").trainings["tensorflow"].endswith("tf_adapter:TFHorovod")


def test_a_single_strategy_gets_the_plain_part_bound_to_it():
    from unifit.strategies.torch_training import TorchTraining

    strategy = registry.create("single", ClusterEnvironment(), framework="torch")
    part = registry.training("single", "torch", strategy)
    assert type(part) is TorchTraining and part.strategy is strategy and part is not strategy
    ddp = registry.create("ddp", ClusterEnvironment(), framework="torch")
    assert registry.training("ddp", "torch", ddp) is ddp  # built on torch.distributed: its own torch part


def test_a_strategy_of_ones_own_is_one_file_and_trains(tmp_path):
    import unifit
    from tests.probe.own_strategy import CountingTorchTraining, OneProcessOfMyOwn
    from tests.probe.probe import ProbeModule

    row = registry.entry(OWN)
    assert row.frameworks == {"torch"} and row.launcher.endswith("SingleProcessLauncher")
    trainer = unifit.Trainer(strategy=OWN, max_epochs=1, batch_size=8, root_dir=str(tmp_path), progress_bar=False)
    state = trainer.fit(ProbeModule(n_train=32, n_val=16))
    assert state.global_step == 4 and CountingTorchTraining.steps == 4
    assert OneProcessOfMyOwn.reductions > 0  # the loop's metric sums went through its collectives


def test_a_strategy_that_trains_nothing_is_one_line():
    with pytest.raises(ConfigError, match="TrainsNothing trains no framework; set its `trainings`"):
        registry.entry("tests.probe.own_strategy:TrainsNothing")
