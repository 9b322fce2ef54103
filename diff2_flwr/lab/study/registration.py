"""A confirmation's registration (issue 42, item 3): the file that fixes a study before it runs,
and the hash that ties every run to it.

A registration is a YAML file beside the study files it registers::

    registration: confirm2
    registered: 2026-12-04            # the date it was committed, before any run
    question: ...                     # what the confirmation asks
    endpoints: ...                    # the primary endpoints and their directions
    family: family.yaml               # the Holm family (a file of `diff2 family`)
    studies: [california.yaml, gas_turbine.yaml]
    seeds: ...                        # tuning and evaluation seeds, and why they are fresh
    grids: ...                        # the tuned configurations of each method, and their count
    selection: ...                    # the selection rule
    analysis: ...                     # the tests, the correction, the intervals
    amendments: []                    # each: {date, change, reason, results_read: true/false}

Its digest is the SHA-256 of the registration file and of every file it registers (the family file
and the study files), each preceded by its name: changing any of them, an amendment included,
changes the digest. A registered study (``registration: registration.yaml`` in its file) records
the digest in its summary, in every run file and in its run table, and refuses to reuse a run file
computed under another digest (:func:`check_runs`): a run belongs to the registration it was
computed under. The digest proves which files a run was computed under, not when: that the
registration predates the runs is shown by the repository's history (the registration's commit
before the run table's) and by the runs' own digests.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from ...runtime.config import ConfigError

__all__ = ["KEYS", "Registration", "RegistrationError", "check_runs", "load_registration",
           "registration_of"]

#: The keys a registration file has, each required.
KEYS = ("registration", "registered", "question", "endpoints", "family", "studies", "seeds",
        "grids", "selection", "analysis", "amendments")
_AMENDMENT_KEYS = {"date", "change", "reason", "results_read"}


class RegistrationError(ConfigError):
    """A registration file that is missing or incomplete, a study it does not register, or runs
    computed under another registration; the message names the file and what to do."""
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


@dataclass(frozen=True)
class Registration:
    """A loaded registration: its file, the files it registers, their digest and its
    amendments."""

    path: Path
    name: str
    registered: str
    files: tuple[Path, ...]
    digest: str
    amendments: tuple[Mapping[str, Any], ...]

    def summary(self) -> dict[str, Any]:
        """What a study's summary says of it."""
        return {"name": self.name, "file": str(self.path), "sha256": self.digest,
                "registered": self.registered,
                "files": [f.name for f in self.files],
                "amendments": [dict(a) for a in self.amendments]}


def _fail(path: Path, key: str, expected: str, found: Any) -> RegistrationError:
    return RegistrationError(f"{path}: key `{key}`: expected {expected}. Found {found!r}.")


def load_registration(path: str | Path) -> Registration:
    """Read and check a registration file; its digest covers it and the files it registers."""
    path = Path(path).resolve()
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise RegistrationError(f"{path}: the registration file cannot be read ({err.strerror}); a "
                         "study's `registration` names a file beside it.") from None
    if not isinstance(raw, Mapping):
        raise _fail(path, "(top level)", "a mapping with the keys " + ", ".join(KEYS), raw)
    missing = [k for k in KEYS if k not in raw]
    extra = sorted(set(raw) - set(KEYS))
    if missing or extra:
        raise _fail(path, ", ".join(missing or extra),
                    "every key of " + ", ".join(KEYS) + " and no other",
                    "missing" if missing else "extra keys")
    registered = str(raw["registered"])
    if not _DATE.match(registered):
        raise _fail(path, "registered", "the date it was committed, YYYY-MM-DD", raw["registered"])
    studies = raw["studies"]
    if not isinstance(studies, list) or not studies or not all(isinstance(s, str)
                                                              for s in studies):
        raise _fail(path, "studies", "a non-empty list of study files beside it", studies)
    if not isinstance(raw["family"], str):
        raise _fail(path, "family", "the family file beside it", raw["family"])
    amendments = raw["amendments"] or []
    if not isinstance(amendments, list):
        raise _fail(path, "amendments", "a list (empty before any)", amendments)
    for i, a in enumerate(amendments):
        if (not isinstance(a, Mapping) or set(a) != _AMENDMENT_KEYS
                or not isinstance(a["results_read"], bool)):
            raise _fail(path, f"amendments[{i}]", "a mapping of date, change, reason and "
                        "results_read (true or false: had any result been read?)", a)
    files = tuple(path.parent / name for name in [raw["family"], *studies])
    for f in files:
        if not f.is_file():
            raise RegistrationError(f"{path}: it registers {f.name}, which is not a file beside "
                                    "it.")
    return Registration(path, str(raw["registration"]), registered, files,
                        digest_of(path, files), tuple(amendments))


def digest_of(path: Path, files: Iterable[Path]) -> str:
    """SHA-256 over the registration file and the files it registers, each after its name."""
    h = hashlib.sha256()
    for f in (path, *files):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def registration_of(name: Any, source: str) -> Registration | None:
    """The registration a study file names (``registration: FILE``, beside ``source``), checked
    to register that study file; None when it names none."""
    if name is None:
        return None
    if not isinstance(name, str) or source.startswith("<"):
        raise RegistrationError(f"{source}: key `registration`: expected the registration file "
                                f"beside the study file. Found {name!r}.")
    study = Path(source).resolve()
    registration = load_registration(study.parent / name)
    if study not in {f.resolve() for f in registration.files}:
        raise RegistrationError(f"{source}: key `registration`: {name} registers "
                         f"{', '.join(f.name for f in registration.files)}, not this file; add it "
                         "to its `studies` (an amendment, if any run exists).")
    return registration


def check_runs(registration: Registration | None, records: Iterable[Mapping[str, Any]],
               source: str) -> None:
    """Refuse runs computed under another registration than the study's (or under one, for a study
    that has none)."""
    want = None if registration is None else registration.digest
    for r in records:
        got = r.get("registration")
        if got != want:
            raise RegistrationError(
                f"{source}: run {r['run_id']} was computed under registration "
                f"{got or 'none'}, and the study is registered as {want or 'none'}: a registered "
                "file changed after runs existed. List the change under `amendments` (with "
                "results_read) and compute the runs afresh (diff2 experiment --fresh), or take "
                "the files the runs were computed under.")
