from pathlib import Path

import pytest

from rollway.store import Store, UnavailableError


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


async def test_a_new_sqlite_file_and_its_log_are_readable_by_their_owner_only(tmp_path: Path) -> None:
    """The file holds the backends' API keys: created 0600 whatever the umask (SQLite gives its -wal the same)."""
    path = tmp_path / "rollway.db"
    store = await Store.open(str(path))
    try:
        await store.put_model("policy", [{"base_url": "http://b/v1", "model": "m", "api_key": "sk-upstream-secret"}])
        modes = _modes(tmp_path)
    finally:
        await store.close()
    assert modes["rollway.db"] == 0o600 and modes["rollway.db-wal"] == 0o600
    existing = tmp_path / "shared.db"
    _make(existing, 0o640)
    store = await Store.open(str(existing))  # a file the operator made: its mode is theirs
    await store.close()
    assert _modes(tmp_path)["shared.db"] == 0o640


def _make(path: Path, mode: int) -> None:
    path.touch()
    path.chmod(mode)


def _modes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir()}
