"""scripts/study_checkpoint.sh: a long study's run files are committed to the repository while it
runs, and a run of the script on a machine without them (a fresh output folder) restores them, so
that the scheduler computes nothing it has (the KDD Cup 99 studies outlive a machine)."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "study_checkpoint.sh"


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout


def test_the_run_files_are_committed_and_a_fresh_output_folder_resumes_from_them(tmp_path):
    repo, out = tmp_path / "repo", tmp_path / "out"
    repo.mkdir()
    _git(repo, "init", "-q")
    study = yaml.safe_load((ROOT / "configs" / "smoke.yaml").read_text())
    study.update(name="ckpt", rounds=12, workers=1, seeds={"tune": [100], "evaluate": [1, 2]},
                 methods=study["methods"][:2], analysis={"protocol": "paper"},
                 output={"dir": str(tmp_path / "unused")})
    path = tmp_path / "ckpt.yaml"
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    env = {**os.environ, "REPO": str(repo), "OUT": str(out),
           "DIFF2": str(Path(sys.executable).parent / "diff2"),
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}

    def run() -> subprocess.CompletedProcess:
        done = subprocess.run(["bash", str(SCRIPT), str(path), "1"], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return done

    first = run()
    files = sorted(p.name for p in (out / "ckpt" / "runs").glob("*.json"))
    assert len(files) >= 8  # GD 2 + DP-GD 4 tuning runs, and their evaluation runs
    tarball = repo / "results" / "wip" / "ckpt.runs.tar.gz"
    with tarfile.open(tarball) as tar:
        assert sorted(Path(m).name for m in tar.getnames()) == files
    # committed, not only written: the last commit holds these very bytes
    assert _git(repo, "status", "--porcelain", "--", "results") == ""
    assert f"checkpoint: study ckpt in progress, {len(files)} run files" in _git(repo, "log",
                                                                                 "--format=%s")
    assert "0 reused" in first.stderr

    # the next machine: no output folder, only the repository
    (out / "ckpt").rename(tmp_path / "lost")
    second = run()
    assert f"restored {len(files)} run files" in second.stderr
    assert "0 run(s) computed by this driver" in second.stderr
    assert f"{len(files)} reused" in second.stderr
    assert sorted(p.name for p in (out / "ckpt" / "runs").glob("*.json")) == files
