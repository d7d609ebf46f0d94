"""A short soak in CI: random client and server kills for about a minute; nothing lost or wrong."""

from __future__ import annotations

import json

import pytest

from bicodec_shm.cli import main


@pytest.mark.slow
def test_one_minute_soak_with_client_and_server_kills(tmp_path, capsys):
    out = tmp_path / "soak.json"
    rc = main(["soak", "--duration", "60", "--clients", "6", "--kill-every", "1.5",
               "--kill-server-every", "25", "--json", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert result["lost"] == 0 and result["wrong_audio"] == 0
    assert result["leaked_slots"] == 0 and result["left_in_dev_shm"] == 0
    assert result["client_kills"] > 0 and result["server_kills"] >= 1
    assert result["correct"] > 50
    assert "lost (never answered)" in printed
