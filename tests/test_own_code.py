"""Your own model code in a Flower app (issue 21, item 6): it must ride in the FAB.

`flwr run .` ships the app folder to the ServerApp and every ClientApp as a FAB, built from the
files that ``fab-include`` in pyproject.toml lists (Flower 1.42, ``flwr/cli/build.py``); Flower puts
the installed FAB's folder on ``sys.path``. PYTHONPATH does not count (the local SuperLink is
long-running and keeps the environment it was started with), and the runs here have none. The
flower-marked test first runs the issue's case, a factory module in the app folder but outside
``fab-include`` (in the working directory of `flwr run`, too): the run fails, saying where the
module must live. Then the same factory in ``custom/`` completes, so it came from the FAB.
"""

from __future__ import annotations

import io
import json
import re
import shlex
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

from flwr_app import (
    REPO, copy_app, flwr_env, start_run, stop_superlinks, superlink_pids, wait_finished,
)

FLWR = Path(sys.executable).with_name("flwr")

#: The user's factory, as the tutorial (docs/tutorials/own-model-and-data.md) shows it.
TUTORIAL = REPO / "docs" / "tutorials" / "own-model-and-data.md"
MYMODEL = '''"""My own model: a factory named in the experiment as model.name: custom.mymodel:make."""

from torch import nn


def make(*, in_features: int, out_features: int, hidden: int = 8) -> nn.Module:
    return nn.Sequential(nn.Linear(in_features, hidden), nn.Tanh(), nn.Linear(hidden, out_features))
'''  # noqa: E501 -- the tutorial's file, verbatim


def _fab_names(app: Path, where: Path) -> set[str]:
    """The files of the FAB that `flwr build --app APP` (what `flwr run` sends) writes into
    ``where``."""
    where.mkdir()
    done = subprocess.run([str(FLWR), "build", "--app", str(app)], cwd=where, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    (fab,) = where.glob("*.fab")
    with zipfile.ZipFile(fab) as bundle:
        return set(bundle.namelist())


def _user_app(dest: Path) -> Path:
    """A copy of the app with the user's factory in custom/, and what must never travel: outputs,
    data, a venv."""
    app = copy_app(dest)
    (app / "custom" / "mymodel.py").write_text(MYMODEL)
    # Flower drops test files
    (app / "custom" / "test_mymodel.py").write_text("def test_make():\n    pass\n")
    for junk in ("outputs/default-1/summary.json", "outputs/default-1/metrics.jsonl",
                 "outputs/default-1/final_parameters.npy", "outputs/ckpt.npz", "data/train.csv",
                 "custom/weights.npz",
                 "custom/records.csv", "custom/outputs/run.json",
                 ".venv/lib/python3.11/site-packages/mod.py",
                 ".venv/pyvenv.cfg", "mypkg/models.py"):
        (app / junk).parent.mkdir(parents=True, exist_ok=True)
        (app / junk).write_text(MYMODEL if junk.endswith(".py") else "{}\n")
    return app


def test_the_fab_carries_custom_and_nothing_else_of_the_users(tmp_path):
    app = _user_app(tmp_path / "app")
    names = _fab_names(app, tmp_path / "fab")
    assert {"custom/__init__.py", "custom/mymodel.py", "server/server_app.py",
            "clients/client_app.py",
            "diff2_flwr/task/models.py", "configs/default.yaml", "pyproject.toml"} <= names
    leaked = sorted(n for n in names if n.startswith(("outputs/", ".venv/", "data/",
                                                      "custom/outputs/", "mypkg/"))
                    or n.endswith((".npz", ".npy", ".csv",
                                   ".cfg")) or n == "custom/test_mymodel.py")
    assert not leaked, leaked
    # The apps' code only: the CLI, the experiments and the deployment tooling stay home
    # (fab-exclude).
    assert not [n for n in names if n == "diff2_flwr/cli.py"
                or n.startswith(("diff2_flwr/lab/", "diff2_flwr/deploy/"))]

    # Another folder of one's own goes in as the tutorial says: one more pattern in fab-include.
    pyproject = app / "pyproject.toml"
    text = pyproject.read_text()
    assert text.count('"custom/**/*.py",') == 1
    pyproject.write_text(text.replace('"custom/**/*.py",', '"custom/**/*.py", "mypkg/**/*.py",'))
    names = _fab_names(app, tmp_path / "fab-mypkg")
    assert "mypkg/models.py" in names and not any(n.startswith((".venv/",
                                                                "outputs/")) for n in names)


def _fab_bytes(app: Path, where: Path) -> bytes:
    _fab_names(app, where)
    (fab,) = where.glob("*.fab")
    return fab.read_bytes()


def test_flwr_run_gets_the_same_fab_from_the_staged_app(tmp_path):
    """Our launcher runs `flwr run` on a staged copy of the shippable files (runtime/app_stage.py:
    Flower walks every file of the app folder, a checkout's .venv too): Flower builds the same FAB
    from it, byte for byte, with the user's custom/ code, the extra folder fab-include names and a
    top-level file it names; the junk stays home."""
    from diff2_flwr.runtime.app_stage import stage_app

    app = _user_app(tmp_path / "app")
    pyproject = app / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('"custom/**/*.py",',
                                                       '"custom/**/*.py", "mypkg/**/*.py", '
                                                                           '"README.md",'))
    staged = stage_app(app, tmp_path / "staged")
    assert staged == tmp_path / "staged"
    assert not [p for p in staged.rglob("*") if p.is_file() and (p.suffix in (".npz", ".csv",
                                                                              ".cfg", ".json")
                                                                 or p.parts[len(staged.parts)] in (
                                                                     ".venv", "outputs", "data"))]
    fab = _fab_bytes(staged, tmp_path / "fab-staged")
    assert fab == _fab_bytes(app, tmp_path / "fab-app")
    with zipfile.ZipFile(io.BytesIO(fab)) as bundle:
        assert {"custom/mymodel.py", "mypkg/models.py", "README.md",
                "configs/deploy.yaml"} <= set(bundle.namelist())
    # a fab-include that may select anywhere is not staged: Flower walks the folder itself
    pyproject.write_text(pyproject.read_text().replace('"README.md",', '"*.md",'))
    assert stage_app(app, tmp_path / "other") == app and not (tmp_path / "other").exists()

def test_the_tutorial_shows_this_factory_and_pyprojects_fab_include():
    readme = TUTORIAL.read_text()
    assert MYMODEL in readme, f"{TUTORIAL.relative_to(REPO)} must quote MYMODEL verbatim"
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["flwr"]["app"][
        "fab-include"]
    assert "custom/**/*.py" in patterns and (REPO / "custom" / "__init__.py").is_file()
    assert f"fab-include = {json.dumps(patterns + ['mypkg/**/*.py'])}" in readme


def _experiment(app: Path, name: str, model: str, out: Path) -> str:
    """A small experiment file in the app's configs/ naming ``model``; its path as `--run-config`
    takes it."""
    cfg = {"name": name, "method": "diff2", "dataset": {"name": "synthetic", "num_samples": 2000,
                                                        "num_features": 8},
           "model": {"name": model, "kwargs": {"hidden": 8}}, "privacy": {"epsilon": 3.0,
                                                                          "delta": 1.0e-5},
           "training": {"rounds": 3, "restart_every": 3, "clip_restart": 1.0, "clip_diff": 3.0,
                        "learning_rate": 0.2,
                        "clients": 10, "seed": 7},
           "output": {"dir": str(out)}}
    (app / "configs" / f"{name}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return f"config='configs/{name}.yaml'"


@pytest.mark.flower
def test_flwr_run_imports_a_factory_from_custom_without_pythonpath(tmp_path):
    # only the copy has it: the run must take it from the FAB
    assert not (REPO / "custom" / "mymodel.py").exists()
    app = _user_app(tmp_path / "app")
    home, out = tmp_path / "flwr-home", tmp_path / "outputs"
    env = flwr_env(home)
    env.pop("PYTHONPATH", None)
    flwr = ["flwr", "run", ".", "--federation-config", "num-supernodes=10", "--run-config"]
    try:
        # The case: the module in the app folder but outside fab-include. The run fails,
        # saying where to put it.
        run_id = start_run(flwr + [_experiment(app, "outside", "mypkg.models:make", out)], env, app)
        info = wait_finished(env, app, run_id, 300)
        assert info["status"] == "finished:failed", info
        assert re.search(
            r"key `model.name`: cannot import module 'mypkg.models' of the model factory "
            r"'mypkg.models:make' \(ModuleNotFoundError: No module named 'mypkg'\)\. .*put the "
            r"module in the app's custom/ folder \(e.g. custom/models.py, named "
            r"'custom.models:make'\)",
                         info["status-details"]), info["status-details"]
        print(
            f"mypkg.models:make outside fab-include: failed after {info['elapsed']:.0f} s, as it "
            f"should")

        # The same factory in custom/: shipped in the FAB, imported by the ServerApp and the ten
        # ClientApps.
        argv = flwr + [_experiment(app, "own_model", "custom.mymodel:make", out)]
        run_id = start_run(argv, env, app)
        info = wait_finished(env, app, run_id, 600)
        assert info["status"] == "finished:completed", (shlex.join(argv), info)
        (summary,) = out.glob("own_model-*/summary.json")
        assert json.loads(summary.read_text())["status"] == "completed"
        assert list(home.glob("apps/*/custom/mymodel.py"))  # where Flower installed the FAB it ran
        print(
            f"custom.mymodel:make under flwr run: completed in {info['elapsed']:.0f} s (run "
            f"{run_id})")
    finally:
        stop_superlinks(home)
    assert not superlink_pids(home)
