"""Run the device-executor example end to end in one command: ``python run.py``.

Creates a throw-away directory with a secret (mode 0600), a controller config that listens on a
free loopback port, and a worker config that dials it; starts the controller (``--hold``), then
the worker (the "device", serving a scratch directory as ``/``). Once the controller has started
a durable build by id, it is killed (SIGKILL) mid-build and a new controller is started on the
same port (``--reconcile``): the device dials it, and it finds the build again by its id and
reads its whole output by offset. Then the worker is stopped with SIGTERM. Exit status: the
second controller's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import garcon_link as gl

HERE = Path(__file__).resolve().parent
TIMEOUT = 60.0


def relay(stream: object, prefix: str) -> None:
    for line in stream:  # type: ignore[attr-defined]
        print(f"{prefix} {line}", end="", flush=True)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="device-executor-") as tmp:
        work = Path(tmp)
        gl.write_secret_file(work / "link.secret")
        print(f"$ keygen {work}/link.secret   (mode 0600, deleted afterwards)", flush=True)
        (work / "controller.toml").write_text(
            'executor_id = "device-1"\nrole = "controller"\nsecret_file = "link.secret"\n'
            '[connection]\nlisten = "127.0.0.1:0"\n'
        )
        root = work / "device-root"
        root.mkdir()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        controller = subprocess.Popen(
            [sys.executable, str(HERE / "controller.py"), str(work / "controller.toml"), "--hold"],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert controller.stdout is not None
        first = controller.stdout.readline()
        print(f"controller> {first}", end="", flush=True)
        if not first.startswith("controller-listening url="):
            controller.kill()
            return 1
        url = first.split("url=", 1)[1].strip()
        (work / "worker.toml").write_text(
            'executor_id = "device-1"\nrole = "worker"\nsecret_file = "link.secret"\n'
            f'[connection]\ndial = "{url}"\n'
            # Redial a restarted controller within half a second.
            "[limits]\nbackoff_max = 0.5\n"
        )
        worker = subprocess.Popen(
            [
                sys.executable,
                str(HERE / "worker.py"),
                str(work / "worker.toml"),
                "--root",
                str(root),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        threads = [threading.Thread(target=relay, args=(worker.stdout, "worker>"), daemon=True)]
        threads[0].start()
        try:
            # The first controller runs until it has started the durable build; then it dies.
            started = False
            for line in controller.stdout:
                print(f"controller> {line}", end="", flush=True)
                if line.startswith("durable-started"):
                    started = True
                    break
            controller.kill()
            controller.wait()
            if not started:
                raise RuntimeError("the first controller did not start the durable build")
            print("run.py: controller killed (SIGKILL) mid-build; starting a new one", flush=True)
            port = url.rsplit(":", 1)[1].split("/", 1)[0]
            (work / "controller.toml").write_text(
                'executor_id = "device-1"\nrole = "controller"\nsecret_file = "link.secret"\n'
                f'[connection]\nlisten = "127.0.0.1:{port}"\n'
            )
            controller = subprocess.Popen(
                [
                    sys.executable,
                    str(HERE / "controller.py"),
                    str(work / "controller.toml"),
                    "--reconcile",
                ],
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            threads.append(
                threading.Thread(target=relay, args=(controller.stdout, "controller>"), daemon=True)
            )
            threads[-1].start()
            code = controller.wait(timeout=TIMEOUT)
        except (subprocess.TimeoutExpired, RuntimeError) as exc:
            print(f"run.py: {exc}", flush=True)
            controller.kill()
            code = 1
        finally:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(timeout=10)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
            for thread in threads:
                thread.join(timeout=2)
        notes = root / "notes" / "todo.txt"
        if notes.exists():
            print(f"on the device, /notes/todo.txt holds {notes.read_text()!r}")
        return code


if __name__ == "__main__":
    raise SystemExit(main())
