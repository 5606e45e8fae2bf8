#!/usr/bin/env bash
# How the checkpoints beside this file were written (by unifit at commit 04000e4, before the checkpoint
# owner): tests/test_old_checkpoints.py resumes from them, so a later change to the checkpoint format or
# its reader cannot strand users' existing checkpoints. Re-running this overwrites them with today's.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../../.." && pwd)"
unifit="${UNIFIT_VENV:-$repo/.venv}/bin/unifit"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$repo"
common=(--trainer.max_epochs 1 --trainer.tensorboard.enabled false --trainer.seed 7)
report() {  # the weights digest and metrics each run ends with, beside its checkpoint
  echo "--trainer.callbacks"
  echo "[{\"class_path\": \"tests.probe.callbacks.ProbeReport\", \"init_args\": {\"out_dir\": \"$work/$1/reports\"}}]"
}
# torch, one process: a mid-epoch step checkpoint (data position, partial epoch sums, RNG, callbacks)
"$unifit" fit -c tests/probe/probe.yaml "${common[@]}" --trainer.root_dir "$work/single" \
  --trainer.checkpoint.every_n_steps 5 "$(report single | head -1)" "$(report single | tail -1)"
# torch, fsdp on 2 ranks: a sharded checkpoint (torch.distributed.checkpoint shards + rank 0's state.pt)
"$unifit" launch -c tests/probe/probe.yaml --nproc-per-node 2 "${common[@]}" --trainer.root_dir "$work/fsdp" \
  --trainer.strategy fsdp --trainer.batch_size 4 "$(report fsdp | head -1)" "$(report fsdp | tail -1)"
# Keras, one process: an epoch-end checkpoint (TensorFlow checkpoint files + the trainer state)
"$unifit" fit -c tests/probe/keras_probe.yaml "${common[@]}" --trainer.root_dir "$work/keras" \
  --trainer.strategy single "$(report keras | head -1)" "$(report keras | tail -1)"
rm -rf "$here/single" "$here/fsdp" "$here/keras"
cp -r "$work/single/checkpoints/epoch=0000-step=0000005" "$here/single"
cp -r "$work/fsdp/checkpoints/epoch=0001-step=0000008" "$here/fsdp"
cp -r "$work/keras/checkpoints/epoch=0001-step=0000008" "$here/keras"
for run in single fsdp keras; do cp "$work/$run/reports/report_0.json" "$here/$run.report.json"; done
du -sh "$here"/*/
