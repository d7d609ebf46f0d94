"""A short soak in CI: a minute of random client kills, server kills, rolling restarts and client
forks; nothing lost, wrong, hung or leaked."""

from __future__ import annotations

import json

import pytest

from bicodec_shm.cli import main


@pytest.mark.slow
def test_one_minute_soak_with_kills_rolling_restarts_and_forks(tmp_path, capsys):
    out = tmp_path / "soak.json"
    rc = main(["soak", "--duration", "60", "--clients", "6", "--kill-every", "1.5",
               "--kill-server-every", "25", "--term-server-every", "15", "--fork-every", "4",
               "--json", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert result["lost"] == 0 and result["wrong_audio"] == 0
    assert result["leaked_slots"] == 0 and result["left_in_dev_shm"] == 0
    assert result["hung_clients"] == 0
    assert result["client_kills"] > 0 and result["server_kills"] >= 1
    assert result["server_term_restarts"] >= 1 and result["client_forks"] >= 1
    assert result["correct"] > 50
    assert "lost (never answered)" in printed
