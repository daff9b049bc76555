"""A bounded seeded fuzz of the public API (tests/fuzz_api.py): every call returns a result equal
to the independent reference or raises a TypeError / ValueError naming an argument; no raw
exception, no wrong result.
``scripts/fuzz_api.py`` runs bigger budgets and prints the counts."""

from __future__ import annotations

import fuzz_api


def test_fuzz_public_api_no_raw_exceptions_no_wrong_results():
    stats = fuzz_api.run(4000, seed=0)
    c = stats.counts
    assert c["raw"] == 0 and c["wrong"] == 0 and c["unclear"] == 0, "\n".join(stats.failures)
    assert sum(c.values()) == 4000
    # the fuzzer reaches both sides: valid calls checked against the reference, and bad ones refused
    assert c["correct"] > 1000 and c["clear"] > 1000, dict(c)
