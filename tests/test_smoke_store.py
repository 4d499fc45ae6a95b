from store import Store


async def test_enqueue_then_claim_hands_out_the_rollout(store: Store) -> None:
    [rollout] = await store.enqueue([{"input": {"q": "1+1"}}])
    [claim] = await store.claim("w1")
    assert claim.rollout.rollout_id == rollout.rollout_id
    assert claim.attempt.sequence_id == 1
    assert await store.claim("w2") == []
