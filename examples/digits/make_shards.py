"""Write the digits data as .npz shards to any location, for the sharded-by-file example.

    python -m examples.digits.make_shards s3://my-bucket/digits --shards 4
    unifit launch --nproc-per-node 2 -c examples/digits/sharded.yaml \\
        --data.init_args.train 's3://my-bucket/digits/train-*.npz' --data.init_args.val 's3://my-bucket/digits/val-*.npz'
"""

from __future__ import annotations

import argparse
import io

import numpy as np

from examples.digits.data import DigitsData
from unifit.storage import filesystem


def write_shards(url: str, shards: int) -> list[str]:
    fs, root = filesystem(url)
    fs.makedirs(root, exist_ok=True)
    data = DigitsData()
    written = []
    for split, (x, y) in (("train", data.train_dataset()), ("val", data.val_dataset())):
        for i, idx in enumerate(np.array_split(np.arange(len(x)), shards)):
            buffer = io.BytesIO()
            np.savez(buffer, x=x[idx], y=y[idx])
            path = f"{root.rstrip('/')}/{split}-{i:03d}.npz"
            fs.pipe_file(path, buffer.getvalue())
            written.append(path)
    return written


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("--shards", type=int, default=4)
    args = parser.parse_args()
    print("\n".join(write_shards(args.url, args.shards)))
