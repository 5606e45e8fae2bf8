"""`docker` for SageMaker's local mode on a machine without Docker: each compose service runs as processes.

SageMaker's ModelTrainer (SDK 3) in LOCAL_CONTAINER mode lays out /opt/ml for each instance (algo-1, algo-2,
...), writes a docker-compose file (per service: its volumes, environment and the entrypoint the SDK uses on AWS,
`bash -c ".../sm_train.sh"`) and runs `docker compose -f FILE up`. This stands in for Docker: every service runs
in a mount namespace of its own (`unshare --mount`) where

- the volumes are bind-mounted at their container paths (/opt/ml/input, /opt/ml/model, ...);
- /opt and the Python environment are overlays, so what the job installs (`pip install -r requirements.txt`)
  stays in that "container" (its writable layer, kept under <compose dir>/.shim/<service>/) and never reaches
  this machine's environment;
- the network is its own: a network namespace per service on one bridge (tests/netns.py), its address named in
  /etc/hosts by the service's name (algo-1, ...), as compose's network aliases do, and by this machine's host name.

The image is this machine's Python environment (the interpreter running this file); `image` is not pulled.
Only what the SDK calls is implemented: `docker compose version` and `docker compose -f FILE up ...`. A failed
service stops the others, as a failed host ends a SageMaker job.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.netns import Cluster  # noqa: E402


def main(argv: list[str]) -> int:
    if argv[:2] == ["compose", "version"]:
        print("Docker Compose version v2.29.7 (unifit test shim)")
        return 0
    if argv[:1] == ["compose"] and "up" in argv and "-f" in argv:
        return up(Path(argv[argv.index("-f") + 1]))
    if argv[:1] == ["_service"]:
        return run_service(json.loads(argv[1]))
    print(f"docker (unifit test shim): not implemented: {' '.join(argv)}", file=sys.stderr)
    return 125


def up(compose_file: Path) -> int:
    services = yaml.safe_load(compose_file.read_text())["services"]
    shim = compose_file.parent / ".shim"
    shim.mkdir(exist_ok=True)
    with Cluster(len(services)) as network:
        (shim / "namespaces").write_text("\n".join([*network.namespaces, network.switch]))  # for a killed shim
        names = "".join(f"{address} {name}\n" for address, name in zip(network.addresses, services))
        procs: dict[str, subprocess.Popen] = {}
        for host, (name, spec) in enumerate(services.items()):
            hosts = shim / f"{name}.hosts"
            hosts.write_text(f"127.0.0.1 localhost\n{names}{network.addresses[host]} {socket.gethostname()}\n")
            service = {
                "volumes": spec.get("volumes", []),
                "environment": spec.get("environment", []),
                "entrypoint": spec["entrypoint"],
                "scratch": str(shim / name),
                "hosts": str(hosts),
                "prefix": sys.prefix,
            }
            command = ["unshare", "--mount", "--propagation", "private", sys.executable, __file__, "_service"]
            procs[name] = subprocess.Popen(
                [*network.prefix(host), *command, json.dumps(service)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        printers = [threading.Thread(target=_print_lines, args=item, daemon=True) for item in procs.items()]
        for printer in printers:
            printer.start()
        code = _wait(procs)
        for printer in printers:
            printer.join(timeout=10)
    return code


def _print_lines(name: str, proc: subprocess.Popen) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        print(f"{name:<8}| {line}", end="", flush=True)


def _wait(procs: dict[str, subprocess.Popen]) -> int:
    """Every service's exit status, or the first failure's after stopping the rest."""
    while True:
        codes = {name: proc.poll() for name, proc in procs.items()}
        failed = [code for code in codes.values() if code not in (None, 0)]
        if failed:
            for proc in procs.values():
                _stop_tree(proc.pid)
            return failed[0]
        if all(code == 0 for code in codes.values()):
            return 0
        time.sleep(0.2)


def _stop_tree(pid: int) -> None:
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for proc in tree:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(tree, timeout=10)
    for proc in alive:
        proc.kill()


def run_service(service: dict) -> int:
    """Inside the service's own mount namespace: lay out its file system, then become its entrypoint."""
    scratch = Path(service["scratch"])
    _overlay("/opt", scratch / "opt")
    _overlay(service["prefix"], scratch / "env")
    volumes = [_split_volume(volume) for volume in service["volumes"]]
    for source, target in sorted(volumes, key=lambda pair: pair[1].count("/")):
        os.makedirs(source, exist_ok=True)  # as Docker does for a missing host path
        os.makedirs(target, exist_ok=True)
        _mount("--bind", source, target)
    _mount("--bind", service["hosts"], "/etc/hosts")
    env = {
        "PATH": f"{service['prefix']}/bin:/usr/local/bin:/usr/bin:/bin",
        "HOME": "/root",
        "LANG": "C.UTF-8",
        **dict(item.split("=", 1) for item in service["environment"]),
    }
    os.chdir("/")
    os.execvpe(service["entrypoint"][0], service["entrypoint"], env)


def _split_volume(volume: str) -> tuple[str, str]:
    volume = volume.removesuffix(":z")
    source, _, target = volume.rpartition(":")
    return source, target


def _overlay(lower: str, scratch: Path) -> None:
    (scratch / "upper").mkdir(parents=True, exist_ok=True)
    (scratch / "work").mkdir(parents=True, exist_ok=True)
    options = f"lowerdir={lower},upperdir={scratch / 'upper'},workdir={scratch / 'work'}"
    _mount("-t", "overlay", "overlay", "-o", options, lower)


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
