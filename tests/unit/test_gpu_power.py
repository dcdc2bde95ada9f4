"""`thermal.power_limit_w` and `llm-appliance gpu-power apply|restore`, on the fake NVML.

The clamping is a pure function (a table). Apply and restore run the real command
(`cli.main`) against `tests/fakes/fake_pynvml.py`: the limit set within the card's
range, a card that refuses, the default back at stop, and after a crash (no restore
ran) the next start's apply or restore putting back what the last one set.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from appliance import cli, gpu_power
from appliance.config import parse_config
from appliance.gpu_power import used_gpus
from appliance.policy.power_limit import clamp_limit_mw
from tests.fakes.fake_pynvml import FakeGpu, FakeNvml, NoPermission, NotSupported

W = 1000  # mW per W


@pytest.mark.parametrize(
    ("wanted_w", "low", "high", "expected_mw", "note"),
    [
        (300, 150 * W, 600 * W, 300 * W, ""),  # inside the range: as asked
        (150, 150 * W, 600 * W, 150 * W, ""),  # the minimum itself
        (600, 150 * W, 600 * W, 600 * W, ""),  # the maximum itself
        (100, 150 * W, 600 * W, 150 * W, "raised to the card's minimum 150 W"),
        (700, 150 * W, 600 * W, 600 * W, "lowered to the card's maximum 600 W"),
        (400, 100 * W, 350 * W, 350 * W, "lowered to the card's maximum 350 W"),
        # A range upside down (a driver quirk): never more than the card's maximum.
        (300, 400 * W, 250 * W, 250 * W, "lowered to the card's maximum 250 W"),
        (1, 1_500, 600 * W, 1_500, "raised to the card's minimum 1.5 W"),
    ],
)
def test_clamp_limit(wanted_w: int, low: int, high: int, expected_mw: int, note: str) -> None:
    assert clamp_limit_mw(wanted_w, low, high) == (expected_mw, note)


@pytest.mark.parametrize(
    ("raw", "count", "expected"),
    [
        ({}, 2, [0, 1]),
        ({}, 12, list(range(8))),  # "auto": the first eight, as the engines
        ({"engine": {"device": "cpu"}}, 2, []),
        ({"engine": {"gpus": [1]}}, 2, [1]),
        ({"engine": {"gpus": [1, 3]}}, 2, [1]),  # absent ones are the daemon's error
        (
            {"models": [{"name": "a", "gpus": [0]}, {"name": "b", "gpus": [2]}]},
            4,
            [0, 2],
        ),
    ],
)
def test_used_gpus(raw: dict[str, object], count: int, expected: list[int]) -> None:
    assert used_gpus(parse_config(raw), count) == expected


class Box:
    """A config file, the fake NVML installed, the record and audit log in tmp_path."""

    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch, fake: FakeNvml) -> None:
        self.tmp, self.fake = tmp, fake
        self.config = tmp / "config.toml"
        self.record = tmp / "run" / "gpu-power.json"
        self.audit = tmp / "state" / "audit.log"
        (tmp / "state").mkdir(mode=0o700)
        monkeypatch.setenv(gpu_power.RECORD_ENV, str(self.record))
        monkeypatch.setenv("JOURNAL_STREAM", "8:1")  # journal lines to stderr, not syslog
        fake.install(monkeypatch)
        self.configure(0)

    def configure(self, watts: int, extra: str = "") -> None:
        keys = self.tmp / "state" / "keys.json"
        self.config.write_text(
            f'[gateway]\nkeys_file = "{keys}"\n[thermal]\npower_limit_w = {watts}\n{extra}'
        )

    def run(self, action: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
        rc = cli.main(["gpu-power", action, "--config", str(self.config)])
        out = capsys.readouterr()
        return rc, out.out, out.err

    def limits_w(self) -> list[float]:
        return [g.power_limit_mw / W for g in self.fake.gpus]

    def audit_lines(self) -> list[dict[str, object]]:
        if not self.audit.exists():
            return []
        return [json.loads(line) for line in self.audit.read_text().splitlines()]


@pytest.fixture
def box(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Box:
    return Box(tmp_path, monkeypatch, FakeNvml([FakeGpu(), FakeGpu()]))


def test_apply_sets_every_used_gpu_and_restore_puts_the_default_back(
    box: Box, capsys: pytest.CaptureFixture[str]
) -> None:
    box.configure(300)
    rc, out, err = box.run("apply", capsys)
    assert (rc, err) == (0, "")
    assert box.limits_w() == [300, 300]
    assert "gpu0 (GPU-fake-0000): power limit 450 W -> 300 W" in out
    lines = box.audit_lines()
    assert [(x["action"], x["target"], x["outcome"]) for x in lines] == [
        ("gpu.power_limit", "gpu:0", "ok"),
        ("gpu.power_limit", "gpu:1", "ok"),
    ]
    assert lines[0]["detail"] == {
        "gpu": 0,
        "uuid": "GPU-fake-0000",
        "before_w": 450,
        "set_w": 300,
        "default_w": 450,
        "min_w": 150,
        "max_w": 600,
        "enforced_w": 300,
    }
    assert box.record.exists()
    # A second apply (a restart) finds them set: nothing changes, nothing audited.
    rc, out, _ = box.run("apply", capsys)
    assert rc == 0 and "already 300 W" in out and len(box.audit_lines()) == 2

    rc, out, err = box.run("restore", capsys)
    assert (rc, err) == (0, "")
    assert box.limits_w() == [450, 450]
    assert "power limit 300 W -> 450 W (the card's default)" in out
    assert [x["detail"]["set_w"] for x in box.audit_lines()[2:]] == [450, 450]  # type: ignore[index]
    assert not box.record.exists()


def test_apply_clamps_to_the_cards_range(box: Box, capsys: pytest.CaptureFixture[str]) -> None:
    box.fake.gpus[1].power_constraints_mw = (100 * W, 350 * W)
    box.configure(400)
    rc, out, _ = box.run("apply", capsys)
    assert rc == 0
    assert box.limits_w() == [400, 350]
    assert "gpu1 (GPU-fake-0001): power limit 450 W -> 350 W (lowered to the card's " in out


def test_apply_touches_only_the_configured_gpus(
    box: Box, capsys: pytest.CaptureFixture[str]
) -> None:
    box.configure(300, "[engine]\ngpus = [1]\n")
    assert box.run("apply", capsys)[0] == 0
    assert box.limits_w() == [450, 300]


@pytest.mark.parametrize(
    ("error", "why"),
    [
        (NoPermission, "NVML refused"),
        (NotSupported, "this card has no settable power limit"),
    ],
)
def test_a_card_that_refuses_is_named_and_the_others_still_set(
    box: Box, capsys: pytest.CaptureFixture[str], error: type[Exception], why: str
) -> None:
    box.fake.gpus[0].set_power_error = error
    box.configure(300)
    rc, _, err = box.run("apply", capsys)
    assert rc == 1
    assert f"gpu0 (GPU-fake-0000): {why}" in err
    assert box.limits_w() == [450, 300]
    assert [(x["target"], x["outcome"]) for x in box.audit_lines()] == [
        ("gpu:0", "refused"),
        ("gpu:1", "ok"),
    ]
    # The refused card was not changed, so it is not in the record: a later
    # power_limit_w = 0 has only GPU 1 to put back.
    box.configure(0)
    rc, _, err = box.run("apply", capsys)
    assert (rc, err) == (0, "")
    assert box.limits_w() == [450, 450]


def test_after_a_crash_the_next_apply_puts_back_what_the_last_one_set(
    box: Box, capsys: pytest.CaptureFixture[str]
) -> None:
    box.configure(300)
    assert box.run("apply", capsys)[0] == 0
    # No restore ran (the box lost power under systemd, ...), and the admin turned the
    # limit off meanwhile: the next start's apply restores the default from the record.
    box.configure(0)
    rc, _, err = box.run("apply", capsys)
    assert (rc, err) == (0, "")
    assert box.limits_w() == [450, 450]
    assert not box.record.exists()


def test_after_a_crash_a_gpu_dropped_from_the_config_is_put_back(
    box: Box, capsys: pytest.CaptureFixture[str]
) -> None:
    box.configure(300)
    assert box.run("apply", capsys)[0] == 0
    box.configure(250, "[engine]\ngpus = [0]\n")
    assert box.run("apply", capsys)[0] == 0
    assert box.limits_w() == [250, 450]
    assert box.run("restore", capsys)[0] == 0
    assert box.limits_w() == [450, 450]


def test_restore_without_a_record_goes_by_the_config(
    box: Box, capsys: pytest.CaptureFixture[str]
) -> None:
    box.configure(300)
    assert box.run("apply", capsys)[0] == 0
    box.record.unlink()  # /run emptied, the driver kept its setting
    assert box.run("restore", capsys)[0] == 0
    assert box.limits_w() == [450, 450]


def test_zero_with_nothing_to_undo_never_opens_nvml(
    box: Box, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = box.run("apply", capsys)
    assert rc == 0 and "power_limit_w = 0" in out
    assert box.fake.init_calls == 0 and box.limits_w() == [450, 450]


def test_not_root_is_a_clear_error(
    box: Box, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu_power.os, "geteuid", lambda: 1000)
    box.configure(300)
    rc, _, err = box.run("apply", capsys)
    assert rc == 1
    assert "must run as root" in err and "ExecStartPre=+" in err
    assert box.fake.init_calls == 0 and box.limits_w() == [450, 450]


def test_nvml_that_cannot_start_is_a_clear_error(
    box: Box, capsys: pytest.CaptureFixture[str]
) -> None:
    box.fake.init_error = NoPermission
    box.configure(300)
    rc, _, err = box.run("apply", capsys)
    assert rc == 1 and "NVML cannot be used" in err


def test_a_bad_value_is_a_config_error(box: Box, capsys: pytest.CaptureFixture[str]) -> None:
    box.configure(-5)
    rc, _, err = box.run("apply", capsys)
    assert rc == 2 and "thermal.power_limit_w" in err


@pytest.mark.parametrize("action", ["apply", "restore"])
def test_a_config_broken_while_running_still_gets_the_default_back(
    box: Box, capsys: pytest.CaptureFixture[str], action: str
) -> None:
    box.configure(300)
    assert box.run("apply", capsys)[0] == 0
    box.config.write_text('[thermal]\npower_limit_w = "300"\n')  # a typo, then a stop
    rc, _out, err = box.run(action, capsys)
    assert rc == 2 and "thermal.power_limit_w" in err
    assert box.limits_w() == [450, 450] and not box.record.exists()
