"""Issue 37, finding 7: ``audit verify`` with the wrong ``--key`` says so once, and does not
claim that a ledger full of checkpoints has none."""

from __future__ import annotations

from ledger.audit import verify_ledger
from ledger.note import Verifier
from ledger.records import ContributorRegistered
from tests.ledger.conftest import ORIGIN, contributor
from verify.keys import SigningKey


def test_wrong_key_is_one_finding_and_checkpoints_are_counted(open_ledger) -> None:  # noqa: ANN001
    ledger = open_ledger()
    for i in range(5):
        ledger.append(ContributorRegistered(contributor(i), f"c{i}", 1))
        ledger.checkpoint()
    wrong = Verifier(ORIGIN, 0x01, SigningKey.from_seed(b"\x77" * 32).public)
    report = verify_ledger(ledger.store, log_key=wrong)
    assert not report.ok
    assert len(report.findings) == 1
    assert "none of the ledger's 5 checkpoints can verify" in str(report.findings[0])
    assert not any("no checkpoint" in w for w in report.warnings)
