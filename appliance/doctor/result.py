"""What every doctor check returns, and the service account the checks judge against."""

from __future__ import annotations

import grp
import os
import pwd
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from appliance import paths

Status = Literal["ok", "fail", "na"]
SYMBOLS: dict[Status, str] = {"ok": "✓", "fail": "✗", "na": "–"}

DEFAULT_SERVICE_USER = paths.SERVICE_USER


@dataclass(frozen=True)
class Result:
    """One line of the report: ✓ (ok), ✗ (fail: ``fix`` says what to do) or – (na: the
    check does not apply here, ``detail`` says why). ``data`` carries the figures behind
    the line for ``--json`` readers (versions, bytes, pids)."""

    name: str
    status: Status
    detail: str
    fix: str = ""
    data: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A ✗ that does not say what to do is half a diagnosis; refuse to make one.
        if self.status == "fail" and not self.fix:
            raise ValueError(f"check {self.name!r} failed without saying what to do")

    @property
    def symbol(self) -> str:
        return SYMBOLS[self.status]

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "symbol": self.symbol,
            "detail": self.detail,
            "fix": self.fix or None,
            "data": dict(self.data),
        }


def ok(name: str, detail: str, /, **data: Any) -> Result:
    return Result(name, "ok", detail, data=data)


def fail(name: str, detail: str, fix: str, /, **data: Any) -> Result:
    return Result(name, "fail", detail, fix, data=data)


def na(name: str, detail: str, /, **data: Any) -> Result:
    return Result(name, "na", detail, data=data)


@dataclass(frozen=True)
class Account:
    """The account the daemon runs as: its files must be its own, readable by it and by
    nobody else."""

    name: str
    uid: int
    gid: int
    groups: frozenset[int] = frozenset()
    home: str = "/"

    @classmethod
    def lookup(cls, name: str) -> Account | None:
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            return None
        groups = frozenset(os.getgrouplist(pw.pw_name, pw.pw_gid))
        return cls(pw.pw_name, pw.pw_uid, pw.pw_gid, groups, pw.pw_dir or "/")

    @classmethod
    def current(cls) -> Account:
        uid = os.geteuid()
        try:
            pw = pwd.getpwuid(uid)
        except KeyError:  # a uid without a passwd entry (containers)
            return cls(str(uid), uid, os.getegid(), frozenset(os.getgroups()), "/")
        return cls.lookup(pw.pw_name) or cls(pw.pw_name, uid, os.getegid())

    def owner_name(self, uid: int) -> str:
        try:
            return pwd.getpwuid(uid).pw_name
        except KeyError:
            return f"uid {uid}"

    @property
    def chown_spec(self) -> str:
        try:
            group = grp.getgrgid(self.gid).gr_name
        except KeyError:
            group = str(self.gid)
        return f"{self.name}:{group}"


def service_account(unit_user: str | None = None) -> Account:
    """Whose files these should be: the unit's ``User=`` when systemd knows the unit, else
    the account the role creates when it exists, else whoever runs the doctor (a
    checkout, where the daemon runs as its developer)."""
    for name in (unit_user, DEFAULT_SERVICE_USER):
        if name:
            account = Account.lookup(name)
            if account is not None:
                return account
    return Account.current()


def gib(n: float | None) -> str:
    """Bytes for a person: GiB with one decimal, MiB below 1 GiB (small models)."""
    if n is None:
        return "?"
    return f"{n / 2**30:.1f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.0f} MiB"


def octal_mode(mode: int) -> str:
    return f"{mode & 0o7777:04o}"
