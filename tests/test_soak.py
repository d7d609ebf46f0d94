"""A short soak in CI: a minute of random client kills, server kills, rolling restarts and client
forks (the defaults of `bicodec-shm soak`); nothing lost, wrong, hung or leaked."""

from __future__ import annotations

import json
import re

import pytest

from bicodec_shm.cli import main


@pytest.mark.slow
def test_one_minute_soak_with_kills_rolling_restarts_and_forks(tmp_path, capsys):
    out = tmp_path / "soak.json"
    # The defaults are the full fault mix at one-minute rates: only the load is lowered here.
    rc = main(["soak", "--clients", "6", "--kill-every", "1.5", "--json", str(out)])
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


def test_soak_help_shows_every_default_and_the_defaults_are_the_full_fault_mix(capsys):
    with pytest.raises(SystemExit):
        main(["soak", "--help"])
    options = " ".join(capsys.readouterr().out.split("options:")[1].split())  # argparse wraps lines
    shown = dict(re.findall(r"(--[a-z-]+) [A-Z_]+ [^(]*(?:\([^d][^)]*\) )*\(default: ([^)]*)\)", options))
    assert shown == {"--duration": "60.0", "--clients": "8", "--kill-every": "1.0",
                     "--kill-server-every": "20.0", "--term-server-every": "15.0",
                     "--fork-every": "4.0", "--seed": "0", "--slots": "64", "--pool": "48",
                     "--max-len": "150", "--json": "None"}  # fmt: skip
    assert "the server's architecture (random weights) (default: tiny)" in options
