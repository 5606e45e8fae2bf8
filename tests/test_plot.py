"""`unifit plot`: real run directories (short fits of the probe module, TensorBoard on, locally and
on S3) drawn into a PNG that is opened and checked: the size asked for, not blank, every run's
colour present; the wall time comes from the runs' event files; bad input is one line, exit 2."""

from __future__ import annotations

import base64
import json
import re

import numpy as np
import pytest
from PIL import Image

import unifit
from tests.probe.probe import ProbeModule
from unifit.cli.main import main
from unifit.plot import panels, read_run

RUN_COLOURS = [(0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E), (0x2C, 0xA0, 0x2C)]  # tab10: runs 1, 2, 3


def fit(root: str, lr: float) -> None:
    unifit.Trainer(
        strategy="single",
        max_epochs=3,
        batch_size=8,
        root_dir=root,
        progress_bar=False,
        seed=0,
        checkpoint={"enabled": False},
        tensorboard={"log_every_n_steps": 4},
    ).fit(ProbeModule(lr=lr, dropout=0.0))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("plot-runs")
    fit(str(base / "lr0.05"), 0.05)
    fit(str(base / "lr0.01"), 0.01)
    return [str(base / "lr0.05"), str(base / "lr0.01")]


def pixels(path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def colour_pixels(img: np.ndarray, rgb: tuple[int, int, int]) -> int:
    return int(np.all(img == np.array(rgb, dtype=img.dtype), axis=-1).sum())


def assert_drawn(img: np.ndarray, n_runs: int) -> None:
    assert img.std() > 10, "the image is blank"
    colours, counts = np.unique(img.reshape(-1, 3), axis=0, return_counts=True)
    assert (counts >= 30).sum() >= 5, f"only {(counts >= 30).sum()} colours cover 30+ pixels"
    for index in range(n_runs):  # each run's curves, in its own colour
        assert colour_pixels(img, RUN_COLOURS[index]) > 100, f"run {index + 1}'s colour is missing"


def test_plot_png_of_two_runs_has_the_size_asked_and_is_drawn(runs, tmp_path, capsys):
    out = tmp_path / "curves.png"
    assert main(["plot", *runs, "-o", str(out), "--size", "900x700"]) == 0
    assert f"wrote {out} (2 runs)" in capsys.readouterr().out
    img = pixels(out)
    assert img.shape == (700, 900, 3)
    assert_drawn(img, 2)
    assert colour_pixels(img, RUN_COLOURS[2]) == 0  # no third run was drawn


def test_default_size_follows_the_panels_and_wall_time_comes_from_the_event_files(runs, tmp_path):
    read = [read_run(url) for url in runs]
    for run in read:  # the probe logs train/loss, val/loss, val/index_mean, val/rank_plus_one, lr, throughput
        assert [r["epoch"] for r in run.records] == [1, 2, 3]
        assert run.has_time and all(t is not None and t > 0 for t in run.elapsed)
        assert run.elapsed == sorted(run.elapsed), run.elapsed
    titles = [title for title, _ in panels(read)]
    assert titles[0] == "loss" and "lr" in titles and "throughput/samples_per_s" in titles
    assert dict(panels(read))["loss"] == ["train/loss", "val/loss"]
    out = tmp_path / "curves.png"
    assert main(["plot", *runs, "-o", str(out)]) == 0
    assert pixels(out).shape == (260 * len(titles) + 90, 1400, 3)


def test_labels_html_and_a_run_on_s3(runs, s3_endpoint, bucket, tmp_path, capsys):
    url = f"s3://{bucket}/remote-run"
    fit(url, 0.02)  # metrics.jsonl written to S3, event files synced to <root_dir>/tensorboard there
    out = tmp_path / "runs.html"
    options = json.dumps({"endpoint_url": s3_endpoint.url})
    assert (
        main(
            [
                "plot",
                *runs,
                url,
                "-o",
                str(out),
                "--label",
                "fast",
                "--label",
                "slow",
                "--label",
                "s3",
                "--size",
                "1000x800",
                "--storage-options",
                options,
            ]
        )
        == 0
    )
    assert "no wall time" not in capsys.readouterr().out  # the S3 run's event files were found too
    page = out.read_text()
    for text in ("<td>fast</td>", "<td>slow</td>", "<td>s3</td>", url):
        assert text in page
    png = tmp_path / "embedded.png"  # the page's image, as drawn
    png.write_bytes(base64.b64decode(re.search(r"data:image/png;base64,([A-Za-z0-9+/=]+)", page).group(1)))
    img = pixels(png)
    assert img.shape == (800, 1000, 3)
    assert_drawn(img, 3)


@pytest.mark.parametrize("case", ["missing-dir", "no-metrics", "empty-metrics", "not-json"])
def test_bad_run_dir_is_one_line_naming_the_path_exit_2(runs, tmp_path, capsys, case):
    bad = tmp_path / "bad"
    if case != "missing-dir":
        bad.mkdir()
        (bad / "config.yaml").write_text("trainer: {}\n")
    if case == "empty-metrics":
        (bad / "metrics.jsonl").write_text("")
    if case == "not-json":
        (bad / "metrics.jsonl").write_text('{"epoch": 1, "step": 4}\nnot json\n')
    out = tmp_path / "curves.png"
    assert main(["plot", runs[0], str(bad), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("unifit: error: unifit plot: ") and err.count("\n") == 1, err
    assert str(bad) in err
    assert {
        "missing-dir": "does not exist",
        "no-metrics": "not a unifit run directory",
        "empty-metrics": "is empty",
        "not-json": "line 2 is not JSON",
    }[case] in err
    assert not out.exists()


def test_bad_arguments_exit_2(runs, tmp_path, capsys):
    assert main(["plot", *runs, "--label", "only-one", "-o", str(tmp_path / "c.png")]) == 2
    assert "2 run directories" in capsys.readouterr().err
    assert main(["plot", runs[0], "-o", str(tmp_path / "c.gif")]) == 2
    assert "unknown format" in capsys.readouterr().err
    assert main(["plot", runs[0], "--size", "big", "-o", str(tmp_path / "c.png")]) == 2
    assert "WIDTHxHEIGHT" in capsys.readouterr().err
