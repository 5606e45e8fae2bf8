"""No host synchronisation inside a steady-state training step, for every PyTorch strategy.

On a GPU a step that reads a value back (.item(), .cpu(), a Python bool of a tensor...) waits for the
device to finish everything queued, so the host can no longer run ahead and the GPU idles between
kernels. Loss and metric sums stay on the device and are read at log and epoch boundaries; the NaN
guard, the progress bar, step logging and the lr warmup never read one per step. On CPU these calls
cost nothing, so this suite counts them (tests/probe/host_sync.py); on a GPU tests/gpu runs the same
window under torch.cuda.set_sync_debug_mode("error").
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import REPO, StrategyCase, assert_ok, run_unifit, strategy_params

pytestmark = pytest.mark.launch

YAML = REPO / "tests" / "probe" / "host_sync.yaml"
# float16's loss scaling reads the overflow flag once per step inside torch itself
# (GradScaler.step: `if not sum(v.item() for v in found_inf...)`), as in every torch loop that uses it
GRAD_SCALER = "torch.amp.grad_scaler:"

CASES = [  # each strategy once, each precision more than once
    (strategy_params("single")[0], "bf16-mixed"),
    (strategy_params("single")[0], "16-mixed"),
    (strategy_params("single")[0], "16-mixed-fused"),  # AdamW(fused=True): the GradScaler's flag stays on the device
    (strategy_params("ddp")[0], "32-true"),
    (strategy_params("smddp-like")[0], "32-true"),
    (strategy_params("fsdp")[0], "bf16-mixed"),
    (strategy_params("horovod")[0], "32-true"),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("param, precision", CASES, ids=[f"{p.id}-{precision}" for p, precision in CASES])
def test_steady_state_steps_never_read_back_from_the_device(tmp_path, param, precision):
    case: StrategyCase = param.values[0]
    counter = {"class_path": "tests.probe.host_sync.HostSyncCounter", "init_args": {"out_dir": str(tmp_path)}}
    result = run_unifit(
        "launch",
        "--nproc-per-node",
        str(case.nproc),
        "-c",
        str(YAML),
        "--trainer.strategy",
        case.strategy,
        *case.options,
        "--trainer.root_dir",
        str(tmp_path / "run"),
        "--trainer.precision",
        precision.removesuffix("-fused"),
        "--module.init_args.fused",
        str(precision.endswith("-fused")).lower(),
        "--module.init_args.n_train",
        str(16 * 16 * case.nproc),  # 16 batches per rank and epoch
        "--trainer.callbacks",
        json.dumps([counter]),
    )
    assert_ok(result)
    for rank in range(case.nproc):
        report = json.loads((tmp_path / f"host_sync_{rank}.json").read_text())
        assert report["steps"] == 8, report  # batches 2-9 of epoch 2 were watched
        calls = report["calls"]
        if precision == "16-mixed":
            scaler = {where: n for where, n in calls.items() if where.startswith(GRAD_SCALER)}
            assert sum(scaler.values()) == 8, calls  # one per step, torch's own
            calls = {where: n for where, n in calls.items() if where not in scaler}
        assert calls == {}, f"rank {rank} read back from the device in steady-state steps: {calls}"
