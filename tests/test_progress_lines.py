"""What ``fedsm simulate`` prints for a site the round clipped and for one it left out."""

from __future__ import annotations

import io

from engine.cli.progress import TerminalProgress


def test_a_clipped_update_is_not_reported_as_left_out():
    # Prepare
    out = io.StringIO()
    progress = TerminalProgress(stream=out)

    # Execute: robust aggregation clipped site6's update (it stays in the round); site2's was refused
    progress({"event": "error", "method": "fedsm", "round": 2, "site": "site6", "clipped": True,
              "message": "the selector update from site6 changes the model 2.06 times as much as the round's median "
                         "site; clipped to 2 x the median ([robust] clip)"})
    progress({"event": "error", "method": "fedsm", "round": 2, "site": "site2", "message": "its update is not finite"})

    # Assert
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("fedsm: round 2: site site6 clipped: the selector update")
    assert lines[1] == "fedsm: round 2: site site2 left out: its update is not finite"
