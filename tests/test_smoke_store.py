from pathlib import Path

import pytest

from store import Store, UnavailableError


async def test_enqueue_then_claim_hands_out_the_rollout(store: Store) -> None:
    [rollout] = await store.enqueue([{"input": {"q": "1+1"}}])
    [claim] = await store.claim("w1")
    assert claim.rollout.rollout_id == rollout.rollout_id
    assert claim.attempt.sequence_id == 1
    assert await store.claim("w2") == []


async def test_a_database_that_cannot_be_opened_is_an_unavailable_error_saying_why(tmp_path: Path) -> None:
    """``rollway serve --db missing/x.db`` used to end in 80 lines of SQLAlchemy traceback saying "unable to open
    database file"; the store now says which database, why, and (SQLite) that the directory is missing."""
    missing = tmp_path / "missing" / "x.db"
    with pytest.raises(UnavailableError, match=f"the directory {tmp_path / 'missing'} does not exist"):
        await Store.open(f"sqlite:///{missing}")
    assert not missing.parent.exists()
    with pytest.raises(UnavailableError, match=f"{tmp_path} is a directory: give a file in it"):
        await Store.open(str(tmp_path))  # --db . or --db data/
    with pytest.raises(UnavailableError, match=r"cannot open the database postgresql://rw:\*\*\*@127\.0\.0\.1:1/x"):
        await Store.open("postgresql://rw:secret@127.0.0.1:1/x")  # nothing listens on port 1; password not shown
